"""A model of prefill-q-poll / prefill-q-double's producer-consumer protocol (lcsf ring + the queries' buffers),
run over random interleavings: no deadlock, and each task's S reads its own queries. Session 21: 3000 random
configurations (ring of 2-6 slots, 1-3 consumers, 1-2 query buffers, random task lengths and idle consumers) pass;
the same model without the polling / blocking sends deadlocks in 2106 of them. `python3 ab/q_protocol_model.py`.
"""
import random

def run(S, C, QB, tasks, seed, lag=1):
    rnd = random.Random(seed)
    # tasks: list of (iters, reads mask)
    full = [0]*S; empty_arr = [[0]*C for _ in range(S)]; empty = [0]*S
    q_free = [[0]*C for _ in range(QB)]; q_ready = [[0]*C for _ in range(QB)]
    q_data = [[None]*C for _ in range(QB)]
    def producer():
        stage = 0; fills = [0]*S; uses = [[0]*C for _ in range(QB)]; nxt = [0]*C
        for k,(iters, reads) in enumerate(tasks):
            pending = {c for c in range(C) if reads >> c & 1 and iters > 0}
            def send(block):
                nonlocal pending
                for c in sorted(pending):
                    b = nxt[c]
                    while q_free[b][c] < uses[b][c]:  # k-th use needs k-1 frees
                        if not block: break
                        yield 'wait'
                    else:
                        uses[b][c] += 1; nxt[c] = (b + 1) % QB
                        q_data[b][c] = k; q_ready[b][c] += 1
                        pending = pending - {c}
                        continue
            for it in range(iters):
                if pending and it >= S:
                    yield from send(True)
                while pending and empty[stage] < fills[stage]:
                    yield from send(False); yield 'poll'
                while empty[stage] < fills[stage]: yield 'wait'
                fills[stage] += 1; full[stage] += 1
                stage = (stage + 1) % S
            if pending: yield from send(True)
    def consumer(c):
        stage = 0; reads_n = [0]*S; q_uses = [0]*QB; nxt = 0; held = []
        def release(s):
            empty_arr[s][c] += 1
            if all(empty_arr[s][x] >= empty_arr[s][c] for x in range(C)) and min(empty_arr[s]) > empty[s]:
                empty[s] = min(empty_arr[s])
        for k,(iters, reads) in enumerate(tasks):
            mine = reads >> c & 1 and iters > 0
            if mine:
                b = nxt; nxt = (nxt + 1) % QB; q_uses[b] += 1
                while q_ready[b][c] < q_uses[b]: yield 'wait'
                assert q_data[b][c] == k, (c, k, q_data[b][c])
            for it in range(iters):
                while full[stage] <= reads_n[stage]: yield 'wait'
                reads_n[stage] += 1
                if mine: assert q_data[b][c] == k  # queries still this task's during S
                if mine and it == iters - 1: q_free[b][c] += 1
                held.append(stage)
                while len(held) > lag: release(held.pop(0))
                stage = (stage + 1) % S
                yield 'step'
            while held: release(held.pop(0))
    agents = [producer()] + [consumer(c) for c in range(C)]
    alive = list(range(len(agents))); stuck = 0
    while alive:
        i = rnd.choice(alive)
        try:
            r = next(agents[i])
        except StopIteration:
            alive.remove(i); stuck = 0; continue
        stuck = stuck + 1 if r in ('wait', 'poll') else 0
        if stuck > 20000: return 'DEADLOCK'
    return 'ok'

bad = 0
for seed in range(3000):
    rnd = random.Random(seed)
    S = rnd.choice([2, 3, 4, 6]); C = rnd.choice([1, 2, 3]); QB = rnd.choice([1, 2])
    tasks = [(rnd.choice([0, 1, 2, 3, 5, 9]), rnd.randrange(1 << C)) for _ in range(rnd.randint(1, 12))]
    r = run(S, C, QB, tasks, seed)
    if r != 'ok':
        bad += 1
        if bad < 5: print(seed, S, C, QB, tasks, r)
print('bad', bad)
