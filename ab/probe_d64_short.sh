#!/usr/bin/env bash
# D=64 at n=1024 (issue 3's FA2 1.5x miss): stall samples per SASS instruction for tk's kernel (full and causal)
# and FA3's (full), and the side-by-side ncu sections with stall reasons (full). The source pages come back
# gzipped in $OUT/ncu for region attribution on the CPU (map addresses onto a cuobjdump of the same build).
set -uo pipefail
cd "$(dirname "$0")/.."
ncu_sass() { timeout -k 5 150 python3 scripts/ncu_pair.py prefill 64 32 1024 64 "$@" --sass 2>&1 | head -2; }
ncu_sass
ncu_sass --causal
ncu_sass --side fa3
timeout -k 5 150 python3 scripts/ncu_pair.py prefill 64 32 1024 64 --stalls > /dev/null 2>&1
rm -f "$OUT"/ncu/*.ncu-rep "$OUT"/ncu/ncu_*.csv
gzip -9 "$OUT"/ncu/sass_*.csv
ls -la "$OUT"/ncu
