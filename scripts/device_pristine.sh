#!/usr/bin/env bash
# Run here before a `device` call while helpers have work in progress: records their uncommitted csrc
# changes (csrc, python, tests, scripts) so that `bash scripts/device_pristine.sh apply` on the GPU host builds the committed sources only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = apply ]; then
  [ -s .tk_revert.patch ] && patch -R -p1 -s < .tk_revert.patch
  [ -s .tk_skip ] && xargs rm -f < .tk_skip
  exit 0
fi
git ls-files --others --exclude-standard csrc tk_backend tests scripts configs examples > .tk_skip
git diff -- csrc tk_backend tests scripts configs examples pyproject.toml > .tk_revert.patch
git rev-parse HEAD > .tk_commit
