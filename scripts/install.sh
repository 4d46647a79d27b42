#!/usr/bin/env bash
# Install vlmtrain (editable) into the current Python environment.
# torch: a CPU build of 2.13.0 when no torch is present; an existing torch is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] no torch found: installing torch==2.13.0"
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".${VLMTRAIN_EXTRAS:-[dev]}"
# lmms-eval without its dependencies (they would replace torch): the lmms extra holds what it imports.
case "${VLMTRAIN_EXTRAS:-[dev]}" in
  *dev*|*lmms*) "$PY" -m pip install --quiet --no-deps "lmms-eval==0.7.3" ;;
esac
