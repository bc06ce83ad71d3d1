"""Why tk's time for one dense attn_prefill case moves from round to round on one machine (GPU).

Rounds of the bench's timing (benchlib.time_per_call) of tk and FA2, each with its median SM clock, power and
temperature (nvidia-smi every 100 ms) and the address of the inputs. First on the same inputs every round, then on
fresh ones every round (the old ones kept alive, so the new ones land elsewhere): if only the second spreads, tk's
time depends on where its inputs lie; if both spread with the clock, on the clock the chip holds at its power cap.
What it showed: docs/findings/prefill.md#fa2-d64-n1024-bar.

    python3 scripts/drift_probe.py --case 64:1024:causal --rounds 6     # case = head dim : length : full|causal
"""
from __future__ import annotations

import argparse
import statistics
import subprocess

import torch

from dense_cases import benchlib, dense

QUERY = "clocks.sm,power.draw,temperature.gpu"


def sampled(call) -> tuple[float, float, float, float]:
    """(ms, median SM clock MHz, median power W, median temperature C) of one time_per_call of call."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    ms = benchlib.time_per_call(call, 1)
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()[2:]]
    rows = [[float(x) for x in r] for r in rows if len(r) == 3]
    med = [statistics.median(r[i] for r in rows) if rows else float("nan") for i in range(3)]
    return ms, med[0], med[1], med[2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="64:1024:causal")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,serial", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip())
    kept = []
    for phase in ("same inputs", "fresh inputs"):
        _, impls, _ = dense(args.case)
        tk_ms = []
        for r in range(args.rounds):
            if phase == "fresh inputs" and r > 0:
                kept.append(impls)
                _, impls, _ = dense(args.case)
            q = impls["tk"].__closure__  # the bench's call closes over q, k, v, out
            ptrs = sorted(c.cell_contents.data_ptr() for c in q if isinstance(c.cell_contents, torch.Tensor))
            line = []
            for impl in ("tk", "fa2"):
                ms, clock, power, temp = sampled(impls[impl])
                if impl == "tk":
                    tk_ms.append(ms)
                line.append(f"{impl} {ms:.4f} ms {clock:.0f} MHz {power:.0f} W {temp:.0f} C")
            print(f"{phase} round {r}: " + " | ".join(line) + f" | inputs at {[hex(p % (1 << 32)) for p in ptrs]}",
                  flush=True)
        print(f"{phase}: tk {min(tk_ms):.4f} / {statistics.median(tk_ms):.4f} / {max(tk_ms):.4f} ms", flush=True)


if __name__ == "__main__":
    main()
