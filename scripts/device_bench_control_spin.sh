#!/usr/bin/env bash
# GPU machine (the `run` tool, carry .whl): process-mode cuda_graph loop with ROS I/O live at two
# busy-wait lengths in one call: --spin-us 950 (the loop thread never sleeps: the core stays
# awake and its caches warm) for the long row, then --spin-us 200 (the default) as the same-call
# baseline. Writes $OUT/control_h200_spin{950,200}.json + bench logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# shellcheck source=/dev/null
source scripts/device_ros_env.sh || exit 1  # rclpy + kestrel_interfaces for Python 3.12: $KPY
export ROS_DOMAIN_ID=43 PYTHONUNBUFFERED=1
COMMIT="${1:-${KESTREL_COMMIT:-unknown}}"  # the device copy's git metadata is stale: pass it
for spec in "950:${CYCLES_950:-100000}" "200:${CYCLES_200:-20000}"; do
  spin="${spec%%:*}"; cycles="${spec##*:}"
  timeout 200 "$KPY" scripts/bench_control.py --loops-first --backends cuda_graph \
    --step-iters 2000 --loops "cuda_graph@1000:${cycles}:process" --spin-us "$spin" \
    --loop-cpus 2 --publisher-cpus 4,5 --node-cpus 6,7 --rt-priority 80 \
    --label "H200 spin ${spin} us" --commit "$COMMIT" --out "$OUT/control_h200_spin${spin}.json" \
    --note "process mode; loop on CPU 2, node on 6,7, publisher on 4,5; --spin-us ${spin}" \
    2>&1 | tail -25 | tee "$OUT/bench_spin${spin}.txt"
done
