#!/usr/bin/env bash
# GPU machine (the `run` tool, carry [".whl"]): issue 3's loop with the loop CPU shielded.
#   bash scripts/device_bench_control_shield.sh <commit>
# 1. probes: cgroup CPU quota and throttling, isolated / nohz_full CPUs, busiest tasks;
# 2. the CUDA-graph step's kernels (scripts/profile_control_graph.py);
# 3. picks the CPU that served the fewest interrupts over 2 s as the loop CPU, moves every other
#    task off it (kestrel_control.core.cpu_shield: the user-space `cset shield`), and runs the
#    process-mode cuda_graph loop with ROS I/O live for CYCLES (default 100,000) cycles at
#    spin_us 950 (SHIELD_IRQS='' to leave interrupts alone); interrupts, steal time landing on the loop CPU during the run and cgroup throttling are
#    recorded beside the bench JSON.
# Options (env): LOOPS (bench_control --loops; default the cuda_graph entry above), BACKENDS
# (phase-1 step backends, default cuda_graph), NAME (result file stem, default
# control_h200_shield), SKIP_PROFILE=1, CYCLES.
# SPIN_US (default 950): with SCHED_FIFO keep it low enough that the loop sleeps each period
# (e.g. 700): a FIFO thread that spins the whole period meets the kernel's real-time throttle
# (sched_rt_runtime_us 950000: 50 ms in every second taken away).
# ROOT_CGROUP=1 first moves this shell (so the bench and its loop process) into the cgroup v2
# root: the VM runs commands in /process_api/<id>, whose real-time group runtime is 0, so
# SCHED_FIFO fails there with EPERM although CAP_SYS_NICE is held; the root grants it.
# Writes $OUT/{probe.txt,control_graph_profile_h200.json,shield.json,$NAME.json,...}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
COMMIT="${1:-${KESTREL_COMMIT:-unknown}}"
# shellcheck source=/dev/null
source scripts/device_ros_env.sh || exit 1
export ROS_DOMAIN_ID=43 PYTHONUNBUFFERED=1
CGROUP_NOTE="cgroup $(cut -d: -f3 /proc/self/cgroup | tr '\n' ' ')"
if [[ -n "${ROOT_CGROUP:-}" ]]; then
  SPIN_US="${SPIN_US:-700}"  # SCHED_FIFO granted there: leave sleep for the RT throttle
  if echo $$ > /sys/fs/cgroup/cgroup.procs; then CGROUP_NOTE="moved to the cgroup root"
  else CGROUP_NOTE="$CGROUP_NOTE (ROOT_CGROUP: move refused)"; fi
fi
{
  echo "## cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>&1)"
  echo "## cgroup cpuset: $(cat /sys/fs/cgroup/cpuset.cpus.effective 2>&1)"
  echo "## cpu.stat before:"; cat /sys/fs/cgroup/cpu.stat 2>&1
  echo "## isolated: $(cat /sys/devices/system/cpu/isolated 2>&1)" \
       "nohz_full: $(cat /sys/devices/system/cpu/nohz_full 2>&1)"
  echo "## kernel $(uname -r): $(cat /proc/cmdline 2>&1)"
  echo "## capabilities: $(grep -E '^Cap(Eff|Bnd)' /proc/self/status | tr '\n' ' ')" \
       "rtprio limit: $(ulimit -r) nice limit: $(ulimit -e)" \
       "sched_rt_runtime_us: $(cat /proc/sys/kernel/sched_rt_runtime_us 2>&1)" \
       "cgroup cpu.rt_runtime_us: $(cat /sys/fs/cgroup/cpu.rt_runtime_us 2>&1)"
  echo "## $CGROUP_NOTE; SCHED_FIFO test: $(chrt -f 10 true 2>&1 && echo ok)"
  echo "## busiest tasks:"; ps -eLo pid,tid,psr,pcpu,comm --sort=-pcpu | head -15
} > "$OUT/probe.txt" 2>&1
[[ -n "${SKIP_PROFILE:-}" ]] || timeout 150 "$KPY" scripts/profile_control_graph.py --commit "$COMMIT" \
  --out "$OUT/control_graph_profile_h200.json" 2>&1 | tail -60 | tee "$OUT/profile.txt"
