#!/usr/bin/env bash
# GPU machine (the `run` tool): issue 3's fused Triton step (cuda_graph_triton) vs cuda_graph.
#   bash scripts/device_bench_control_triton.sh check <commit>   (no ROS; ~1.5 min)
#     the GPU tests of the control backends (pytest where installed), the kernel profile of
#     both backends (+ max |diff| vs fp32 eager) and the spaced-steps test (gaps 0 and 950 us)
#   bash scripts/device_bench_control_triton.sh loops <commit>   (carry [".whl"]; ~4-5 min)
#     the shielded 1 kHz loop with ROS I/O live (device_bench_control_shield.sh, SKIP_PROFILE):
#     cuda_graph_triton for TRITON_CYCLES (100,000), then cuda_graph for GRAPH_CYCLES (30,000)
# Writes $OUT/{gpu_tests.txt,control_graph_profile_h200_triton.json,
# control_spaced_h200_triton.json,control_h200_triton.json,...}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
MODE="${1:-check}"; COMMIT="${2:-${KESTREL_COMMIT:-unknown}}"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
if [[ "$MODE" == check ]]; then
  PY="${PY:-python3}"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  "$PY" -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)"
  if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider models/tests/test_control_triton.py \
      models/tests/test_control_runtimes.py \
      ros2_ws/src/kestrel_control/test/test_graph_post_control.py \
      -k "triton or cuda_graph or in_graph" 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  else
    echo "pytest not installed on the GPU machine: GPU tests not run" | tee "$OUT/gpu_tests.txt"
  fi
  echo "tests done at $(( $(date +%s) - t0 )) s"
  timeout 120 "$PY" scripts/profile_control_graph.py --backends cuda_graph,cuda_graph_triton \
    --iters 3000 --commit "$COMMIT" --out "$OUT/control_graph_profile_h200_triton.json" 2>&1 \
    | tail -50 | tee "$OUT/profile.txt"
  echo "profile done at $(( $(date +%s) - t0 )) s"
  timeout 120 "$PY" scripts/profile_control_graph.py --backends cuda_graph,cuda_graph_triton \
    --gaps-us 0,950 --iters 3000 --commit "$COMMIT" \
    --out "$OUT/control_spaced_h200_triton.json" 2>&1 | tail -20 | tee "$OUT/spaced.txt"
  echo "spaced done at $(( $(date +%s) - t0 )) s"
else
  GRAPH_CYCLES="${GRAPH_CYCLES-30000}"  # '' = no cuda_graph loop
  T="cuda_graph_triton@1000:${TRITON_CYCLES:-100000}:process"
  G="cuda_graph@1000:${GRAPH_CYCLES}:process"
  SKIP_PROFILE=1 NAME=control_h200_triton BACKENDS=cuda_graph,cuda_graph_triton \
    LOOPS="$T${GRAPH_CYCLES:+,$G}" BENCH_TIMEOUT="${BENCH_TIMEOUT:-330}" \
    bash scripts/device_bench_control_shield.sh "$COMMIT"
  echo "loops done at $(( $(date +%s) - t0 )) s"
fi
