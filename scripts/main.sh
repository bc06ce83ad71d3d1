#!/usr/bin/env bash
# README main command: on a Hopper GPU, set up, build and print the benchmark table (tk vs its peers).
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -1 || true)
if [[ "$gpu" != *", 9.0" ]]; then
  echo "tk_backend's main job runs Hopper (sm_90: H100/H200) kernels and needs such a GPU; found: ${gpu:-no NVIDIA GPU}." >&2
  exit 2
fi
bash scripts/setup_env.sh
python3 scripts/bench.py "$@"
