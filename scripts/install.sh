#!/usr/bin/env bash
# Install vlmtrain (editable, from this checkout) into the current Python environment (a venv is best).
#
#   bash scripts/install.sh                           the core: what `vlmtrain demo` needs
#   VLMTRAIN_EXTRAS='[dev]' bash scripts/install.sh   + every optional package the tests use (scripts/test.sh)
#   VLMTRAIN_EXTRAS='[lora,wandb]' ...                any extras of pyproject.toml; [lmms] or [dev] also install
#                                                     lmms-eval without its dependencies (they would replace torch)
#
# torch: an installed torch (CUDA or CPU) is kept. Without one: where an NVIDIA driver answers (nvidia-smi),
# torch==2.13.0 from the package index as configured (PyPI's Linux wheel is the CUDA build); elsewhere the CPU
# build from https://download.pytorch.org/whl/cpu where that index is reachable, else torch==2.13.0 from the
# configured index. The script says which it chose. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${VLMTRAIN_EXTRAS-}
TORCH=torch==2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu

say() { echo "[install] $*"; }

managed_advice() {
  say "$PY is a Python managed by the operating system (PEP 668: pip may not install into it)."
  say "Make a virtual environment, then run this script from it:"
  say "  $PY -m venv .venv && source .venv/bin/activate && bash scripts/install.sh"
  say "(or: apt install python3-venv first, where venv is missing)"
}

# An externally managed interpreter outside a venv (EXTERNALLY-MANAGED beside its standard library) makes pip
# refuse every install: say what to do before trying (PIP_BREAK_SYSTEM_PACKAGES=1 overrides it, as for pip).
managed=$("$PY" -c '
import os, sys, sysconfig
in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
print(int(not in_venv and os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))))')
if [ "$managed" = 1 ] && [ -z "${PIP_BREAK_SYSTEM_PACKAGES:-}" ]; then
  managed_advice
  exit 1
fi

pip_install() {
  local log status=0
  log=$(mktemp)
  "$PY" -m pip install --quiet "$@" 2>&1 | tee "$log" || status=$?
  if [ "$status" != 0 ] && grep -q "externally-managed-environment" "$log"; then
    managed_advice
  fi
  rm -f "$log"
  return "$status"
}

if version=$("$PY" -c "import torch; print(torch.__version__)" 2>/dev/null); then
  say "torch $version is installed: kept"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "no torch; an NVIDIA driver answers (nvidia-smi): installing $TORCH from the package index (CUDA build)"
  pip_install "$TORCH"
elif "$PY" -c '
import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1] + "/torch/", method="HEAD"), timeout=10)' \
    "$CPU_INDEX" >/dev/null 2>&1; then
  say "no torch and no NVIDIA driver: installing the CPU build of $TORCH from $CPU_INDEX"
  pip_install "$TORCH" --index-url "$CPU_INDEX"
else
  say "no torch and no NVIDIA driver, and $CPU_INDEX is not reachable: installing $TORCH from the package" \
      "index as configured (on Linux, PyPI's wheel is the CUDA build, several GB)"
  pip_install "$TORCH"
fi

say "installing vlmtrain (editable) with ${EXTRAS:-no extras (the core)}"
pip_install -e ".${EXTRAS}"
case "$EXTRAS" in
  *dev*|*lmms*)
    say "installing lmms-eval==0.7.3 without its dependencies (the lmms extra holds what it imports)"
    pip_install --no-deps "lmms-eval==0.7.3" ;;
esac
