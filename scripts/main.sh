#!/usr/bin/env bash
# README main command: on a Hopper GPU, set up and build, then serve a locally built tiny Llama-shaped model
# with vLLM's OpenAI-compatible server on the TK attention backend (scripts/serve_demo.py: one completion,
# one chat completion, a throughput burst, then the server is stopped). Extra arguments go to serve_demo.py.
# The benchmark table is `python3 scripts/bench.py`.
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -1 || true)
if [[ "$gpu" != *", 9.0" ]]; then
  echo "tk_backend's main job runs Hopper (sm_90: H100/H200) kernels and needs such a GPU; found: ${gpu:-no NVIDIA GPU}." >&2
  exit 2
fi
bash scripts/setup_env.sh
PY=${PYTHON:-python3}
if ! $PY -c "import vllm" 2>/dev/null; then
  if [ -f /tmp/vllm_site/env.sh ]; then
    source /tmp/vllm_site/env.sh  # the offline bundle of ../shared/offline-vllm
  else
    echo "== installing vLLM (>= 0.26) and the tokenizer tools for the demo model"
    $PY -m pip install -q "vllm>=0.26" tokenizers
  fi
fi
$PY scripts/serve_demo.py "$@"
