"""racecheck probe for lcsf's fed-task ring (D=64 prefill): 128 sequences of 192 tokens x 16 heads, 2,048 tasks,
~16 a CTA, so each CTA's 8-slot ring wraps twice; small enough for compute-sanitizer --tool racecheck (~minutes).

    compute-sanitizer --tool racecheck python3 ab/race_probe_fed.py
"""
import torch

import tk_backend

seqs, n, heads = 128, 192, 16
q = torch.randn(seqs * n, heads, 64, device="cuda", dtype=torch.bfloat16)
k, v = torch.randn_like(q), torch.randn_like(q)
cu = torch.arange(0, (seqs + 1) * n, n, device="cuda", dtype=torch.int32)
out = tk_backend.flash_attn_varlen_func(q, k, v, cu, cu, n, n)
torch.cuda.synchronize()
print("probe ran", tuple(out.shape))
