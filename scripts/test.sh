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
# --dist worksteal: each worker starts on half of the tests (tests/conftest.py puts the longest first) and an idle
# one takes the not-yet-started end of the other's queue, so no long test starts late and none waits queued behind
# another ('load' hands out chunks that stay with a worker: a simulation of the measured durations put it 4-6%
# over the ideal split, worksteal within 1-2%).
# --durations: the slowest tests in every CI log, to keep the run under its 40 minutes.
exec "$PY" -m pytest -q -n "${VLMTRAIN_TEST_WORKERS:-2}" --dist worksteal --durations=25 "$@"
