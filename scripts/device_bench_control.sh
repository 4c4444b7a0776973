#!/usr/bin/env bash
# GPU machine (the `run` tool, carry .whl): the ROS env (scripts/device_ros_env.sh), then the control benchmark (loops first), then the control GPU tests.
#   bash scripts/device_bench_control.sh <commit>   (writes into $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
t0=$(date +%s)
# shellcheck source=/dev/null
source scripts/device_ros_env.sh || exit 1  # rclpy + kestrel_interfaces for Python 3.12: $KPY
export ROS_DOMAIN_ID=42 PYTHONUNBUFFERED=1
echo "setup $(( $(date +%s) - t0 )) s"; nproc; nvidia-smi --query-gpu=name,clocks.sm --format=csv
COMMIT="${1:-${KESTREL_COMMIT:-unknown}}"  # the device copy's git metadata is stale: pass it
timeout "${BENCH_TIMEOUT:-330}" $KPY scripts/bench_control.py --loops-first --step-iters 2000 \
  --backends cpu_eager,onnxruntime,cuda_eager,cuda_graph,cuda_graph_compiled,tensorrt \
  --loops "${LOOPS:-cuda_graph@1000:100000:process,cuda_graph@1000:15000:thread,cuda_graph_compiled@1000:15000:process,cuda_eager@1000:3000:thread,cpu_eager@1000:3000:process}" \
  --loop-cpus 2 --publisher-cpus 4,5 --node-cpus 6,7 --rt-priority 80 --label "H200" \
  --commit "$COMMIT" --out "$OUT/control_h200.json" \
  --note "one H200; loop thread (thread mode) / loop process's loop thread (process mode) on CPU 2, this process (ROS executor + publisher thread) on CPUs 6,7, publisher process on CPUs 4,5; SCHED_FIFO as reported in rt_settings; no mlockall" \
  2>&1 | tee "$OUT/bench_log.txt"
echo "bench done at $(( $(date +%s) - t0 )) s"
if $KPY -c "import pytest" 2>/dev/null; then
  timeout "${TEST_TIMEOUT:-90}" $KPY -m pytest -q -x -p no:cacheprovider \
    models/tests/test_control_runtimes.py ros2_ws/src/kestrel_control/test/test_graph_post_control.py \
    -k "cuda_graph or in_graph" 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
else
  echo "pytest not installed on the GPU machine: GPU tests not run" | tee "$OUT/gpu_tests.txt"
fi
echo "all done at $(( $(date +%s) - t0 )) s"
