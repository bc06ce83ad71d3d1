"""Model of wip/packed's task list (attn_prefill::task with g.pack, and run's task count): every (pair, query block)
is run exactly once, the first blocks by packed tasks of up to three consecutive pairs of one L2 group.

    python3 ab/packed_model.py      # sweeps batch, heads, lengths and group sizes; prints the cases checked
"""
import itertools


def ceil_div(a, b):
    return -(-a // b)


def tasks_of(batch, hq, n, hpg, consumers=3, qrows=64):
    q_blocks = ceil_div(n, consumers * qrows)
    pack = int(ceil_div(n, qrows) % consumers == 1)
    pairs = batch * hq
    plain = q_blocks - pack

    def group_tasks(heads):
        return heads * plain + (ceil_div(heads, consumers) if pack else 0)

    groups = ceil_div(pairs, hpg)
    last = pairs - (groups - 1) * hpg
    count = (groups - 1) * group_tasks(hpg) + group_tasks(last)
    per_group = hpg * (q_blocks - pack) + pack * ceil_div(hpg, consumers)  # the kernel's expression
    assert per_group == group_tasks(hpg)
    seen = []
    for tid in range(count):
        group, first = tid // per_group, tid // per_group * hpg
        in_group = tid - group * per_group
        in_heads = min(hpg, pairs - first)
        packed = in_group - (q_blocks - pack) * in_heads
        if pack and packed >= 0:
            pair0 = first + packed * consumers
            k = min(consumers, first + in_heads - pair0)
            assert 1 <= k <= consumers, (tid, k)
            seen += [(pair0 + c, 0) for c in range(k)]
        else:
            qb = q_blocks - 1 - in_group // in_heads
            pair = first + in_group % in_heads
            assert qb >= pack, (tid, qb)
            seen.append((pair, qb))
    want = sorted(itertools.product(range(pairs), range(q_blocks)))
    assert sorted(seen) == want, (batch, hq, n, hpg)
    return count, pack


checked = 0
for batch, hq, n, hpg in itertools.product([1, 2, 3, 7, 64], [1, 2, 3, 5, 8, 32], [1, 40, 64, 65, 200, 1000, 1024,
                                                                                     1100, 4096], [1, 2, 3, 4, 7, 95]):
    hpg = min(hpg, batch * hq)
    tasks_of(batch, hq, n, hpg)
    checked += 1
print(f"{checked} cases: every (pair, block) once")
