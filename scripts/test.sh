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
if [[ "${1:-}" == "--fast" ]]; then
    shift
    FAST=1
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
# Two parts. First every test that can share the machine, spread over the cores by pytest-xdist
# (KESTREL_TEST_WORKERS, default one worker per core). Then, one at a time, the tests that need
# the machine to themselves: the multi-process DDS and launch tests (node processes with shutdown
# bounds, shared-memory checks of /dev/shm), the timed-loop tests (marker serial) and the GPU
# tests. Both parts always run; the exit status is the first failing part's.
# The whole suite lists its slowest tests: what to look at when it nears its time budget.
DURATIONS=()
[[ "$FAST" == 0 ]] && DURATIONS=(--durations=15)
ALONE="dds or launch or serial or gpu"
if [[ "$FAST" == 1 ]]; then
  PARTS=("not ($ALONE) and not slow" "serial and not (dds or launch or slow or gpu)")
else
  PARTS=("not ($ALONE)" "$ALONE")
fi
status=0
for i in 0 1; do
  WORKERS=()
  [[ "$i" == 0 ]] && WORKERS=(-n "${KESTREL_TEST_WORKERS:-auto}")
  echo "[test] pytest -m '${PARTS[$i]}' ${WORKERS[*]}"
  rc=0
  python -m pytest -q -m "${PARTS[$i]}" "${WORKERS[@]}" "${DURATIONS[@]}" "$@" || rc=$?
  # 5: no test selected (e.g. a -k that only matches the other part)
  if [[ "$rc" != 0 && "$rc" != 5 && "$status" == 0 ]]; then status=$rc; fi
done
exit "$status"
