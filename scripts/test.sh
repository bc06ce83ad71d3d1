#!/usr/bin/env bash
# README test command: set up a fresh machine, compile the extension (proves the DSL builds for sm_90a),
# run every test. CPU tests always run; GPU tests run on an sm_90 GPU and skip with a reason elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ -f scripts/install_cpu_vllm.sh ]; then bash scripts/install_cpu_vllm.sh; fi
python3 -m pytest -q -rs tests "$@"
