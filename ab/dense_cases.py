"""The bench's dense prefill cases for the ab/ probes (repeat_prefill.py, power_probe.py): a spec 'D:N:full|causal'
gives scripts/benches/attention.py's (case, impls, flops) for the bench's shape at that head dim and length."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "benches")]

import attention  # noqa: E402  (scripts/benches/attention.py)
import benchlib  # noqa: E402,F401  (re-exported for the probes)


def dense(spec: str) -> tuple[str, dict, int]:
    d, n, mask = spec.split(":")
    d, n = int(d), int(n)
    return attention.dense_impls(attention.TOKENS // n, n, dict(attention.DENSE)[d], d, mask == "causal")
