#!/usr/bin/env bash
# The test command (`make test`, and CI through .ci/run): lint, then the whole pytest suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k control -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/env.sh"
cd "$ROOT"
echo "[test] ruff check"
ruff check .
echo "[test] pytest"
exec python -m pytest -q "$@"
