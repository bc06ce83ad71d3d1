#!/usr/bin/env bash
# Stall samples per SASS instruction (ncu SourceCounters, scripts/ncu_pair.py --sass) for tk's prefill kernels and
# FA3's on the same inputs, the shapes where issue 3 misses: D=128 causal n=1024 (two consumers), D=64 causal n=4096
# (two), D=64 full n=2048 (three: the same tile work as causal n=4096), and, rebuilt with prefill-d64-three-all, D=64
# causal n=4096 on three consumers. ab/sass_mix.py sums the pages into $OUT/sass_mix.txt (instruction mix and code
# regions, tk beside FA3). A device call brings back at most 8 files, so the pages themselves stay in /tmp/ncu_pages
# unless KEEP_PAGES=1. `bash ab/probe_prefill_sass.sh tk` samples tk's two two-consumer shapes only (~30 s).
set -uo pipefail
cd "$(dirname "$0")/.."
pages="$OUT/ncu"
ncu_sass() { timeout -k 5 120 python3 scripts/ncu_pair.py prefill "$@" --sass 2>&1 | head -1; }
ncu_sass 64 16 1024 128 --causal
ncu_sass 16 32 4096 64 --causal
mv "$pages/sass_tk_16_32_4096_64_causal.csv" "$pages/sass_tk_16_32_4096_64_causal_two.csv"
if [ "${1:-}" != tk ]; then
  ncu_sass 64 16 1024 128 --causal --side fa3
  ncu_sass 16 32 4096 64 --causal --side fa3
  ncu_sass 16 32 2048 64
  if git apply ab/prefill-d64-three-all.patch; then
    if MAX_JOBS=16 python3 setup.py build_ext --inplace > /tmp/build_three_all.log 2>&1; then
      ncu_sass 16 32 4096 64 --causal
      mv "$pages/sass_tk_16_32_4096_64_causal.csv" "$pages/sass_tk_16_32_4096_64_causal_three.csv"
    else
      tail -5 /tmp/build_three_all.log
    fi
    git apply -R ab/prefill-d64-three-all.patch
  fi
fi
rm -f "$pages"/*.ncu-rep
python3 ab/sass_mix.py "$pages"/sass_*.csv > "$OUT/sass_mix.txt" && head -30 "$OUT/sass_mix.txt"
[ "${KEEP_PAGES:-0}" = 1 ] || { rm -rf /tmp/ncu_pages; mv "$pages" /tmp/ncu_pages; }
