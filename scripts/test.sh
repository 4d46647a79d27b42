#!/usr/bin/env bash
# The test command: install what the tests need (the dev extra, lmms-eval), then run the whole suite (slow
# end-to-end tests included). VLMTRAIN_EXTRAS picks other extras (e.g. '' for a core-only job).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLMTRAIN_EXTRAS=${VLMTRAIN_EXTRAS-[dev]}
bash scripts/install.sh
PY=${PYTHON:-python3}
# The dev extra is installed: a test skipped for a missing package of it fails the run (tests/optional_extras.py).
case "$VLMTRAIN_EXTRAS" in
  *dev*) export VLMTRAIN_REQUIRE_EXTRAS=${VLMTRAIN_REQUIRE_EXTRAS:-1} ;;
esac
# Two pytest workers (pytest-xdist): the VLM demo test (~13 min on 2 cores) runs beside the rest of the suite.
# --durations: the slowest tests in every CI log, to keep the run under its 30 minutes.
exec "$PY" -m pytest -q -n "${VLMTRAIN_TEST_WORKERS:-2}" --durations=25 "$@"
