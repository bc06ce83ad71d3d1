#!/bin/bash
# Per-kernel durations (ncu, kernels serialized) of one decode call's schedule, split-KV and merge kernels, for a
# few shapes and schedules of ab/probe_cta_times.py. Run from a tree's root: bash ab/probe_decode_ncu.sh [LABEL]
label=${1:-base}
for spec in "8 8192 base" "8 8192 chunk4096_t64" "8 8192 chunk2048_t64" "64 8192 base" "8 32768 base" "1 8192 base"; do
  set -- $spec
  echo "== $label b$1 ctx$2 $3"
  ncu --csv --kernel-name-base function --metrics gpu__time_duration.sum \
    -k 'regex:^(build_schedule|build_balanced|kernel|merge_partials|merge_balanced)$' -s 3 \
    python3 ab/probe_cta_times.py $1 $2 --only $3 2>/dev/null | python3 -c '
import csv, sys, collections
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith("\""))]
head, rows = rows[0], rows[1:]
k, u, v = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
acc = collections.defaultdict(list)
for r in rows:
    acc[(r[k], r[u])].append(float(r[v].replace(",", "")))
for (name, unit), xs in acc.items():
    xs.sort()
    print(f"  {name:20s} median {xs[len(xs) // 2]:9.2f} {unit}  (n={len(xs)})")
'
done
