"""Fast tier: the DSL's building blocks on the GPU (compiled standalone in seconds, no torch headers).

TMA round trips for each swizzle width (ragged extents: zero-filled loads, clipped stores), wgmma for
several N with A from shared memory and from registers and B in both major-nesses, and register maps,
reductions, broadcasts and masks in both fragment layouts.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "csrc" / "tests" / "primitives.cu"


def _nvcc() -> str:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    return shutil.which("nvcc") or os.path.join(home, "bin", "nvcc")


@pytest.fixture(scope="module")
def prims():
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted((ROOT / "csrc").rglob("*.cuh")) + [SOURCE]))
    lib_path = pathlib.Path(tempfile.gettempdir()) / f"tk_prims_{digest.hexdigest()[:12]}.so"
    if not lib_path.exists():
        cmd = [_nvcc(), "-std=c++20", "-O2", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a",
               "-shared", "-Xcompiler", "-fPIC", "-o", str(lib_path), str(SOURCE)]
        subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(lib_path))
    for fn in (lib.tk_prim_roundtrip, lib.tk_prim_mma, lib.tk_prim_mma8, lib.tk_prim_maps, lib.tk_prim_handoff):
        fn.restype = ctypes.c_int
    return lib


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


ROUNDTRIPS = [  # variant, dtype, tile rows, tile cols
    (0, torch.bfloat16, 64, 16), (1, torch.bfloat16, 64, 32), (2, torch.bfloat16, 64, 64),
    (3, torch.bfloat16, 128, 192), (4, torch.bfloat16, 64, 64), (5, torch.float32, 64, 32),
]


@pytest.mark.parametrize("variant,dtype,tr,tc", ROUNDTRIPS)
def test_tma_roundtrip(prims, variant, dtype, tr, tc):
    align = 16 // torch.empty((), dtype=dtype).element_size()
    for rows, cols in [(tr, tc), (3 * tr + 5, 2 * tc + align)]:  # exact, then ragged in both dims
        x = torch.randn(rows, cols, device="cuda").to(dtype)
        out = torch.full_like(x, float("nan"))
        assert prims.tk_prim_roundtrip(variant, _ptr(x), _ptr(out), rows, cols) == 0
        assert torch.equal(out, x), f"variant {variant} {rows}x{cols}: round trip changed the data"


@pytest.mark.parametrize("n", [16, 64, 128, 256])
@pytest.mark.parametrize("a_regs", [False, True])
@pytest.mark.parametrize("b_is_nk", [False, True])
def test_wgmma(prims, n, a_regs, b_is_nk):
    k = 64
    a = torch.randn(64, k, device="cuda").bfloat16()
    b = torch.randn((n, k) if b_is_nk else (k, n), device="cuda").bfloat16()
    d = torch.full((64, n), float("nan"), device="cuda")
    assert prims.tk_prim_mma(n, int(a_regs) | (int(b_is_nk) << 1), _ptr(a), _ptr(b), _ptr(d)) == 0
    ref = a.double() @ (b.double().T if b_is_nk else b.double())
    err = ((d.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"wgmma N={n} a_regs={a_regs} b_is_nk={b_is_nk}: relative error {err:.2e}"


@pytest.mark.parametrize("n", [16, 64, 128, 256])
def test_wgmma_transposed_shared_a(prims, n):
    """mm_AtB: A given as K x 64 in shared memory (MN-major descriptor), used transposed."""
    k = 64
    a_km = torch.randn(k, 64, device="cuda").bfloat16()
    b = torch.randn(k, n, device="cuda").bfloat16()
    d = torch.full((64, n), float("nan"), device="cuda")
    assert prims.tk_prim_mma(n, 4, _ptr(a_km), _ptr(b), _ptr(d)) == 0
    ref = a_km.double().T @ b.double()
    err = ((d.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"wgmma A^T (shared, K x 64) N={n}: relative error {err:.2e}"


@pytest.mark.parametrize("n", [16, 64, 128, 256])
def test_wgmma_leading_columns(prims, n):
    """mma_AB_leading: a register A's first 32 columns (written by copy_leading; the rest NaN) times B's first 32
    rows, as D=64 prefill's half tiles multiply."""
    a = torch.randn(64, 64, device="cuda").bfloat16()
    b = torch.randn(64, n, device="cuda").bfloat16()
    d = torch.full((64, n), float("nan"), device="cuda")
    assert prims.tk_prim_mma(n, 5, _ptr(a), _ptr(b), _ptr(d)) == 0
    ref = a[:, :32].double() @ b[:32].double()
    err = ((d.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"wgmma leading 32 of 64 columns N={n}: relative error {err:.2e}"


@pytest.mark.parametrize("n", [16, 64, 128, 256])
@pytest.mark.parametrize("k", [64, 128])
def test_wgmma_e4m3(prims, n, k):
    """e4m3 x e4m3 wgmma (m64nNk32), A 64 x K and B N x K in shared memory. Products of e4m3 values are exact, but
    Hopper's FP8 tensor cores accumulate with fewer bits than fp32 (measured on an H200: relative error 7.5e-5 at
    K = 64, 1.3e-4 at K = 128; 16-bit wgmma's is ~1e-7); a misplaced fragment or swizzle errs by O(1)."""
    a = (4 * torch.randn(64, k, device="cuda")).to(torch.float8_e4m3fn)
    b = (4 * torch.randn(n, k, device="cuda")).to(torch.float8_e4m3fn)
    d = torch.full((64, n), float("nan"), device="cuda")
    assert prims.tk_prim_mma8(n, k, _ptr(a), _ptr(b), _ptr(d)) == 0
    ref = a.double() @ b.double().T
    err = ((d.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-3, f"e4m3 wgmma N={n} K={k}: relative error {err:.2e}"


@pytest.mark.parametrize("col_layout", [False, True])
def test_maps_reductions_masks(prims, col_layout):
    x = torch.randn(32, 64, device="cuda")
    out = torch.full((6, 32, 64), float("nan"), device="cuda")
    assert prims.tk_prim_maps(int(col_layout), _ptr(x), _ptr(out)) == 0
    torch.testing.assert_close(out[0], torch.exp2(x - x.amax(1, keepdim=True)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1], x.sum(1, keepdim=True).expand(32, 64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[2], x.sum(0, keepdim=True).expand(32, 64), rtol=1e-5, atol=1e-5)
    keep = torch.ones(32, 64, device="cuda", dtype=torch.bool).tril()
    torch.testing.assert_close(out[3], torch.where(keep, x, torch.full_like(x, -1.0)))
    if not col_layout:  # mask_cols: each row keeps an interval of columns (rows / columns offset by 3 / 5)
        row = torch.arange(32, device="cuda")[:, None] + 3
        col = torch.arange(64, device="cuda")[None, :] + 5
        kept = (col >= row - 8) & (col <= row + 20)
        torch.testing.assert_close(out[4], torch.where(kept, x, torch.full_like(x, -2.0)))
    torch.testing.assert_close(out[5], x[:, :32].amax(1, keepdim=True).expand(32, 64))  # row_max_leading<2>


def test_mbarrier_handoff(prims):
    """lcsf's fed-task hand-off in miniature: 1,000 records through a two-slot ring, every word seen by four warps
    (compute-sanitizer --tool racecheck reports hazards on it: the tool does not follow the mbarriers' ordering)."""
    rounds = 1000
    out = torch.full((4,), -1, device="cuda", dtype=torch.int32)
    assert prims.tk_prim_handoff(rounds, _ptr(out)) == 0
    want = sum(range(rounds * 12)) % 1_000_000_007
    assert out.tolist() == [want] * 4
