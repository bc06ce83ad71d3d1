"""The read ceiling of a decode case: how fast this GPU streams the case's K/V bytes when nothing else happens
(a read-only kernel over the same cache tensors, contiguous, with the fewest instructions a byte: 16-byte loads
folded by XOR). Decode cannot beat it; issue 48's bar is tk >= 97% of it at B >= 8 and 8k+ contexts. vllm_fa3
read more than the 4.25 TB/s device-to-device copy figure, so the copy is no ceiling for a read-mostly kernel."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the bench then records no ceiling
    triton = None

BLOCK = 4096  # int32 words a program reads each step (16 KB: 16 words a thread at 8 warps)
GRID_PER_SM = (4, 8)  # programs a multiprocessor tried; the fastest counts


if triton is not None:
    @triton.jit
    def _read_xor(src, out, n_words, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n_words, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(src + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
        tl.store(out + pid, tl.xor_sum(acc, 0))


def words(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as int32 words (K / V caches of any element type; the tail past a multiple of
    4 bytes is not read)."""
    flat = t.reshape(-1).view(torch.uint8)
    return flat[: flat.numel() // 4 * 4].view(torch.int32)


def read_calls(tensors: list[torch.Tensor], programs: int):
    """call(i) -> None: one read of every tensor's bytes; and the folded words it leaves (one a program and
    tensor), so a test can check that every word was read."""
    if triton is None:
        raise RuntimeError("triton is not importable")
    srcs = [words(t) for t in tensors]
    outs = [torch.zeros(programs, dtype=torch.int32, device=t.device) for t in srcs]

    def call(_i: int) -> None:
        for src, out in zip(srcs, outs):
            _read_xor[(programs,)](src, out, src.numel(), BLOCK=BLOCK, num_warps=8)

    return call, outs


def read_ceiling_tbps(tensors: list[torch.Tensor], num_sms: int, time_per_call) -> float | None:
    """TB/s of the fastest read of the tensors' bytes (time_per_call: the bench's CUDA-graph timer), or None
    where triton is missing."""
    if triton is None:
        return None
    nbytes = sum(words(t).numel() * 4 for t in tensors)
    best = min(time_per_call(read_calls(tensors, per_sm * num_sms)[0], 1) for per_sm in GRID_PER_SM)
    return nbytes / best / 1e9
