#!/usr/bin/env bash
# Stall samples per SASS instruction (ncu SourceCounters, scripts/ncu_pair.py --sass) for tk's prefill kernels and
# FA3's on the same inputs, the shapes where issue 3 misses: D=128 causal n=1024 (two consumers), D=64 causal n=4096
# (two), D=64 full n=2048 (three: the same tile work as causal n=4096), and, rebuilt with prefill-d64-three-all, D=64
# causal n=4096 on three consumers. The pages land in $OUT/ncu/sass_*.csv. A device call brings back at most 8 files:
# `bash ab/probe_prefill_sass.sh tk` runs tk's two-consumer shapes only (the first two pages).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = tk ]; then
  for shape in "64 16 1024 128" "16 32 4096 64"; do
    # shellcheck disable=SC2086
    timeout -k 5 120 python3 scripts/ncu_pair.py prefill $shape --causal --sass 2>&1 | head -1
  done
  rm -f "$OUT"/ncu/*.ncu-rep
  exit 0
fi
ncu_sass() { timeout -k 5 120 python3 scripts/ncu_pair.py prefill "$@" --sass 2>&1 | head -4; }
ncu_sass 64 16 1024 128 --causal
ncu_sass 64 16 1024 128 --causal --side fa3
ncu_sass 16 32 4096 64 --causal
ncu_sass 16 32 4096 64 --causal --side fa3
ncu_sass 16 32 2048 64
git apply ab/prefill-d64-three-all.patch || exit 1
MAX_JOBS=16 python3 setup.py build_ext --inplace > "$OUT/build_three_all.log" 2>&1 || { tail -5 "$OUT/build_three_all.log"; exit 1; }
mv "$OUT/ncu/sass_tk_16_32_4096_64_causal.csv" "$OUT/ncu/sass_tk_16_32_4096_64_causal_two.csv"
ncu_sass 16 32 4096 64 --causal
mv "$OUT/ncu/sass_tk_16_32_4096_64_causal.csv" "$OUT/ncu/sass_tk_16_32_4096_64_causal_three.csv"
rm -f "$OUT"/ncu/*.ncu-rep
git apply -R ab/prefill-d64-three-all.patch
