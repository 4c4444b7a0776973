#!/usr/bin/env bash
# The H200 perception runs in ONE device call (device time is scarce): the forward benchmark
# (scripts/bench_perception.py) and the node end to end with ROS I/O live
# (scripts/bench_perception_node.py). Run from the repo root on the GPU machine with
# carry [".whl"]; results go to $OUT (or ./bench_out). Usage:
#   bash scripts/bench_perception_h200.sh <git commit> [all|forward|node] [forward budget s] \
#        [node frames]
# ("node" alone: ~1 min of ROS env build + ~1 min of node compile/warm-up + the frames.)
# The ROS 2 venv (scripts/device_ros_env.sh, ~1 min of cmake on the CPU) is built in the
# background while the forward benchmark runs; the node run starts once both are done, so the
# inductor cache of the forward run (same graphs) serves the node's compile.
set -o pipefail
commit="${1:-unknown}"
mode="${2:-all}"
budget="${3:-215}"
frames="${4:-150}"
out="${OUT:-bench_out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
(source scripts/device_ros_env.sh > "$out/ros_env.log" 2>&1; echo "ros env rc $?" >> "$out/ros_env.log") &
envpid=$!
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
if [[ "$mode" != node ]]; then
timeout $((budget + 90)) python3 scripts/bench_perception.py --config r50 --iters 200 --warmup 20 \
  --profile --cams 1 6 --batches 8 4 2 --points 120000 \
  --variants eager_fp32 compile_bf16w_graph whole_bf16w_freeze_graph compile_bf16w_fold_graph \
             whole_bf16w_graph whole_fp16w_freeze_graph \
  --sweep-variants best --target-budget-s 120 --budget-s "$budget" \
  --git-commit "$commit" --out "$out/perception_h200" 2>&1 | grep -v USDT > "$out/bench.log"
echo "forward bench rc $?"
tail -32 "$out/bench.log"
fi
wait "$envpid"
[[ "$mode" == forward ]] && exit 0
tail -3 "$out/ros_env.log"
source scripts/device_ros_env.sh || exit 3
# GPU_TESTS=1: the perception GPU tests first (Triton NMS, pinned staging, region graphs)
if [[ -n "${GPU_TESTS:-}" ]]; then
  timeout 300 "$KPY" -m pytest -q -p no:cacheprovider -m gpu models/tests/test_nms_triton.py \
    models/tests/test_box_median_triton.py ros2_ws/src/kestrel_perception/test 2>&1 \
    | tail -15 | tee "$out/gpu_tests.txt"
fi
# PUBLISHERS="one per-sensor" runs the node once per input-publisher mode (default: one);
# RECEIVE="executor processes" once per node parameter `receive` as well (default: the node's);
# STRIDES="2 4" once per output_stride of the published maps too (default: the bench's)
# (a repeated setting gets the run's number appended to its file names, not overwritten; the
# ready timeout covers the first run on a fresh machine: compile + capture ~100-120 s)
k=0
for pubs in ${PUBLISHERS:-one}; do
for rx in ${RECEIVE:-default}; do
for st in ${STRIDES:-default}; do
  sfx=""; [[ "$pubs" != one ]] && sfx="_$pubs"
  rx_args=""; [[ "$rx" != default ]] && { rx_args="--receive $rx"; sfx="${sfx}_rx_$rx"; }
  [[ "$st" != default ]] && { rx_args="$rx_args --output-stride $st"; sfx="${sfx}_s$st"; }
  k=$((k + 1)); [[ -e "$out/perception_node_h200$sfx${OUT_SFX:-}.json" ]] && sfx="${sfx}_$k"
  timeout 240 "$KPY" scripts/bench_perception_node.py --config r50 --device cuda --cams 6 \
    --image-hw 640 640 --points 120000 --rate 10 --frames "$frames" --publishers "$pubs" \
    --variant "${VARIANT:-branch_bf16w_fold_s2d4_group_cudnn_stem_graph}" --ready-timeout 160 \
    --git-commit "$commit" $rx_args ${NODE_ARGS:-} \
    --out "$out/perception_node_h200$sfx${OUT_SFX:-}" > "$out/node$sfx${OUT_SFX:-}.log" 2>&1
  echo "node bench ($pubs, receive $rx, output_stride $st) rc $?"
  tail -25 "$out/node$sfx${OUT_SFX:-}.log"
done
done
done
