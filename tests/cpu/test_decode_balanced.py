"""decode_balanced: the balanced decode schedule (shares of the step's keys) covers every key once, in slots that
do not collide, near the ideal load, and its pieces' partials merge to full attention."""
from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from tk_backend import attention, decode_balanced, decode_plan

CASES = [  # lengths, hkv, ctas, max_context, q_len, window_left
    ([1152 - 128 + (i * 97) % 257 for i in range(64)], 4, 132, 2048, 1, -1),
    ([1024], 8, 132, 131072, 1, -1),  # a short sequence under a wide table: 8192 keys over 132 CTAs
    ([0, 5, 0, 3000, 1, 17, 0], 2, 16, 4096, 1, -1),  # empty sequences among ragged ones
    ([300, 9000, 40, 2500], 2, 7, 16384, 4, 600),  # q_len 4, a window: visible ranges start mid-sequence
    ([70000, 3], 8, 132, 131072, 1, -1),
]


@pytest.mark.parametrize("align", [64, 128])  # the kernel's K/V tile at D=128 (decode_plan.kv_tile) / D=64
@pytest.mark.parametrize("lengths,hkv,ctas,max_context,q_len,window", CASES)
def test_pieces_tile_every_segment_once_in_unique_slots(lengths, hkv, ctas, max_context, q_len, window, align):
    overhead = 69
    pieces = decode_balanced.pieces(lengths, hkv, ctas, overhead, max_context, q_len, window, align)
    by_segment = defaultdict(list)
    for p in pieces:
        assert 0 <= p.cta < ctas and p.start < p.end
        by_segment[(p.b, p.h)].append(p)
    for b, n in enumerate(lengths):
        lo, hi = decode_balanced.visible(n, max_context, q_len, window)
        for h in range(hkv):
            got = by_segment.get((b, h), [])
            if hi <= lo:
                assert not got
                continue
            assert [p.cta for p in got] == sorted(p.cta for p in got)
            assert got[0].start == lo and got[-1].end == hi
            assert all(a.end == c.start for a, c in zip(got, got[1:]))  # contiguous, no key twice
            assert all(p.start % align == 0 for p in got[1:])  # a continuing piece starts on a tile
            if len(got) == 1:
                assert got[0].slot == -1  # the whole segment: written out directly
            else:
                for p in got:
                    assert p.slot == (2 * p.cta if p.start > lo else 2 * p.cta + 1)
    slots = [p.slot for p in pieces if p.slot >= 0]
    assert len(slots) == len(set(slots)) and all(s < 2 * ctas for s in slots)
    # Each CTA's load is its share, give or take one tile of keys and one overhead a piece it cuts.
    load = defaultdict(int)
    for p in pieces:
        load[p.cta] += overhead + p.end - p.start
    share = sum(load.values()) / ctas
    assert max(load.values()) <= share + 2 * (align + overhead)


@pytest.mark.parametrize("lengths,hkv,ctas,max_context,q_len,window", CASES)
def test_each_cta_finds_its_pieces_from_the_schedule(lengths, hkv, ctas, max_context, q_len, window):
    """The kernel's CTA c walks segments cta_first[c] ..= cta_first[c + 1]: every piece of c lies in that range."""
    seq_at, first = decode_balanced.schedule(lengths, hkv, ctas, 69, max_context, q_len, window)
    live = [b for b, n in enumerate(lengths) if decode_balanced.visible(n, max_context, q_len, window)[1] >
            decode_balanced.visible(n, max_context, q_len, window)[0]]
    assert len(seq_at) == len(lengths) + 1 and len(first) == ctas + 1
    assert first[-1] == ((live[-1] + 1) * hkv if live else len(lengths) * hkv)  # padding past it is nobody's
    assert first == sorted(first)
    for p in decode_balanced.pieces(lengths, hkv, ctas, 69, max_context, q_len, window):
        assert first[p.cta] <= p.b * hkv + p.h <= first[p.cta + 1], p


def test_balance_beats_the_static_schedule_on_a_ragged_batch():
    """The case that motivates it: 64 sequences of 1024-1280 keys, 4 kv heads, on 132 CTAs."""
    lengths = [1152 - 128 + (i * 97) % 257 for i in range(64)]
    hkv, overhead = 4, 69
    pieces = decode_balanced.pieces(lengths, hkv, 132, overhead, 2048)
    load = defaultdict(int)
    for p in pieces:
        load[p.cta] += overhead + p.end - p.start
    ideal = hkv * sum(n + overhead for n in lengths) / 132
    assert max(load.values()) / ideal < 1.1  # the static schedule's busiest CTA: 1.49 of the ideal


