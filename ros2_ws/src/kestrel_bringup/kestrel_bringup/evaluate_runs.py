"""One evaluation as N stacks at once (`kestrel_bringup.evaluate --workers N`), no rclpy.

Each worker is `python -m kestrel_bringup.evaluate` on its own share of the episode seeds
(round robin, so the first seed and its video stay with worker 0), with its own stack on its
own ROS_DOMAIN_ID (kestrel_common.domain_lease: stacks that share a domain would hear each
other's /sim/reset). Episodes depend only on their seed, so the merged table is the one a
single stack would give, in less wall time on a machine with the cores for N stacks (each
stack's sim, perception and control want about 2 cores to keep sim time near real time; the
report states the sim-time speed per stack).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from kestrel_bringup.evaluation import EpisodeTrace

# the evaluate options a worker is passed as given (the rest are the parent's own)
PASSED = ("timeout", "plan_timeout", "controller", "oracle_plan", "oracle_speed", "device")
TRACE_FIELDS = {f.name for f in dataclasses.fields(EpisodeTrace)}


def split_seeds(seeds: list[int], workers: int) -> list[list[int]]:
    """Round-robin shares of `seeds` for `workers` workers (empty shares dropped)."""
    shares = [seeds[i::workers] for i in range(workers)]
    return [s for s in shares if s]


def worker_argv(args: object, seeds: list[int], out: Path, video: str,
                log_dir: Path | None) -> list[str]:
    """The evaluate command line of one worker."""
    argv = [sys.executable, "-m", "kestrel_bringup.evaluate", "--workers", "1",
            "--seeds", ",".join(str(s) for s in seeds), "--out", str(out),
            "--video", video or "none"]
    for name in PASSED:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir)]
    return argv


def traces_from(summary: dict) -> list[EpisodeTrace]:
    """The episode traces of an evaluation's JSON summary (per_episode)."""
    return [EpisodeTrace(**{k: v for k, v in e.items() if k in TRACE_FIELDS})
            for e in summary.get("per_episode", [])]


def merged_speed(speeds: list[dict | None]) -> dict | None:
    """Sim-time speed over workers: total sim s over total wall s of the stacks, i.e. the mean
    speed of one stack (None when no worker measured one)."""
    got = [s for s in speeds if s]
    if not got:
        return None
    sim_s, wall_s = sum(s["sim_s"] for s in got), sum(s["wall_s"] for s in got)
    return {"sim_s": round(sim_s, 1), "wall_s": round(wall_s, 1),
            "real_time_factor": round(sim_s / wall_s, 3) if wall_s > 0 else 0.0,
            "stacks": len(got)}


def _pump(prefix: str, stream, sink) -> None:
    for line in stream:
        sink.write(f"{prefix}{line}")
        sink.flush()


def run_workers(args: object, seeds: list[int], video: str,
                log_dir: Path | None) -> tuple[list[EpisodeTrace], dict | None, list[str]]:
    """Run the workers to their end; returns (traces in seed order, merged sim speed, errors:
    one line per worker that failed or wrote no result)."""
    from kestrel_common.domain_lease import DomainLease

    shares = split_seeds(seeds, args.workers)
    leases = [DomainLease() for _ in shares]
    tmp = Path(tempfile.mkdtemp(prefix="kestrel_eval_"))
    procs, pumps = [], []
    try:
        for i, (share, lease) in enumerate(zip(shares, leases, strict=True)):
            env = dict(os.environ, ROS_DOMAIN_ID=str(lease.domain_id),
                       ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST", PYTHONUNBUFFERED="1")
            argv = worker_argv(args, share, tmp / f"worker{i}", video if i == 0 else "",
                               log_dir / f"worker{i}" if log_dir else None)
            print(f"[evaluate] worker {i}: ROS_DOMAIN_ID {lease.domain_id}, "
                  f"{len(share)} episodes", flush=True)
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    text=True, bufsize=1)
            pump = threading.Thread(target=_pump, args=(f"[w{i}] ", proc.stdout, sys.stdout),
                                    daemon=True)
            pump.start()
            procs.append(proc)
            pumps.append(pump)
        codes = [p.wait() for p in procs]  # each worker bounds its own episodes and stack
        for pump in pumps:
            pump.join(timeout=5.0)
        traces, speeds, errors = [], [], []
        for i, code in enumerate(codes):
            path = tmp / f"worker{i}.json"
            if not path.exists():
                errors.append(f"worker {i} exited {code} without a result")
                continue
            part = json.loads(path.read_text())
            traces += traces_from(part)
            speeds.append(part.get("sim_speed"))
            if code not in (0, 2):  # 2: ran, no success
                errors.append(f"worker {i} exited {code}")
        order = {s: n for n, s in enumerate(seeds)}
        traces.sort(key=lambda t: order.get(t.seed, len(order)))
        return traces, merged_speed(speeds), errors
    finally:
        for proc in procs:
            if proc.poll() is None:  # interrupted: the workers stop their stacks on SIGINT
                proc.send_signal(2)
        for proc in procs:
            try:
                proc.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                proc.kill()
        for lease in leases:
            lease.release()
