"""The deployment checklist's host checks: real-time scheduling, CPU affinity, memory locking,
the kernel's real-time throttle, the GPU (NVML: persistence mode, clocks) and the DDS setup.

Each check returns `Check`s; what the control node asks for (its loop.* parameters
rt_priority, cpu_affinity, lock_memory, spin_us, rate_hz) comes in as a plain dict with those
short keys, so the checks run without ROS.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
RT_RUNTIME = Path("/proc/sys/kernel/sched_rt_runtime_us")
MLOCK_NEEDED = 1 << 30  # bytes a locked control process needs (torch + policy), generous


@dataclass
class Check:
    name: str
    status: str         # PASS | WARN | FAIL | SKIP
    detail: str
    fix: str = ""


def fifo_probe(priority: int = 1, timeout_s: float = 10.0) -> tuple[bool, str]:
    """Can a process of this user take SCHED_FIFO at `priority`? Tried in a child process
    (this one keeps its policy)."""
    if not hasattr(os, "SCHED_FIFO"):
        return False, "no SCHED_FIFO on this platform"
    code = ("import os; os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param("
            f"{int(priority)}))")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"probe failed: {exc}"
    if proc.returncode == 0:
        return True, "granted"
    last = (proc.stderr.strip().splitlines() or ["refused"])[-1]
    return False, last


def check_realtime(control: dict, probe=fifo_probe) -> list[Check]:
    """SCHED_FIFO (rt_priority), RLIMIT_RTPRIO, the RT throttle, CPU affinity, mlock."""
    out: list[Check] = []
    prio = int(control.get("rt_priority") or 0)
    soft, _hard = resource.getrlimit(resource.RLIMIT_RTPRIO)
    granted, why = probe(max(prio, 1))
    if prio <= 0:
        out.append(Check("rt.sched_fifo", WARN if granted else PASS,
                         f"the control loop asks for no real-time priority (SCHED_FIFO "
                         f"{'possible' if granted else 'not possible'} here)",
                         "loop.rt_priority: 80 in control.yaml" if granted else ""))
    elif granted:
        out.append(Check("rt.sched_fifo", PASS, f"SCHED_FIFO {prio} granted "
                                                f"(RLIMIT_RTPRIO {soft})"))
    else:
        out.append(Check("rt.sched_fifo", FAIL, f"loop.rt_priority {prio} asked, SCHED_FIFO "
                         f"refused: {why} (RLIMIT_RTPRIO {soft}, uid {os.geteuid()})",
                         "run as root or with CAP_SYS_NICE, or raise the limit: "
                         "/etc/security/limits.conf '<user> - rtprio 99'; in a container "
                         "--cap-add SYS_NICE --ulimit rtprio=99"))
    out += _throttle(control, prio > 0 and granted)
    out += _affinity(control)
    out += _mlock(control, prio > 0)
    return out


def _throttle(control: dict, fifo: bool) -> list[Check]:
    try:
        runtime = int(RT_RUNTIME.read_text().strip())
    except (OSError, ValueError):
        return [Check("rt.throttle", SKIP, f"{RT_RUNTIME} not readable")]
    rate = float(control.get("rate_hz") or 1000.0)
    spin = float(control.get("spin_us") or 0.0)
    period_us = 1e6 / rate
    if runtime < 0:
        return [Check("rt.throttle", PASS, "real-time throttle off (sched_rt_runtime_us -1)")]
    if fifo and spin >= 0.9 * period_us:
        return [Check("rt.throttle", WARN, f"sched_rt_runtime_us {runtime}: a SCHED_FIFO loop "
                      f"that spins {spin:g} of every {period_us:g} us never sleeps and is "
                      "stopped by the throttle every second",
                      "loop.spin_us well below the period (200 on shared CPUs), or as root: "
                      "sysctl kernel.sched_rt_runtime_us=-1 with the loop on an isolated CPU")]
    return [Check("rt.throttle", PASS, f"sched_rt_runtime_us {runtime}; the loop sleeps "
                  f"(loop.spin_us {spin:g} of a {period_us:g} us period)")]


def _affinity(control: dict) -> list[Check]:
    want = [int(c) for c in control.get("cpu_affinity") or []]
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [Check("rt.cpu_affinity", SKIP, "no sched_getaffinity on this platform")]
    if not want:
        return [Check("rt.cpu_affinity", WARN, f"the loop may run on any of CPUs {allowed}",
                      "loop.cpu_affinity: [<a CPU of its own>] and keep other work off it "
                      "(python -m kestrel_control.core.cpu_shield --cpus <cpu> --irqs)")]
    bad = [c for c in want if c not in allowed]
    if bad:
        return [Check("rt.cpu_affinity", FAIL, f"loop.cpu_affinity {want}: CPUs {bad} are not "
                      f"available to this process (allowed {allowed})",
                      "pick CPUs of this machine's/cgroup's cpuset")]
    isolated = _isolated_cpus()
    note = "" if set(want) <= isolated else " (not isolated: other tasks may share them)"
    return [Check("rt.cpu_affinity", PASS, f"loop on CPUs {want}{note}")]


def _isolated_cpus() -> set[int]:
    try:
        text = Path("/sys/devices/system/cpu/isolated").read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


def _mlock(control: dict, realtime: bool) -> list[Check]:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    shown = "unlimited" if unlimited else f"{soft / 2**20:.0f} MiB"
    if not control.get("lock_memory"):
        return [Check("rt.mlock", WARN if realtime else PASS,
                      f"loop.lock_memory off (RLIMIT_MEMLOCK {shown})",
                      "loop.lock_memory: true (page faults stall a real-time loop)" if realtime
                      else "")]
    if unlimited or soft >= MLOCK_NEEDED:
        return [Check("rt.mlock", PASS, f"loop.lock_memory on, RLIMIT_MEMLOCK {shown}")]
    return [Check("rt.mlock", FAIL, f"loop.lock_memory on but RLIMIT_MEMLOCK is {shown}: mlockall "
                  "will fail", "ulimit -l unlimited (limits.conf 'memlock unlimited'; "
                  "docker --ulimit memlock=-1)")]


def check_gpu() -> list[Check]:
    """Persistence mode and clocks of every NVIDIA GPU through NVML; SKIP without one."""
    try:
        import pynvml
    except ImportError as exc:
        return [Check("gpu.nvml", SKIP, f"nvidia-ml-py not installed ({exc})")]
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError: no driver / no GPU
        return [Check("gpu.nvml", SKIP, f"NVML unavailable: {exc}")]
    out: list[Check] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            try:
                pm = pynvml.nvmlDeviceGetPersistenceMode(h)
                out.append(Check(f"gpu{i}.persistence", PASS if pm else WARN,
                                 f"{name}: persistence mode {'on' if pm else 'off'}",
                                 "" if pm else f"sudo nvidia-smi -i {i} -pm 1 (the driver "
                                 "stays loaded: no start-up latency, clocks kept)"))
            except Exception as exc:  # noqa: BLE001
                out.append(Check(f"gpu{i}.persistence", SKIP, f"{name}: {exc}"))
            try:
                sm = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
                app = pynvml.nvmlDeviceGetApplicationsClock(h, pynvml.NVML_CLOCK_SM)
                top = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)
                low = app < 0.9 * top
                out.append(Check(f"gpu{i}.clocks", WARN if low else PASS,
                                 f"{name}: SM clock {sm} MHz now, application clock {app} of "
                                 f"max {top} MHz",
                                 f"sudo nvidia-smi -i {i} -lgc {top} (lock the SM clock: "
                                 "steady latency)" if low else ""))
            except Exception as exc:  # noqa: BLE001
                out.append(Check(f"gpu{i}.clocks", SKIP, f"{name}: {exc}"))
    finally:
        pynvml.nvmlShutdown()
    return out or [Check("gpu.nvml", SKIP, "NVML sees no GPU")]


def check_dds(env: dict[str, str] | None = None) -> list[Check]:
    """RMW and the Fast DDS profile for camera-sized samples."""
    env = dict(os.environ) if env is None else env
    rmw = env.get("RMW_IMPLEMENTATION", "")
    out = [Check("dds.rmw", PASS if rmw else WARN,
                 f"RMW_IMPLEMENTATION={rmw}" if rmw else "RMW_IMPLEMENTATION unset (the "
                 "ROS default applies; every process must use the same)",
                 "" if rmw else "export RMW_IMPLEMENTATION=rmw_fastrtps_cpp (scripts/env.sh)")]
    if rmw and not rmw.startswith("rmw_fastrtps"):
        out.append(Check("dds.profile", SKIP, f"{rmw}: no Fast DDS profile to check"))
        return out
    profile = env.get("FASTDDS_DEFAULT_PROFILES_FILE", "")
    if not profile:
        out.append(Check("dds.profile", WARN, "FASTDDS_DEFAULT_PROFILES_FILE unset: default "
                         "512 KB shared-memory segment, camera images get lost between "
                         "processes", "export FASTDDS_DEFAULT_PROFILES_FILE=<kestrel_bringup "
                         "share>/config/fastdds_large_data.xml (scripts/env.sh does)"))
    elif not Path(profile).is_file():
        out.append(Check("dds.profile", FAIL, f"FASTDDS_DEFAULT_PROFILES_FILE={profile}: no "
                         "such file", "point it at kestrel_bringup/config/"
                         "fastdds_large_data.xml"))
    else:
        out.append(Check("dds.profile", PASS, f"Fast DDS profile {profile}"))
    return out
