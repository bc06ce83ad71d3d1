"""The DSL compiles for sm_90a, and its shape contracts fail at compile time with readable messages.

Needs nvcc only (no GPU): CI runs these on every change of csrc/kittens.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
pytestmark = pytest.mark.skipif(not os.path.exists(NVCC), reason="nvcc not found")
FLAGS = ["-std=c++20", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT / 'csrc'}"]


def _compile(source: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    src = tmp_path / "snippet.cu"
    src.write_text(source)
    return subprocess.run([NVCC, *FLAGS, "-c", str(src), "-o", str(tmp_path / "snippet.o")],
                          capture_output=True, text=True)


def test_primitive_kernels_compile(tmp_path):
    res = subprocess.run([NVCC, *FLAGS, "-O1", "-c", str(ROOT / "csrc/tests/primitives.cu"), "-o",
                          str(tmp_path / "p.o")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]


SNIPPET = """
#include "kittens/kittens.cuh"
using namespace kittens;
__global__ void k() {{
  extern __shared__ uint8_t raw[];
  {body}
}}
"""


@pytest.mark.parametrize("body,message", [
    ("rt_fl<16, 64> d; auto& a = *reinterpret_cast<st_bf<64, 64>*>(raw); auto& b = *reinterpret_cast<st_bf<32, 64>*>(raw);"
     " warpgroup::mm_AB(d, a, b);", "mma_AB: b must be K x N"),
    ("rt_bf<16, 64> r; auto& s = *reinterpret_cast<st_bf<32, 64>*>(raw); warpgroup::load(r, s.ref());",
     "the shared tile must be (warps x register-tile rows)"),
    ("rt_fl<24, 64> r;", "multiples of 16"),
    ("auto& s = *reinterpret_cast<st_bf<64, 40>*>(raw); (void)s.ref();", "32, 64 or a multiple of 128 bytes"),
])
def test_layout_errors_are_readable(tmp_path, body, message):
    res = _compile(SNIPPET.format(body=body), tmp_path)
    assert res.returncode != 0, "a wrong layout compiled"
    assert message in res.stderr, res.stderr[-2000:]
