"""Whether a dense attn_prefill case's time differs between GPUs through clocks and power (GPU).

Each impl of the case is replayed (CUDA graph, the bench's inputs) for a few seconds while nvidia-smi samples the SM
clock, power draw and throttle reasons every 100 ms; prints each impl's time and the medians of its samples, after
the machine's serial, power limit and max clock. Why it matters: docs/findings/README.md (clocks and power).

    python3 scripts/power_probe.py --case 64:1024:causal --seconds 4    # case = head dim : length : full|causal
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch

from dense_cases import benchlib, dense

QUERY = "clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active,temperature.gpu"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="64:1024:causal")
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args()
    _, impls, _ = dense(args.case)
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,serial,power.limit,clocks.max.sm", "--format=csv"],
                         capture_output=True, text=True).stdout.strip())
    for impl, call in benchlib.selected(impls).items():
        ms = benchlib.time_per_call(call, 1)
        reps = max(1, int(args.seconds * 1000 / ms))
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(min(reps, 50)):
                call(0)
        torch.cuda.current_stream().wait_stream(stream)
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                               stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        for _ in range(max(1, reps // 50)):
            graph.replay()
        torch.cuda.synchronize()
        smi.terminate()
        samples = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()[3:]]  # past the idle start
        samples = [s for s in samples if len(s) == 5]
        clock = statistics.median(float(s[0]) for s in samples) if samples else float("nan")
        power = statistics.median(float(s[1]) for s in samples) if samples else float("nan")
        reasons = sorted({s[3] for s in samples})
        print(f"{impl}: {ms:.4f} ms; {len(samples)} samples: SM clock {clock:.0f} MHz, power {power:.0f} W "
              f"(limit {samples[0][2] if samples else '?'} W), throttle reasons {reasons}", flush=True)
        del graph


if __name__ == "__main__":
    main()
