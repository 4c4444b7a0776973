#!/usr/bin/env bash
# GPU machine (the `run` tool, carry .whl): process-mode cuda_graph loop with ROS I/O live at two
# busy-wait lengths in one call: --spin-us 950 (the loop thread never sleeps: the core stays
# awake and its caches warm) for the long row, then --spin-us 200 (the default) as the same-call
# baseline. Writes $OUT/control_h200_spin{950,200}.json + bench logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -m venv /tmp/kv && /tmp/kv/bin/pip install -q --no-index --no-deps --no-compile .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
python3 -c "import sysconfig;print(sysconfig.get_paths()['purelib'])" \
  > /tmp/kv/lib/python3.12/site-packages/zz_torch.pth
export AMENT_PREFIX_PATH=/tmp/kv ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST ROS_DOMAIN_ID=43
export PYTHONUNBUFFERED=1
COMMIT="${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
for spec in "950:${CYCLES_950:-100000}" "200:${CYCLES_200:-20000}"; do
  spin="${spec%%:*}"; cycles="${spec##*:}"
  timeout 200 /tmp/kv/bin/python scripts/bench_control.py --loops-first --backends cuda_graph \
    --step-iters 2000 --loops "cuda_graph@1000:${cycles}:process" --spin-us "$spin" \
    --loop-cpus 2 --publisher-cpus 4,5 --node-cpus 6,7 --rt-priority 80 \
    --label "H200 spin ${spin} us" --commit "$COMMIT" --out "$OUT/control_h200_spin${spin}.json" \
    --note "process mode; loop on CPU 2, node on 6,7, publisher on 4,5; --spin-us ${spin}" \
    2>&1 | tail -25 | tee "$OUT/bench_spin${spin}.txt"
done
