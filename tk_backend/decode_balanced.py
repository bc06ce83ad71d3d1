"""Balanced split-KV decode: the schedule of csrc/kernels/decode.cu's balanced mode, in Python (its reference).

The static schedule of decode_plan gives each CTA whole items, so a CTA can end up with one item more than its
share (with ragged contexts, docs/findings/decode.md#decode-balanced2), and under a wide block table the plan's
chunk leaves most SMs idle. Here the work is split by exact shares instead, independent of the block table's
width:

Stream
    Segments (b, h) in order b-major, h-minor; segment (b, h) holds the visible keys [lo_b, L_b) of sequence b
    (decode_plan's lengths: clamped to max_context, less what the window hides) and costs
    overhead + (L_b - lo_b) cost units (an empty segment costs 0). The segments' costs laid end to end form the
    stream, of total T.
Shares
    CTA c owns the stream's units [c * T // ctas, (c + 1) * T // ctas). A unit inside a segment's overhead
    belongs with the segment's first key; a cut inside a segment's keys moves down to a multiple of `align`
    (the kernel's KV tile: 64 keys at D=128, where balanced mode runs decode_plan.kv_tile's 64-key tiles, 128 at
    D=64, 48 at D=256, 32 there over fp8 caches), but not below the segment's first key, so a piece that continues
    a segment starts on a whole tile and every share stays within `align` keys of exact. A CTA's pieces are the non-empty
    intersections of its range with the segments, in stream order.
Outputs
    A piece that is its segment's whole range writes out / lse directly. Otherwise the piece writes a partial
    (normalised out and lse, as decode_plan's merge describes) into one of its CTA's two slots: slot 2c if the
    piece continues a segment begun in an earlier CTA (the CTA's first piece), else slot 2c + 1 (the segment
    goes on past this CTA: its last piece). A piece that both continues and goes on (a segment longer than a
    share) uses slot 2c. The merge of a cut segment runs in the CTA range [c0, c1] it spans: slot 2c0 + 1, the
    slots 2c of c0 < c < c1, and slot 2c1.
"""
from __future__ import annotations

import dataclasses

from tk_backend.decode_plan import visible  # (lo, L) of one sequence, as the static plan sees it

MAX_CTAS = 1024  # the schedule kernel's limit (csrc/kernels/attention.h DECODE_BALANCED_MAX_CTAS)


@dataclasses.dataclass(frozen=True)
class Piece:
    cta: int
    b: int
    h: int
    start: int  # keys [start, end) of sequence b, kv head h
    end: int
    slot: int  # -1: the segment's only piece (writes out / lse); else the partial slot (2 cta or 2 cta + 1)


def workspace_items(batch: int, ctas: int) -> int:
    """Rows of the workspace balanced mode needs: two partial slots a CTA, and work_items (4 int32 a row) holding
    the int64 stream offsets of the batch's sequences and the total."""
    return max(2 * ctas, (batch + 2) // 2)


def schedule(lengths: list[int], hkv: int, ctas: int, overhead: int, max_context: int, q_len: int = 1,
             window_left: int = -1) -> tuple[list[int], list[int]]:
    """What the schedule kernel (build_balanced) writes: seq_at [batch + 1], the stream offset of each sequence's
    first segment and the total T, and cta_first [ctas + 1], the segment (b * hkv + h) holding the first unit of
    CTA c's share (batch * hkv everywhere when T = 0), and cta_first[ctas] the end of the last non-empty
    sequence's segments (trailing zero-length requests are nobody's). CTA c runs segments
    cta_first[c] ..= cta_first[c + 1]."""
    seq_at, costs = [0], []
    for n in lengths:
        lo, hi = visible(n, max_context, q_len, window_left)
        costs.append(overhead + hi - lo if hi > lo else 0)
        seq_at.append(seq_at[-1] + hkv * costs[-1])
    total, segs = seq_at[-1], len(lengths) * hkv
    first = [segs] * (ctas + 1)
    if total == 0:
        return seq_at, first
    for b, units in enumerate(costs):
        if units == 0:
            continue
        x, y = seq_at[b], seq_at[b + 1]
        if y == total:
            first[ctas] = (b + 1) * hkv
        for c in range(-(-x * ctas // total), min(-(-y * ctas // total), ctas)):
            first[c] = b * hkv + min((c * total // ctas - x) // units, hkv - 1)
    return seq_at, first


def pieces(lengths: list[int], hkv: int, ctas: int, overhead: int, max_context: int, q_len: int = 1,
           window_left: int = -1, align: int = 128) -> list[Piece]:
    """Every CTA's pieces, in CTA order then stream order."""
    segs = []  # (b, h, lo, L, the stream units [at, after) of the segment)
    total = 0
    for b, n in enumerate(lengths):
        lo, hi = visible(n, max_context, q_len, window_left)
        for h in range(hkv):
            if hi > lo:
                segs.append((b, h, lo, hi, total, total + overhead + hi - lo))
                total = segs[-1][5]
    if total == 0:
        return []

    def cut(unit: int, seg) -> int:
        """The key of segment `seg` where stream unit `unit` (inside the segment's units) starts a share."""
        _, _, lo, hi, at, _ = seg
        key = lo + max(unit - at - overhead, 0)  # units in the overhead belong with the first key
        return min(max(key // align * align, lo), hi)

    out = []
    first_seg = 0
    for c in range(ctas):
        begin, end = c * total // ctas, (c + 1) * total // ctas
        while first_seg < len(segs) and segs[first_seg][5] <= begin:
            first_seg += 1
        s = first_seg
        while s < len(segs) and segs[s][4] < end:
            b, h, lo, hi, at, after = segs[s]
            start = cut(begin, segs[s]) if at < begin else lo
            stop = cut(end, segs[s]) if after > end else hi
            if stop > start:
                continues, goes_on = start > lo, stop < hi
                slot = -1 if not (continues or goes_on) else 2 * c if continues else 2 * c + 1
                out.append(Piece(c, b, h, start, stop, slot))
            s += 1
    return out


def merge_slots(lengths: list[int], hkv: int, ctas: int, overhead: int, max_context: int, q_len: int = 1,
                window_left: int = -1, align: int = 128) -> dict[tuple[int, int], list[int]]:
    """What the merge kernel gathers for each segment cut in pieces: the slots of its pieces, in CTA order."""
    slots: dict[tuple[int, int], list[int]] = {}
    for p in pieces(lengths, hkv, ctas, overhead, max_context, q_len, window_left, align):
        if p.slot >= 0:
            slots.setdefault((p.b, p.h), []).append(p.slot)
    return slots
