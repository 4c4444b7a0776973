#!/usr/bin/env bash
# GPU machine (the `run` tool): issue 3's resident-kernel step (cuda_persistent) vs
# cuda_graph_triton.
#   bash scripts/device_bench_control_persistent.sh check <commit>   (no ROS; ~2 min)
#     a smoke run at the reference sizes, the GPU tests of both backends, the spaced-steps test
#     (gaps 0 and 950 us: the loop's idle gap before each step; profile_control_graph.py), and
#     scripts/bench_control_persistent.py (step vs programs and batch; co-tenant matmul cost)
#   bash scripts/device_bench_control_persistent.sh loops <commit>   (carry [".whl"]; ~5 min)
#     the shielded 1 kHz loop with ROS I/O live (device_bench_control_shield.sh, SKIP_PROFILE):
#     cuda_persistent (PROGRAMS resident programs, default 64) for PERSISTENT_CYCLES (100,000),
#     then cuda_graph_triton for TRITON_CYCLES (30,000) in the same run
# Writes $OUT/{smoke.txt,gpu_tests.txt,control_persistent_spaced_h200.json,
# control_persistent_h200.json,control_h200_persistent.json,...}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
MODE="${1:-check}"; COMMIT="${2:-${KESTREL_COMMIT:-unknown}}"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
if [[ "$MODE" == check ]]; then
  PY="${PY:-python3}"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  timeout -s KILL 90 "$PY" - <<'PYEOF' 2>&1 | tail -30 | tee "$OUT/smoke.txt"
import sys, time
sys.path[:0] = ["models", "tests"]
import numpy as np, torch
from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import create_backend, policy_from_actor_critic
from policy_reference import eager_rollout
model = build_policy(PolicyConfig(), seed=1)
t = time.perf_counter()
b = create_backend("cuda_persistent", policy_from_actor_critic(model), batch=1, warmup_steps=0)
print(f"built + launched in {time.perf_counter() - t:.1f} s", flush=True)
gen = torch.Generator().manual_seed(2)
xs = [torch.randn(1, 256, generator=gen) for _ in range(200)]
want, _ = eager_rollout(model, xs)
worst = 0.0
for x, w in zip(xs, want):
    b.obs_host.copy_(x); b.step(); worst = max(worst, (b.act_host - w).abs().max().item())
print(f"max |diff| vs fp32 eager over 200 steps: {worst:.2e}", flush=True)
ts = np.empty(5000)
for i in range(5000):
    a = time.perf_counter_ns(); b.step(); ts[i] = (time.perf_counter_ns() - a) / 1e3
print("back-to-back step us p50 %.1f p99 %.1f p99.9 %.1f max %.1f" % tuple(
    np.percentile(ts, [50, 99, 99.9, 100])), flush=True)
b.close(); print("closed; relaunches", b.relaunches, flush=True)
PYEOF
  echo "smoke done at $(( $(date +%s) - t0 )) s"
  if "$PY" -c "import pytest" 2>/dev/null; then
    timeout -s KILL 200 "$PY" -m pytest -q -p no:cacheprovider models/tests/test_control_triton.py \
      models/tests/test_control_runtimes.py \
      ros2_ws/src/kestrel_control/test/test_graph_post_control.py \
      -k "triton or persistent or in_graph" 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
  else
    echo "pytest not installed on the GPU machine: GPU tests not run" | tee "$OUT/gpu_tests.txt"
  fi
  echo "tests done at $(( $(date +%s) - t0 )) s"
  timeout -s KILL 150 "$PY" scripts/profile_control_graph.py \
    --backends cuda_graph_triton,cuda_persistent --gaps-us 0,950 --iters 5000 \
    --commit "$COMMIT" --out "$OUT/control_persistent_spaced_h200.json" 2>&1 | tail -20 \
    | tee "$OUT/spaced.txt"
  echo "spaced done at $(( $(date +%s) - t0 )) s"
  timeout -s KILL 240 "$PY" scripts/bench_control_persistent.py --iters "${ITERS:-3000}" \
    --commit "$COMMIT" --out "$OUT/control_persistent_h200.json" 2>&1 | tail -30 \
    | tee "$OUT/persistent.txt"
  echo "programs sweep + co-tenant done at $(( $(date +%s) - t0 )) s"
else
  TRITON_CYCLES="${TRITON_CYCLES-30000}"  # '' = no cuda_graph_triton loop
  P="cuda_persistent@1000:${PERSISTENT_CYCLES:-100000}:process"
  T="cuda_graph_triton@1000:${TRITON_CYCLES}:process"
  SKIP_PROFILE=1 NAME="${NAME:-control_h200_persistent}" \
    BACKENDS=cuda_graph_triton,cuda_persistent LOOPS="$P${TRITON_CYCLES:+,$T}" \
    BENCH_TIMEOUT="${BENCH_TIMEOUT:-330}" EXTRA_ARGS="--gpu-programs ${PROGRAMS:-64}" \
    bash scripts/device_bench_control_shield.sh "$COMMIT"
  echo "loops done at $(( $(date +%s) - t0 )) s"
fi
