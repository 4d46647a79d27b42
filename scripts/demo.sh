#!/usr/bin/env bash
# The demo command: install the core (what the demo needs; VLMTRAIN_EXTRAS adds extras), then train the demo
# model and print where its results are.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec "$PY" -m vlmtrain demo "$@"
