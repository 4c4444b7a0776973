"""What every benchmark records beside its figures: the machine and the code it measured.

Used by scripts/bench_control.py, bench_perception.py and bench_planner.py (import with
`sys.path` including scripts/, as they do). No torch import at module level: the callers pass
what they know (device name), so this also works in processes without torch.

Commit: an explicit value (the script's --commit/--git-commit) wins, then $KESTREL_COMMIT, then
`git rev-parse --short HEAD` with `+dirty` when tracked files differ from HEAD. On the GPU
machine the repository copy's git metadata is not guaranteed to match the working tree it
received (seen: HEAD reported as an older commit), so device scripts pass KESTREL_COMMIT from
the dev machine.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git_commit(explicit: str = "") -> str:
    if explicit:
        return explicit
    env = os.environ.get("KESTREL_COMMIT", "")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not head:
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def machine_info(gpu_name: str | None = None, **extra: object) -> dict:
    """Platform, Python, CPU model and count, affinity, torch/CUDA (if importable), GPU name."""
    info: dict = {"host": platform.node(), "platform": platform.platform(),
                  "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        info["cpu_affinity"] = sorted(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = gpu_name or torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    if gpu_name and "gpu" not in info:
        info["gpu"] = gpu_name
    info.update(extra)
    return info


def summary(values: list[float]) -> dict:
    """n, p50, p99 and max of `values` (just {"n": 0} when there are none)."""
    import numpy as np

    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"n": 0}
    return {"n": int(a.size), "p50": float(np.percentile(a, 50)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def time_calls(fn, iters: int, warmup: int = 0):
    """Seconds per call of `fn()` (perf_counter_ns around each call), np.ndarray [iters],
    after `warmup` untimed calls."""
    import time

    import numpy as np

    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    clock = time.perf_counter_ns
    for i in range(iters):
        a = clock()
        fn()
        times[i] = (clock() - a) * 1e-9
    return times


def pct(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank on the sorted values (one of the samples, no
    interpolation); NaN when there are none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def write_result(stem: str | None, result: dict, markdown: str) -> None:
    """Print the table; with a path stem, write STEM.json (the result) and STEM.md (the table,
    as given)."""
    import json

    print(markdown, flush=True)
    if stem:
        Path(stem + ".json").write_text(json.dumps(result, indent=1))
        Path(stem + ".md").write_text(markdown)


def cuda_graph_us(fn, iters: int, warmup: int, eager_fallback: bool = False):
    """Device time of `fn()` replayed as a CUDA graph: one eager call (compiles, lazy init,
    outside the capture), one on a side stream, the capture, `warmup` untimed replays, then
    `iters` replays each between two CUDA events. Returns (us np.ndarray [iters], the
    captured call's output, captured: bool). eager_fallback: when the capture raises, time
    eager calls instead (captured False) rather than raise."""
    import numpy as np
    import torch

    out = fn()
    run, captured = fn, False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        run, captured = graph.replay, True
    except Exception:  # noqa: BLE001 (not capturable)
        if not eager_fallback:
            raise
        torch.cuda.synchronize()
    for _ in range(warmup):
        run()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for a, b in ev:
        a.record()
        run()
        b.record()
    torch.cuda.synchronize()
    return np.array([a.elapsed_time(b) * 1e3 for a, b in ev]), out, captured


def us_stats(us) -> dict:
    """p50 / p99 / p99.9 / mean of device times in us (keys p50_us, p99_us, p999_us, mean_us)."""
    import numpy as np

    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "p999_us": float(np.percentile(us, 99.9)), "mean_us": float(np.mean(us))}
