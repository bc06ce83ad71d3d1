"""Paged decode (flash_attn_with_kvcache, PagedDecode) against the float32 reference, and under CUDA-graph replay."""
from __future__ import annotations

import random

import pytest
import torch

import tk_backend
from tk_backend import reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu


def _cache(rng, batch, contexts, block_size, hkv, d, dtype=torch.bfloat16):
    max_blocks = max(-(-c // block_size) for c in contexts) + 2
    num_blocks = batch * max_blocks + 3
    kv = torch.randn(num_blocks, block_size, hkv, 2 * d, device="cuda", dtype=dtype)
    table = torch.randperm(num_blocks, device="cuda")[: batch * max_blocks].to(torch.int32).view(batch, max_blocks)
    return kv[..., :d], kv[..., d:], table.contiguous()


def _check_against_reference(rng, contexts, q_len, block_size, hkv, group, d, what):
    """Random paged K/V and queries for these contexts; out and lse (written into poisoned buffers) against the
    float32 reference."""
    batch = len(contexts)
    k_cache, v_cache, table = _cache(rng, batch, contexts, block_size, hkv, d)
    q = torch.randn(batch, q_len, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, return_softmax_lse=True)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.decode(q, k_cache, v_cache, seqlens, table)
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    assert_close(lse, ref_lse, rel=1e-3, atol=1e-3, what=what + " lse")


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("group", [4, 8])
def test_decode(q_len, block_size, group, seed):
    rng = random.Random(seed)
    batch, hkv, d = 6, 2, 128
    contexts = [rng.choice([q_len, rng.randint(q_len, 300), rng.randint(1000, 20000)]) for _ in range(batch)]
    _check_against_reference(rng, contexts, q_len, block_size, hkv, group, d,
                             f"decode q_len={q_len} bs={block_size} group={group} ctx={contexts} seed={seed}")


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_many_items_per_cta(block_size, seed):
    """A batch of 64 with contexts from 1 to 6000 tokens: several split-KV items per CTA, so every hand-over from
    one item to the next (and every item's ragged last tile) runs."""
    rng = random.Random(seed)
    batch, hkv, group, d = 64, 2, 4, 128
    contexts = [rng.randint(1, 6000) for _ in range(batch)]
    _check_against_reference(rng, contexts, 1, block_size, hkv, group, d,
                             f"decode many items bs={block_size} ctx={contexts} seed={seed}")


@pytest.mark.parametrize("window,softcap", [((128, 0), 0.0), ((-1, -1), 20.0)])
def test_decode_window_softcap(window, softcap, seed):
    rng = random.Random(seed)
    contexts = [rng.randint(1, 3000) for _ in range(4)]
    k_cache, v_cache, table = _cache(rng, 4, contexts, 32, 4, 64, torch.float16)
    q = torch.randn(4, 2, 16, 64, device="cuda", dtype=torch.float16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda").clamp_min(2)
    out = tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    ref = reference.decode(q, k_cache, v_cache, seqlens, table, window_size=window, softcap=softcap)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"window={window} softcap={softcap} seed={seed}")


def test_decode_graph_replay(seed):
    """Capture once; replay after the contexts and block tables change (as a serving engine does)."""
    rng = random.Random(seed)
    batch, d = 8, 128
    k_cache, v_cache, table = _cache(rng, batch, [4000] * batch, 16, 8, d)
    q = torch.randn(batch, 1, 32, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.full((batch,), 100, dtype=torch.int32, device="cuda")
    check_graph_replay(rng, q, k_cache, v_cache, seqlens, table, 4000, f"graph replay seed={seed}")


def check_graph_replay(rng, q, k_cache, v_cache, seqlens, table, max_len, what, rounds=2, **kw):
    """flash_attn_with_kvcache(**kw) captured once, then replayed `rounds` times with new lengths (up to max_len),
    a shuffled block table and new queries, each replay against the reference."""
    out = torch.empty_like(q)
    tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, **kw)
    batch = q.shape[0]
    for _ in range(rounds):
        seqlens.copy_(torch.tensor([rng.randint(1, max_len) for _ in range(batch)], dtype=torch.int32))
        table.copy_(table[torch.randperm(batch, device="cuda")])
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.decode(q, k_cache, v_cache, seqlens, table, **kw)[0]
        assert_close(out, ref, rel=2e-2, atol=2e-2, what=what)


# ---- the split-KV decode kernel (csrc/kernels/decode.cu) through PagedDecode: its plan and workspace, read ----

from tk_backend import attention as _attention, decode_balanced, decode_plan  # noqa: E402


def _split_decode(q, k_cache, v_cache, seqlens, table, window=(-1, -1), softcap=0.0, num_splits=0, out=None):
    """(the PagedDecode, out, lse) of one split-kernel run, on a workspace pool of its own."""
    decode = _attention.PagedDecode(_attention.DecodeWorkspacePool()).plan(
        seqlens, table, num_q_heads=q.shape[2], num_kv_heads=k_cache.shape[2], head_dim=q.shape[3],
        page_size=k_cache.shape[1], q_len=q.shape[1], window_size=window, num_splits=num_splits)
    assert decode.split_plan is not None, "q_len x group > 64: not the split kernel"
    out, lse = decode.run(q, k_cache, v_cache, out, softcap=softcap, return_softmax_lse=True)
    return decode, out, lse


@pytest.mark.parametrize("q_len,group", [(1, 4), (1, 8), (4, 8), (16, 4)])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_splits", [0, 1, 3])  # 1: one item a segment, written without the merge
def test_split_decode(q_len, group, block_size, num_splits, seed):
    rng = random.Random(seed)
    batch, hkv, d = 5, 2, 128
    contexts = [rng.choice([q_len, rng.randint(q_len, 700), rng.randint(2000, 30000)]) for _ in range(batch)]
    k_cache, v_cache, table = _cache(rng, batch, contexts, block_size, hkv, d)
    q = torch.randn(batch, q_len, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    _, _, lse = _split_decode(q, k_cache, v_cache, seqlens, table, num_splits=num_splits, out=out)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference.decode(q, k_cache, v_cache, seqlens, table)
    what = f"split decode q_len={q_len} group={group} bs={block_size} splits={num_splits} ctx={contexts} seed={seed}"
    assert_close(out, ref_out, rel=2e-2, atol=2e-2, what=what)
    assert_close(lse, ref_lse, rel=1e-3, atol=1e-3, what=what + " lse")


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("window,softcap", [((-1, -1), 0.0), ((200, 0), 0.0), ((-1, -1), 25.0)])
def test_split_decode_head_dims_window_softcap(d, window, softcap, seed):
    rng = random.Random(seed)
    contexts = [rng.randint(1, 5000) for _ in range(3)]
    k_cache, v_cache, table = _cache(rng, 3, contexts, 32, 2, d, torch.float16)
    q = torch.randn(3, 2, 8, d, device="cuda", dtype=torch.float16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda").clamp_min(2)
    _, out, _ = _split_decode(q, k_cache, v_cache, seqlens, table, window, softcap)
    torch.cuda.synchronize()
    ref = reference.decode(q, k_cache, v_cache, seqlens, table, window_size=window, softcap=softcap)[0]
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"split d={d} window={window} softcap={softcap} seed={seed}")


@pytest.mark.parametrize("window", [(-1, -1), (300, 0)])
@pytest.mark.parametrize("batch", [7, 600])
def test_schedule_kernel_matches_build_work_list(window, batch, seed):
    """The op's on-device schedule equals decode_plan.build_work_list (the planner the CPU tests check). A batch of
    600 takes the schedule's scans over the sequences past one block's width (256 threads in the split kernel, 512
    in balanced mode's schedule kernel)."""
    rng = random.Random(seed)
    hkv, group, d, block_size = 2, 4, 128, 16
    longest = 20000 if batch < 100 else 3000
    contexts = [rng.choice([0, 1, rng.randint(2, 900), rng.randint(900, longest)]) for _ in range(batch)]
    k_cache, v_cache, table = _cache(rng, batch, [max(c, 1) for c in contexts], block_size, hkv, d)
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    decode, _, _ = _split_decode(q, k_cache, v_cache, seqlens, table, window)
    plan, used = decode.split_plan, decode.workspace
    # Direct mode (a CTA per slot, no schedule to work out): the attention kernel writes the slots for the merge,
    # and the CTA ranges are not used. With one split a segment as well there is no merge, and so no slots.
    direct = plan.max_items <= plan.num_ctas
    if decode.balanced:  # the stream offsets and each CTA's first segment (decode_balanced.schedule)
        assert used.capacity == decode_balanced.workspace_items(batch, plan.num_ctas)
        seq_at, first = decode_balanced.schedule(contexts, hkv, plan.num_ctas, plan.item_overhead_tokens,
                                                 table.shape[1] * block_size, 1, window[0])
        torch.cuda.synchronize()
        assert used.work_items.view(-1).view(torch.int64)[: batch + 1].tolist() == seq_at, f"contexts={contexts}"
        assert used.cta_start.tolist() == first, f"contexts={contexts} seed={seed}"
        return
    expected = decode_plan.DecodeWorkspace.allocate(plan, q.device)
    decode_plan.build_work_list(plan, seqlens, expected)
    torch.cuda.synchronize()
    if direct and plan.max_splits == 1:
        return
    assert torch.equal(used.work_items, expected.work_items), f"contexts={contexts} seed={seed} direct={direct}"
    if not direct:
        assert torch.equal(used.cta_start, expected.cta_start), f"contexts={contexts} seed={seed}"


def test_forced_splits_keep_the_static_schedule(seed):
    """A forced num_splits with more slots than CTAs runs the static schedule (not balanced mode): its work
    list equals decode_plan.build_work_list, and the output the reference."""
    rng = random.Random(seed)
    batch, hkv, group, d, block_size, splits = 40, 2, 4, 128, 16, 2
    contexts = [rng.choice([0, 1, rng.randint(2, 900), rng.randint(900, 6000)]) for _ in range(batch)]
    k_cache, v_cache, table = _cache(rng, batch, [max(c, 1) for c in contexts], block_size, hkv, d)
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    decode, _, _ = _split_decode(q, k_cache, v_cache, seqlens, table, num_splits=splits, out=out)
    plan, used = decode.split_plan, decode.workspace
    assert plan.max_items > plan.num_ctas and not decode.balanced, plan  # the scheduled (not direct) static path
    expected = decode_plan.DecodeWorkspace.allocate(plan, q.device)
    decode_plan.build_work_list(plan, seqlens, expected)
    torch.cuda.synchronize()
    assert torch.equal(used.work_items, expected.work_items), f"contexts={contexts} seed={seed}"
    assert torch.equal(used.cta_start, expected.cta_start), f"contexts={contexts} seed={seed}"
    ref, _ = reference.decode(q, k_cache, v_cache, seqlens, table)
    live = seqlens > 0
    assert_close(out[live], ref[live], rel=2e-2, atol=2e-2, what=f"forced splits contexts={contexts} seed={seed}")


@pytest.mark.parametrize("batch,contexts", [(3, [700, 1, 0]), (64, None)])
def test_direct_and_scheduled_modes_agree_with_the_reference(batch, contexts, seed):
    """Few slots run a CTA each (no schedule), many go through the schedule: both match the reference."""
    rng = random.Random(seed)
    hkv, group, d, block_size = 8, 4, 128, 16
    contexts = contexts or [rng.randint(1, 3000) for _ in range(batch)]
    k_cache, v_cache, table = _cache(rng, batch, [max(c, 1) for c in contexts], block_size, hkv, d)
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    num_sms, name = _attention._device_info(q.device)
    plan = decode_plan.make_plan(batch, table.shape[1] * block_size, 1, hkv * group, hkv, d, block_size, num_sms,
                                 -1, 0, name)
    assert (plan.max_items <= plan.num_ctas) == (batch == 3), plan  # the two cases cover the two modes
    out = torch.full_like(q, float("nan"))
    _split_decode(q, k_cache, v_cache, seqlens, table, out=out)
    ref, _ = reference.decode(q, k_cache, v_cache, seqlens, table, d**-0.5, True, (-1, -1), 0.0)
    live = seqlens > 0
    assert_close(out[live], ref[live], rel=2e-2, atol=2e-2, what=f"batch={batch} seed={seed}")


def test_wide_table_short_contexts_and_padding(seed):
    """Short contexts under a block table sized for 128k tokens, with zero-length requests padding the batch (as
    vLLM's max_model_len-wide table and its CUDA-graph batch are): most slots are empty, and the CTAs pass them."""
    rng = random.Random(seed)
    batch, hkv, group, d, block_size = 12, 8, 4, 128, 16
    contexts = [rng.randint(1, 2000) for _ in range(8)] + [0] * 4
    k_cache, v_cache, table = _cache(rng, batch, [max(c, 1) for c in contexts], block_size, hkv, d)
    wide = 131072 // block_size
    table = torch.cat([table, table[:, :1].expand(batch, wide - table.shape[1])], 1).contiguous()
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    num_sms, name = _attention._device_info(q.device)
    plan = decode_plan.make_plan(batch, table.shape[1] * block_size, 1, hkv * group, hkv, d, block_size, num_sms,
                                 -1, 0, name)
    assert plan.max_items > plan.num_ctas and plan.max_splits > 8, plan  # scheduled, mostly empty slots
    out = torch.full_like(q, float("nan"))
    _, lse = tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, table, out=out, return_softmax_lse=True)
    ref, ref_lse = reference.decode(q, k_cache, v_cache, seqlens, table)
    live = seqlens > 0
    assert_close(out[live], ref[live], rel=2e-2, atol=2e-2, what=f"wide table seed={seed}")
    assert_close(lse[live], ref_lse[live], rel=1e-3, atol=1e-3, what=f"wide table lse seed={seed}")
    assert (out[~live] == 0).all() and (lse[~live] == float("-inf")).all()


@pytest.mark.parametrize("contexts,width", [
    ([1152 - 128 + (i * 97) % 257 for i in range(60)] + [0] * 4, 131072),  # ragged, padded like a CUDA graph
    ([1024] * 8, 131072),  # short contexts under a max_model_len-wide table
    ([70000, 3, 0, 900], 131072),
])
def test_balanced_mode_on_ragged_batches_and_wide_tables(contexts, width, seed):
    """Balanced mode's pieces (shares of the step's keys; decode_balanced) against the reference, on the shapes it
    is for: ragged contexts with zero-length padding, and short contexts under a wide block table."""
    rng = random.Random(seed)
    batch, hkv, group, d, block_size = len(contexts), 4, 4, 128, 16
    k_cache, v_cache, table = _cache(rng, batch, [max(c, 1) for c in contexts], block_size, hkv, d)
    table = torch.cat([table, table[:, :1].expand(batch, width // block_size - table.shape[1])], 1).contiguous()
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    decode, _, lse = _split_decode(q, k_cache, v_cache, seqlens, table, out=out)
    ref_out, ref_lse = reference.decode(q, k_cache, v_cache, seqlens, table)
    assert decode.balanced and decode.split_plan.max_context == width, decode.split_plan
    what = f"balanced contexts={contexts} width={width} seed={seed}"
    live = seqlens > 0
    assert_close(out[live], ref_out[live], rel=2e-2, atol=2e-2, what=what)
    assert_close(lse[live], ref_lse[live], rel=1e-3, atol=1e-3, what=what + " lse")
    assert (out[~live] == 0).all() and (lse[~live] == float("-inf")).all(), what  # no keys: 0 and -inf


def test_column_slice_of_a_wide_table(seed):
    """The vLLM backend passes a column slice of its max_model_len-wide block table (rows strided by the full width):
    the same output as the contiguous copy, against the reference."""
    rng = random.Random(seed)
    batch, hkv, group, d, block_size = 6, 2, 4, 128, 16
    contexts = [rng.randint(1, 1000) for _ in range(batch)]
    k_cache, v_cache, table = _cache(rng, batch, contexts, block_size, hkv, d)
    wide = torch.cat([table, table[:, :1].expand(batch, 4096 - table.shape[1])], 1).contiguous()
    sliced = wide[:, : table.shape[1]]
    assert sliced.stride(0) == 4096 and not sliced.is_contiguous()
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
    seqlens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    out = tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, sliced)
    same = tk_backend.flash_attn_with_kvcache(q, k_cache, v_cache, seqlens, sliced.contiguous())
    ref, _ = reference.decode(q, k_cache, v_cache, seqlens, table)
    assert torch.equal(out, same)
    assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"column slice seed={seed}")


@pytest.mark.parametrize("mode", ["static", "balanced"])
def test_layers_of_a_step_reuse_the_schedule(mode, seed, monkeypatch):
    """Four "layers" of a step (their own caches and queries; one PagedDecode of the step's lengths): the first run
    builds the work list, the others reuse it (no schedule worked out); another plan's run on the same pool in
    between rebuilds the buffers, and the step's next layer must rebuild too. Then the step under CUDA-graph
    capture (a plan of its own, as vLLM's captured runs have), replayed with changed lengths. Every output
    against the reference."""
    rng = random.Random(seed)
    hkv, group, d, block_size = 2, 4, 128, 16
    if mode == "static":
        batch, width, longest = 64, 6000, 6000
    else:  # short contexts under a max_model_len-wide table: balanced mode
        batch, width, longest = 8, 131072, 1024
    reused = []
    claim = _attention.PagedDecode._claim_schedule
    monkeypatch.setattr(_attention.PagedDecode, "_claim_schedule",
                        lambda decode: reused.append(claim(decode)) or reused[-1])

    def lengths():
        return [rng.randint(1, longest) for _ in range(batch)]

    def layer():
        k_cache, v_cache, table = _cache(rng, batch, [longest] * batch, block_size, hkv, d)
        pad = width // block_size - table.shape[1]
        if pad > 0:
            table = torch.cat([table, table[:, :1].expand(batch, pad)], 1).contiguous()
        q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)
        return q, k_cache, v_cache, table, torch.full_like(q, float("nan"))

    def check(layers, lens, what):
        for i, (q, k_cache, v_cache, table, out) in enumerate(layers):
            ref, _ = reference.decode(q, k_cache, v_cache, lens, table)
            assert_close(out, ref, rel=2e-2, atol=2e-2, what=f"{mode} layer {i} {what} seed={seed}")

    def plan(lens, table):
        return _attention.PagedDecode(pool).plan(lens, table, num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=d,
                                                 page_size=block_size)

    pool = _attention.DecodeWorkspacePool()
    layers = [layer() for _ in range(4)]
    lens = torch.tensor(lengths(), dtype=torch.int32, device="cuda")
    decode = plan(lens, layers[0][3])  # every layer's table has one width: one plan
    assert decode.balanced == (mode == "balanced"), decode.split_plan
    for q, k_cache, v_cache, table, out in layers[:3]:
        decode.run(q, k_cache, v_cache, out, block_table=table)
    q, k_cache, v_cache, table, _ = layer()  # another plan on the same buffers, with other lengths
    other = torch.tensor(lengths(), dtype=torch.int32, device="cuda")
    plan(other, table).run(q, k_cache, v_cache)
    q, k_cache, v_cache, table, out = layers[3]
    decode.run(q, k_cache, v_cache, out, block_table=table)
    torch.cuda.synchronize()
    assert reused == [False, True, True, False, False]
    check(layers, lens, "eager")

    reused.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan(lens, layers[0][3])
        for q, k_cache, v_cache, table, out in layers:
            captured.run(q, k_cache, v_cache, out, block_table=table)
    assert reused == [False, True, True, True]
    for replay in range(2):
        lens.copy_(torch.tensor(lengths(), dtype=torch.int32))
        for _, _, _, _, out in layers:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(layers, lens, f"graph replay {replay}")


def test_captured_and_eager_runs_of_one_plan_each_build_the_schedule(seed):
    """vLLM warms up and captures with one metadata, so one plan: its captured run must build the schedule (a
    replay comes with new lengths; the warm-up's schedule is stale), and an eager run after a capture must build it
    too (the captured run executed nothing). Replays and eager runs against the reference."""
    rng = random.Random(seed)
    batch, hkv, group, d, block_size = 64, 2, 4, 128, 16
    k_cache, v_cache, table = _cache(rng, batch, [6000] * batch, block_size, hkv, d)
    q = torch.randn(batch, 1, hkv * group, d, device="cuda", dtype=torch.bfloat16)

    def lengths():
        return torch.tensor([rng.randint(1, 6000) for _ in range(batch)], dtype=torch.int32)

    def planned(lens):
        decode = _attention.PagedDecode(_attention.DecodeWorkspacePool()).plan(
            lens, table, num_q_heads=hkv * group, num_kv_heads=hkv, head_dim=d, page_size=block_size)
        assert decode.split_plan.max_items > decode.split_plan.num_ctas  # a schedule to work out
        return decode

    def check(out, lens, what):
        torch.cuda.synchronize()
        assert_close(out, reference.decode(q, k_cache, v_cache, lens, table)[0], rel=2e-2, atol=2e-2,
                     what=f"{what} seed={seed}")

    lens = lengths().cuda()
    out = torch.full_like(q, float("nan"))
    warm = planned(lens)
    warm.run(q, k_cache, v_cache, out)  # eager warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        warm.run(q, k_cache, v_cache, out)
    lens.copy_(lengths())
    out.fill_(float("nan"))
    graph.replay()
    check(out, lens, "replay after an eager warm-up")

    fresh = planned(lens)  # uninitialised buffers
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fresh.run(q, k_cache, v_cache, out)
    out.fill_(float("nan"))
    fresh.run(q, k_cache, v_cache, out)
    check(out, lens, "eager after a capture")
