#!/usr/bin/env bash
# The test command: lint, then pytest.
#   scripts/test.sh            the whole suite (`make test`, and CI through .ci/run)
#   scripts/test.sh --fast     the fast tier (`make test-fast`): unit and in-process node tests;
#                              deselects the markers dds (multi-process over DDS), launch, slow
#                              and gpu (pytest.ini)
# Further arguments go to pytest, e.g. scripts/test.sh -k control -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/env.sh"
cd "$ROOT"
MARKERS=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    MARKERS=(-m "not dds and not launch and not slow and not gpu")
fi
echo "[test] ruff check"
ruff check .
echo "[test] pytest ${MARKERS[*]}"
exec python -m pytest -q "${MARKERS[@]}" "$@"
