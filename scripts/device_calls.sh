#!/usr/bin/env bash
# The GPU host side of the three kinds of `device` call a session makes (see the `device` tool's notes):
#
#   bash scripts/device_calls.sh fa3 STEP...       carry .whl .whl_ssm .tk_commit: FA3 / FLA / mamba_ssm peers,
#                                                  then scripts/gpu_check.sh STEP... (kernel tests, benches)
#   bash scripts/device_calls.sh vllm-a [STEP...]  carry .offline-vllm/part1 .whl_ssm .tk_commit: stage part 1,
#                                                  editable build (registers the vLLM plugin's entry point),
#                                                  then gpu_check STEP... (kernel tests need no vLLM)
#   bash scripts/device_calls.sh vllm-b STEP...    carry .offline-vllm/part2 .tk_commit, RIGHT after vllm-a
#                                                  (the host keeps /tmp ~30 s): stage part 2, then
#                                                  scripts/gpu_check.sh STEP... with vLLM importable
#   bash scripts/device_calls.sh moe STEP...       carry .offline-vllm/addon_moe .tk_commit, after vllm-b while warm:
#                                                  stage vLLM's MoE kernels (gpt-oss), then gpu_check STEP...
#   bash scripts/device_calls.sh warm STEP...      any later call while the host is still warm (built, vLLM staged):
#                                                  carry .whl_ssm (and .whl for FA3) .tk_commit; no rebuild
#
# The FA3 wheel (60 MiB) and a vLLM part (47 MiB) do not fit in one call (64 MiB), hence the split.
set -uo pipefail
cd "$(dirname "$0")/.."
peers() {  # the small peer wheels (fla-core, mamba_ssm, einops) and, when carried, the FA3 wheel
  local wheels
  shopt -s nullglob
  wheels=(.whl_ssm/*.whl .whl/*.whl)  # whichever were carried
  shopt -u nullglob
  [ ${#wheels[@]} -gt 0 ] || { echo "peer wheels: none carried"; return; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${wheels[@]}" \
    >/dev/null 2>&1 || echo "peer wheels: install failed (benches will skip those peers)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}
[ -f scripts/device_pristine.sh ] && [ -f .tk_revert.patch ] && bash scripts/device_pristine.sh apply
mode=${1:-}; shift || true
case "$mode" in
  fa3) peers; exec bash scripts/gpu_check.sh build "$@" ;;
  vllm-a)
    bash .offline-vllm/part1/stage.sh 2>&1 | tail -1
    MAX_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . > "${OUT:-/tmp}/build.log" 2>&1
    echo "editable build rc=$?"
    # the host's compiler would link a second, static libstdc++ (docs/findings/serving.md#fp8-binding-segv)
    python3 -m pytest -q tests/cpu/test_packaging.py -k cxx_runtime 2>&1 | tail -1
    [ $# -gt 0 ] && { peers; exec bash scripts/gpu_check.sh "$@"; } ;;
  vllm-b)
    bash .offline-vllm/part2/stage.sh 2>&1 | tail -1
    # shellcheck disable=SC1091
    source /tmp/vllm_site/env.sh
    peers
    exec bash scripts/gpu_check.sh "$@" ;;
  moe)
    bash .offline-vllm/addon_moe/stage.sh 2>&1 | tail -1
    # shellcheck disable=SC1091
    [ -f /tmp/vllm_site/env.sh ] && source /tmp/vllm_site/env.sh
    peers
    exec bash scripts/gpu_check.sh "$@" ;;
  warm)
    # shellcheck disable=SC1091
    [ -f /tmp/vllm_site/env.sh ] && source /tmp/vllm_site/env.sh
    peers
    exec bash scripts/gpu_check.sh "$@" ;;
  *) echo "usage: $0 fa3|vllm-a|vllm-b|moe|warm [gpu_check steps...]"; exit 2 ;;
esac
