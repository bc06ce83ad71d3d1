#!/usr/bin/env bash
# The fp8 binding checks' SIGSEGV (docs/findings/serving.md#fp8-binding-segv) with a native backtrace: a preloaded
# SIGSEGV handler (the GPU host has no gdb) prints the frames, and addr2line names the extension's.
set -uo pipefail
cd "$(dirname "$0")/.."
gcc -shared -fPIC -O1 -o /tmp/segv_bt.so scripts/segv_bt.c || exit 1
LD_PRELOAD=/tmp/segv_bt.so python3 -c "from tests.gpu.test_fp8_kv import _binding_checks; _binding_checks()" \
  > /tmp/segv.log 2>&1
echo "rc=$?"
tail -60 /tmp/segv.log
so=$(ls tk_backend/_C*.so | head -1)
grep -o '_C[^ ]*(+0x[0-9a-f]*)' /tmp/segv.log | sed 's/.*(+\(0x[0-9a-f]*\))/\1/' | while read -r off; do
  echo "$off: $(addr2line -f -C -i -e "$so" "$off" | tr '\n' ' ')"
done
