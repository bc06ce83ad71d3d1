"""GEMM against a float32 reference on fresh random inputs, ragged shapes included."""
from __future__ import annotations

import random

import pytest
import torch

import tk_backend
from tk_backend import reference
from tests.accuracy import assert_close

pytestmark = pytest.mark.gpu

SHAPES = [
    (128, 256, 64), (256, 512, 128), (1024, 1024, 1024), (1, 8, 8), (7, 24, 40), (129, 257, 65),
    (1000, 1000, 1000), (333, 4104, 520), (4096, 4096, 64), (2048, 6144, 4096), (3, 5, 11), (77, 13, 9),
    # short K (every k-slice of a tile in the ring at once), one with consumer 1's rows past M
    (64, 1000, 256), (1100, 2100, 192),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gemm_matches_reference(m, n, k, trans_b, dtype, seed):
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn((n, k) if trans_b else (k, n), device="cuda", dtype=dtype)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    tk_backend.gemm(a, b, trans_b=trans_b, out=out)
    torch.cuda.synchronize()
    ref = reference.gemm(a, b, trans_b)
    assert_close(out, ref, rel=1e-2, atol=0.05 * k**0.5, what=f"gemm {m}x{n}x{k} trans_b={trans_b} seed={seed}")


def test_gemm_random_shapes(seed):
    rng = random.Random(seed)
    for _ in range(12):
        m, n, k = rng.randint(1, 700), rng.randint(1, 700), rng.randint(1, 700)
        trans_b = rng.random() < 0.5
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn((n, k) if trans_b else (k, n), device="cuda", dtype=torch.bfloat16)
        out = tk_backend.gemm(a, b, trans_b=trans_b)
        torch.cuda.synchronize()
        assert_close(out, reference.gemm(a, b, trans_b), rel=1e-2, atol=0.05 * k**0.5,
                     what=f"gemm {m}x{n}x{k} trans_b={trans_b} seed={seed}")


def test_gemm_strided_views(seed):
    big = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    a = big[:, 128:640]  # row stride 1024, not contiguous
    bt = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16).T  # column-major view -> copied
    out = tk_backend.gemm(a, bt)
    torch.cuda.synchronize()
    assert_close(out, reference.gemm(a, bt), rel=1e-2, atol=1.0, what="strided")


def test_gemm_cuda_graph_capture(seed):
    a = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(512, 384, device="cuda", dtype=torch.bfloat16)
    tk_backend.gemm(a, b, out=out)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tk_backend.gemm(a, b, out=out)
    a.copy_(torch.randn_like(a))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_close(out, reference.gemm(a, b), rel=1e-2, atol=1.0, what="graph replay")


def test_gemm_chained_calls_see_each_other(seed):
    """Back-to-back GEMMs overlap (programmatic dependent launch): each must still read the one before it complete,
    and not write over what that one still reads; eager and in a graph that starts with a memset node."""
    a = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    b1 = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) / 16
    b2 = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16) / 16
    b3 = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    c1, c2 = torch.empty(1024, 512, device="cuda", dtype=torch.bfloat16), torch.empty(1024, 64, device="cuda", dtype=torch.bfloat16)

    def chain():
        c1.zero_()
        tk_backend.gemm(a, b1, out=c1)
        tk_backend.gemm(c1, b2, out=c2)  # reads c1 as the first writes it
        tk_backend.gemm(c2, b3, out=c1)  # overwrites c1, which the second read
        return c1

    want1 = reference.gemm(a, b1).to(torch.bfloat16)
    want2 = reference.gemm(want1, b2).to(torch.bfloat16)
    want = reference.gemm(want2, b3)
    for _ in range(3):
        assert_close(chain().clone(), want, rel=2e-2, atol=1.0, what="eager chain")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    for _ in range(3):
        c1.fill_(float("nan")), c2.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_close(c1, want, rel=2e-2, atol=1.0, what="graph chain")


def test_gemm_under_torch_compile(seed):
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(192, 128, device="cuda", dtype=torch.bfloat16)
    f = torch.compile(lambda x, y: torch.ops.tk.gemm(x, y, True) * 2, fullgraph=True)
    out = f(a, b)
    torch.cuda.synchronize()
    assert_close(out, 2 * reference.gemm(a, b, True), rel=1e-2, atol=1.0, what="torch.compile")