def test_workspace_rows_hold_the_slots_and_the_stream_offsets():
    assert decode_balanced.workspace_items(256, 132) == 264
    assert decode_balanced.workspace_items(1000, 132) == 501  # 4 * 501 int32 >= 2 * 1001 for the int64 offsets
    # A wide-table plan has far more slots than balanced mode uses: its workspace is allocated at what it needs.
    plan = decode_plan.make_plan(8, 131072, 1, 32, 4, 128, 16, 132, -1, 0, None)
    assert plan.max_items > 264
    ws = decode_plan.DecodeWorkspace.allocate(plan, "cpu", items=264, needed=decode_balanced.workspace_items(8, 132))
    assert ws.capacity == 264 and ws.partial_out.shape == (264, 1, 8, 128)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_plan.DecodeWorkspace.allocate(plan, "cpu", items=264)


@pytest.mark.parametrize("seed", [0, 1])
def test_pieces_merge_to_full_attention(seed):
    """Each piece's normalised partial (out, lse) over its keys, merged as the merge kernel does (decode_plan's
    merge in torch, over the slots merge_slots lists), equals attention over the segment's keys."""
    rng = random.Random(seed)
    lengths = [rng.choice([0, rng.randint(1, 300), rng.randint(300, 3000)]) for _ in range(6)]
    hkv, ctas, d, group = 2, 9, 16, 3
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lengths), hkv, group, d, generator=gen)
    keys = [torch.randn(max(n, 1), hkv, 2, d, generator=gen) for n in lengths]  # K and V

    def partial(b, h, start, end):
        k, v = keys[b][start:end, h, 0], keys[b][start:end, h, 1]
        s = q[b, h] @ k.T / math.sqrt(d)  # [group, keys]
        lse = torch.logsumexp(s, -1)
        return torch.softmax(s, -1) @ v, lse

    pieces = decode_balanced.pieces(lengths, hkv, ctas, 69, 4096, align=128)
    slot_out = {p.slot: partial(p.b, p.h, p.start, p.end) for p in pieces if p.slot >= 0}
    whole = {(p.b, p.h): partial(p.b, p.h, p.start, p.end) for p in pieces if p.slot < 0}
    for (b, h), slots in decode_balanced.merge_slots(lengths, hkv, ctas, 69, 4096).items():
        outs = torch.stack([slot_out[s][0] for s in slots])[None]  # [1, S, R, D]
        lses = torch.stack([slot_out[s][1] for s in slots])[None]
        out, lse = decode_plan.merge_partials(outs, lses, torch.ones(1, len(slots), dtype=torch.bool))
        whole[(b, h)] = (out[0], lse[0])
    for b, n in enumerate(lengths):
        for h in range(hkv):
            if n == 0:
                assert (b, h) not in whole
                continue
            ref_out, ref_lse = partial(b, h, 0, n)
            torch.testing.assert_close(whole[(b, h)][0], ref_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(whole[(b, h)][1], ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch, context, splits, expected", [
    (64, 1024, 0, False),  # one split a sequence: whole sequences a CTA already, no merge to bring back
    (256, 2048, 0, False),  # the serve layout's plan (two splits under a 2048-token table): static
    (8, 8192, 0, False),  # eight splits: the static plan of uniform contexts is balanced already
    (8, 131072, 0, True),  # a max_model_len-wide table (32 splits)
    (64, 131072, 0, True),  # 16 splits
    (1, 131072, 0, True),  # one long sequence (64 splits)
    (8, 131072, 4, False),  # a forced split keeps the static schedule
    (1, 1024, 0, False),  # direct: a CTA a slot
])
def test_balanced_mode_rule(batch, context, splits, expected):
    plan = decode_plan.make_plan(batch, context, 1, 32, 8, 128, 16, 132, -1, splits, "NVIDIA H200")
    assert attention.balanced_mode(plan, splits) == expected, plan


def test_limits_mirrored_from_the_kernel_header_match_it():
    """The Python planners mirror two limits of csrc/kernels/attention.h; a change on one side must reach the other."""
    import re
    from pathlib import Path

    header = (Path(__file__).resolve().parents[2] / "csrc" / "kernels" / "attention.h").read_text()

    def constant(name: str) -> int:
        found = re.search(rf"constexpr int {name} = (\d+);", header)
        assert found, f"{name} not found in attention.h"
        return int(found.group(1))

    assert constant("DECODE_BALANCED_MAX_CTAS") == decode_balanced.MAX_CTAS
    assert constant("DECODE_MAX_COARSEN_LEVELS") == decode_plan.MAX_COARSEN_LEVELS
