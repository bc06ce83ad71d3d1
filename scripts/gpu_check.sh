#!/usr/bin/env bash
# One device call: build against the host's torch, run the GPU tests, benchmark, collect logs in $OUT.
#   scripts/gpu_check.sh [build] [prims] [tests] [test:PATH[ ARGS]] [sanitize] [sanitize:TOOL:FILES[ ARGS]]
#                        [bench:FAMILY] [env:VAR=VALUE] [run:CMD] ...
#   (default: build prims tests bench:gemm)
# Prints a short summary last; full logs and bench/results/h200.json land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/tk_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build prims tests bench:gemm)
summary=()
nvidia-smi --query-gpu=name,serial,driver_version,power.limit,power.max_limit,clocks.max.sm,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv >"$OUT/gpu.txt" 2>&1

for step in "${steps[@]}"; do
  t0=$(date +%s)
  case "$step" in
    build)
      MAX_JOBS=16 TK_PTXAS_VERBOSE=1 python3 setup.py build_ext --inplace >"$OUT/build.log" 2>&1
      rc=$?; [ $rc -ne 0 ] && { grep -E "error" "$OUT/build.log" | head -30; summary+=("build FAILED"); break; }
      python3 -m pytest -q tests/cpu/test_packaging.py -k cxx_runtime 2>&1 | tail -1 ;;  # libstdc++ linked shared
    prims) timeout -k 10 300 python3 -m pytest -q -rs tests/gpu/test_primitives.py 2>&1 | tee "$OUT/prims.log" | tail -15; rc=${PIPESTATUS[0]} ;;
    tests) timeout -k 10 900 python3 -m pytest -q -rsP tests/gpu 2>&1 | tee "$OUT/tests.log" | tail -25; rc=${PIPESTATUS[0]} ;;
    # test:PATH [pytest args]: stops at the first failure, so its report is written before any later call limit
    # (split on spaces, no globbing: node ids like test_x[tiny-hd128] pass as they are)
    test:*) read -ra test_args <<< "${step#test:}"
            timeout -k 10 900 python3 -m pytest -q -x -rsP "${test_args[@]}" 2>&1 | tee -a "$OUT/tests.log" | tail -25; rc=${PIPESTATUS[0]} ;;
    sanitize)
      timeout -k 10 600 compute-sanitizer --tool memcheck --target-processes all python3 -m pytest -q -x tests/gpu/test_gemm.py -k "not compile" \
        >"$OUT/sanitize.log" 2>&1; rc=$?; grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitize.log" | tail -3 ;;
    # sanitize:TOOL[:FILES] [sanitize.py args], e.g. "sanitize:memcheck:fast --resume", "sanitize:racecheck:decode":
    # each file its own compute-sanitizer run within --max-seconds (540 unless given; less when steps share the call)
    sanitize:*) read -ra sanitize_args <<< "${step#sanitize:}"
      spec=${sanitize_args[0]}; files=()
      [[ $spec == *:* ]] && files=(--files "${spec#*:}")
      timeout -k 10 600 python3 scripts/sanitize.py --tool "${spec%%:*}" "${files[@]}" --log "$OUT/sanitizer.log" \
        "${sanitize_args[@]:1}" 2>&1; rc=$?
      cp bench/results/sanitizer.json "$OUT/sanitizer.json" 2>/dev/null ;;
    bench:*)
      timeout -k 10 900 python3 scripts/bench.py --family "${step#bench:}" 2>&1 | tee -a "$OUT/bench.log" | tail -30; rc=${PIPESTATUS[0]}
      cp bench/results/h200.json "$OUT/h200.json" 2>/dev/null ;;
    env:*) export "${step#env:}"; rc=0 ;;
    run:*) timeout -k 10 900 bash -c "${step#run:}" 2>&1 | tee -a "$OUT/run.log" | tail -40; rc=${PIPESTATUS[0]} ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  summary+=("$step rc=$rc $(( $(date +%s) - t0 ))s")
done
echo "== summary: ${summary[*]}"