read -r LOOP PUB NODE < <("$KPY" - <<'PY'
import os, time
from kestrel_control.core.cpu_shield import irq_counts
cpus = sorted(os.sched_getaffinity(0))
a = irq_counts(); time.sleep(2.0); b = irq_counts()
cand = [c for c in cpus if c != 0] or cpus
loop = min(cand, key=lambda c: b.get(c, 0) - a.get(c, 0))
rest = [c for c in cpus if c not in (0, loop)]
print(loop, ",".join(map(str, rest[:2])), ",".join(map(str, rest[2:4])))
PY
)
echo "loop cpu $LOOP, publisher cpus $PUB, node cpus $NODE" | tee -a "$OUT/probe.txt"
"$KPY" -m kestrel_control.core.cpu_shield --cpus "$LOOP" ${SHIELD_IRQS---irqs} | tee "$OUT/shield.json"
STEAL0=$(awk -v c="cpu$LOOP" '$1==c{print $9}' /proc/stat)
IRQ0=$("$KPY" -c "from kestrel_control.core.cpu_shield import irq_counts;print(irq_counts().get($LOOP,0))")
NAME="${NAME:-control_h200_shield}"
timeout "${BENCH_TIMEOUT:-300}" "$KPY" scripts/bench_control.py --loops-first \
  --backends "${BACKENDS:-cuda_graph}" --step-iters 2000 \
  --loops "${LOOPS:-cuda_graph@1000:${CYCLES:-100000}:process}" --spin-us "${SPIN_US:-950}" ${EXTRA_ARGS:-} \
  --loop-cpus "$LOOP" --publisher-cpus "$PUB" --node-cpus "$NODE" --rt-priority 80 \
  --label "H200 shielded loop cpu" --commit "$COMMIT" --out "$OUT/$NAME.json" \
  --note "process mode; $CGROUP_NOTE; loop on CPU $LOOP (fewest interrupts, every other task moved off it: $(tr -d '\n' < "$OUT/shield.json")), node on $NODE, publisher on $PUB; --spin-us ${SPIN_US:-950}" \
  2>&1 | tail -30 | tee "$OUT/bench_shield.txt"
IRQ1=$("$KPY" -c "from kestrel_control.core.cpu_shield import irq_counts;print(irq_counts().get($LOOP,0))")
STEAL1=$(awk -v c="cpu$LOOP" '$1==c{print $9}' /proc/stat)
{ echo "## interrupts on loop cpu $LOOP during the bench: $((IRQ1 - IRQ0))"
  echo "## steal time of loop cpu $LOOP during the bench (hypervisor, 10 ms ticks): $((STEAL1 - STEAL0))"
  echo "## /proc/interrupts rows that hit cpu $LOOP:"; "$KPY" - "$LOOP" <<'PY'
import sys
c = int(sys.argv[1])
with open("/proc/interrupts") as f:
    hdr = f.readline().split()
    col = hdr.index(f"CPU{c}")
    for line in f:
        p = line.split()
        if len(p) > col + 1 and p[col + 1].isdigit() and int(p[col + 1]) > 0:
            print(" ", p[0], p[col + 1], " ".join(p[len(hdr) + 1:])[:60])
PY
  echo "## cpu.stat after:"; cat /sys/fs/cgroup/cpu.stat 2>&1
  echo "## tasks on loop cpu $LOOP after:"; ps -eLo pid,tid,psr,pcpu,comm | awk -v c="$LOOP" '$3==c'
} >> "$OUT/probe.txt" 2>&1
cat "$OUT/probe.txt"
