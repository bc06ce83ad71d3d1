#!/usr/bin/env bash
# Install vLLM 0.33.0 for the CPU test tier, without its GPU libraries and without touching torch.
#
#   bash scripts/install_cpu_vllm.sh [--strict]
#
# The CPU tests of the vLLM plugin (tests/cpu/test_vllm_*.py) import vLLM's attention-backend interfaces,
# configs and argument parser, never its kernels. So vLLM goes in with --no-deps (its requirements pin a torch,
# flashinfer, CUTLASS DSL, ... that a CPU run does not need), followed by exactly the light packages those
# imports need, also with --no-deps: pip never runs a resolver that could replace the installed torch.
# Versions are pinned (found by trial on CPython 3.11, torch 2.14.1; transformers 5.17.0 is what the GPU host
# runs and is inside vLLM 0.33's range).
#
# Idempotent: when a vLLM >= 0.26 is already importable with everything the tests use (e.g. the GPU host's
# offline 0.26.0 bundle), nothing is installed. If the install fails (no network), the vLLM tests skip with a
# reason; the script warns and exits 0, or 1 with --strict.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
STRICT=0
[[ "${1:-}" == "--strict" ]] && STRICT=1

PINNED=(
  vllm==0.33.0
  # imported by vllm.config / vllm.engine.arg_utils / vllm.v1.attention
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 propcache==0.5.4
  yarl==1.25.1
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 einops==0.8.2 msgspec==0.23.0 psutil==7.2.2 pybase64==1.5.1
  pyzmq==27.3.0 uvloop==0.23.0 prometheus-client==0.26.0 partial-json-parser==0.2.1.1.post7 pillow==13.0.0
  fastapi==0.136.3 starlette==1.10.0 annotated-doc==0.0.7
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 truststore==0.10.5 idna==3.20
  oss-harmony==0.0.11 llguidance==1.7.6 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
  # transformers (also what tests/cpu/test_hf_tk.py and examples/ use) and its dependencies
  transformers==5.17.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface-hub==1.33.0 hf-xet==1.8.0
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 tqdm==4.70.1 typer==0.29.2 click==8.5.1
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 shellingham==1.5.4 typing-extensions==4.16.0
)

smoke_test() {
  "$PYTHON" - <<'EOF' 2>&1
import importlib, sys, warnings
warnings.filterwarnings("ignore")
import vllm
from packaging.version import Version
if Version(vllm.__version__).release[:2] < (0, 26):
    sys.exit(f"vLLM {vllm.__version__} is older than 0.26")
for module in ("vllm.config", "vllm.engine.arg_utils", "vllm.v1.attention.backend",
               "vllm.v1.attention.backends.registry", "vllm.v1.kv_cache_interface", "vllm._custom_ops",
               "vllm.utils.argparse_utils", "transformers", "safetensors", "tokenizers"):
    importlib.import_module(module)
print(f"vLLM {vllm.__version__} importable")
EOF
}

fail() {
  echo "install_cpu_vllm.sh: $1" >&2
  echo "install_cpu_vllm.sh: the vLLM CPU tests will be skipped" >&2
  exit "$STRICT"
}

if out=$(smoke_test); then
  echo "install_cpu_vllm.sh: ${out##*$'\n'}; nothing to install"
  exit 0
fi

"$PYTHON" -c "import torch" 2>/dev/null || fail "torch is not importable with $PYTHON; install torch first"
torch_before=$("$PYTHON" -c "import torch; print(torch.__version__)")
"$PYTHON" -m pip install --quiet --no-deps "${PINNED[@]}" || fail "pip install failed (offline?)"
torch_after=$("$PYTHON" -c "import torch; print(torch.__version__)")
[[ "$torch_before" == "$torch_after" ]] || fail "torch changed from $torch_before to $torch_after (should not happen)"

if ! out=$(smoke_test); then
  echo "$out" | tail -5 >&2
  fail "vLLM does not import after the install (a dependency missing from this script's list?)"
fi
echo "install_cpu_vllm.sh: ${out##*$'\n'} (torch $torch_after untouched)"
