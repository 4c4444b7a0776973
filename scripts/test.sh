#!/usr/bin/env bash
# The test command: lint, the benchmark gate, then pytest.
#   scripts/test.sh            the whole suite (`make test`, and CI through .ci/run)
#   scripts/test.sh --fast     the fast tier (`make test-fast`): lint and the unit and in-process
#                              node tests; deselects the markers dds (multi-process over DDS),
#                              launch, slow and gpu (pytest.ini), and skips the benchmark gate
# Further arguments go to pytest, e.g. scripts/test.sh -k control -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC1091
source "$ROOT/scripts/env.sh"
cd "$ROOT"
FAST=0
MARKERS=()
if [[ "${1:-}" == "--fast" ]]; then
    shift
    FAST=1
    MARKERS=(-m "not dds and not launch and not slow and not gpu")
fi
echo "[test] ruff check"
ruff check .
if [[ "$FAST" == 0 ]]; then
    # the benchmark regression gate (tools/kestrel_bench/gate.py): same-run ratios of the
    # optimized vs the baseline path, timed interleaved on this CPU, against the committed
    # baseline; 40 % tolerance on ratios (a 2x slower optimized path halves them)
    echo "[test] benchmark gate"
    gate_dir="$(mktemp -d)"
    trap 'rm -rf "$gate_dir"' EXIT
    python -m kestrel_bench paired --out "$gate_dir/gate" > "$gate_dir/paired.log" \
      || { cat "$gate_dir/paired.log"; exit 1; }
    python -m kestrel_bench gate "$gate_dir/gate.json" --baseline docs/benchmarks/gate_cpu.json \
      --only 'ratios.*' --tolerance ratios=0.4
fi
# the whole suite lists its slowest tests: what to look at when it nears its time budget
DURATIONS=()
[[ "$FAST" == 0 ]] && DURATIONS=(--durations=25)
echo "[test] pytest ${MARKERS[*]}"
python -m pytest -q "${MARKERS[@]}" "${DURATIONS[@]}" "$@"
