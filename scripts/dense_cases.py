"""The bench's dense prefill cases for the prefill probes (repeat_prefill.py, drift_probe.py, power_probe.py).

dense("D:N:full|causal") gives scripts/benches/attention.py's (case, impls, flops) for the bench's shape at that
head dim and length, so a probe times exactly what the bench times. A helper module, not run on its own."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "benches")]

import attention  # noqa: E402  (scripts/benches/attention.py)
import benchlib  # noqa: E402,F401  (re-exported for the probes)


def dense(spec: str) -> tuple[str, dict, int]:
    """The bench case for spec "D:N:full|causal", e.g. "64:1024:causal"."""
    d, n, mask = spec.split(":")
    d, n = int(d), int(n)
    return attention.dense_impls(attention.TOKENS // n, n, dict(attention.DENSE)[d], d, mask == "causal")
