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


DIVISOR_CHECK = r"""
#include <cstdio>
#include <cstdlib>
#include "kittens/core/divisor.cuh"
int main() {
  unsigned long long state = 88172645463325252ull, checked = 0;
  auto next = [&] { state ^= state << 13; state ^= state >> 7; state ^= state << 17; return state; };
  int ds[6000], nd = 0;
  for (int d = 1; d <= 3000; d++) ds[nd++] = d;
  for (int k = 0; k < 31; k++) {
    ds[nd++] = 1 << k;
    if (k > 0) ds[nd++] = (1 << k) - 1;
    if (k < 30) ds[nd++] = (1 << k) + 1;
  }
  while (nd < 6000) ds[nd++] = int(next() % 0x7fffffffull) + 1;
  for (int i = 0; i < nd; i++) {
    const int d = ds[i];
    const kittens::divisor div(d);
    long long ns[12] = {0, 1, d - 1, d, (long long)d + 1, 0x7fffffffll, 0x7ffffffell, 3ll * d - 1, 1000ll * d};
    for (int j = 9; j < 12; j++) ns[j] = (long long)(next() % 0x80000000ull);
    for (long long n : ns) {
      if (n < 0 || n > 0x7fffffffll) continue;
      checked++;
      if (div.div(int(n)) != int(n / d) || div.mod(int(n)) != int(n % d)) {
        std::printf("wrong: %lld / %d gave %d\n", n, d, div.div(int(n)));
        return 1;
      }
    }
  }
  std::printf("checked %llu\n", checked);
  return 0;
}
"""


def test_divisor_is_exact(tmp_path):
    """kittens::divisor (multiply-and-shift division) against `/` and `%` over divisors 1..3000, powers of two and
    their neighbours and random ones up to 2^31 - 1, each with its edge dividends and random ones (host code)."""
    src = tmp_path / "divisor.cu"
    src.write_text(DIVISOR_CHECK)
    exe = tmp_path / "divisor"
    res = subprocess.run([NVCC, "-std=c++20", f"-I{ROOT / 'csrc'}", str(src), "-o", str(exe)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    assert run.stdout.startswith("checked ")
