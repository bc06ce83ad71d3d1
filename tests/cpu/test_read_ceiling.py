"""scripts/benches/read_ceiling.py: its read kernel touches every word of the tensors it times (run by Triton's
interpreter here, in a child process: TRITON_INTERPRET must be set before triton loads)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import functools, operator, sys
import torch
sys.path.insert(0, "scripts")
from benches import read_ceiling
k = torch.randn(7, 16, 2, 128).to(torch.bfloat16)       # 14,336 words: 3.5 blocks
v = torch.randn(5, 16, 2, 64).to(torch.float8_e4m3fn)   # 2,560 words of e4m3: under one block
call, outs = read_ceiling.read_calls([k, v], programs=3)
call(0)
for t, out in zip((k, v), outs):
    want = functools.reduce(operator.xor, read_ceiling.words(t).tolist())
    got = functools.reduce(operator.xor, out.tolist())
    assert got == want, (t.dtype, got, want)
assert outs[0].ne(0).all(), "a program read none of k's three blocks"
print("read every word")
"""


def test_read_kernel_reads_every_word():
    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0 and "read every word" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
