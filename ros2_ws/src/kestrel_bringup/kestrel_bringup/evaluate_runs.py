"""How an evaluation's episodes run: through one stack (`run_here`; the Evaluator of
kestrel_bringup.evaluate speaks ROS), or as N stacks at once (`run_workers`,
`kestrel_bringup.evaluate --workers N`: no rclpy in this process). Either way an interrupted run
(SIGINT; SIGTERM in evaluate.main) stops its stacks in order and keeps the episodes that ended.

Each worker is `python -m kestrel_bringup.evaluate` on its own share of the episode seeds
(round robin, so the first seed and its video stay with worker 0), with its own stack on its
own ROS_DOMAIN_ID (kestrel_common.domain_lease: stacks that share a domain would hear each
other's /sim/reset). Episodes depend only on their seed, so the merged table is the one a
single stack would give, in less wall time on a machine with the cores for N stacks (each
stack's sim, perception and control want about 2 cores to keep sim time near real time; the
report states the sim-time speed per stack).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from kestrel_bringup.evaluation import EpisodeTrace, gpu_params

# the evaluate options a worker is passed as given (the rest are the parent's own)
PASSED = ("timeout", "plan_timeout", "controller", "oracle_plan", "oracle_speed", "device",
          "task")
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
        try:
            codes = [p.wait() for p in procs]  # each worker bounds its episodes and stack
        except KeyboardInterrupt:  # each worker stops its stack and writes what ended
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            codes = [_wait(p, 60.0) for p in procs]
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
        for proc in procs:  # (only after an error here: the workers ended above)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for lease in leases:
            lease.release()
        shutil.rmtree(tmp, ignore_errors=True)  # the workers' own result files


def _wait(proc: subprocess.Popen, timeout_s: float) -> int | None:
    """Its exit code; killed after timeout_s (None)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def run_here(args: argparse.Namespace, seeds: list[int]) -> tuple[list[EpisodeTrace],
                                                                   dict | None, int]:
    """The episodes of `seeds` through one stack (started here unless --no-stack); returns the
    traces, the sim-time speed and 0 (1: the stack's services never came up)."""
    from kestrel_bringup.evaluate import Evaluator

    runner = None
    if not args.no_stack:
        from kestrel_bringup.run_stack import StackRunner
        extra = gpu_params(args.device, args.controller)
        extra.setdefault("control", {})["controller"] = args.controller
        if args.oracle_plan:
            extra.setdefault("planner", {})["backend"] = "plan_text"
        if args.task == "stack":  # two task objects or more on the table: one to stack on
            extra.setdefault("sim", {})["episode.min_objects"] = "2"
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        runner = StackRunner(extra_params=extra, echo=False, log_dir=args.log_dir)
        runner.start()
    ev = None
    speed = None
    traces: list[EpisodeTrace] = []
    try:
        ev = Evaluator(args.plan_timeout)
        if not ev.wait_ready(300.0):
            print("[evaluate] /sim/reset or /planner/plan_task not available",
                  file=sys.stderr)
            return traces, None, 1
        try:
            for i, seed in enumerate(seeds):
                # each episode's goal and wording from its own seed: any episode re-runs alone
                rng = random.Random(seed)
                ev.recording = bool(args.video) and not traces
                trace = ev.episode(seed, rng, args.timeout,
                                   args.oracle_speed if args.oracle_plan else 0.0,
                                   task=args.task)
                if ev.recording:
                    ev.recording = False
                    with ev.lock:
                        frames, ev.frames = ev.frames, []
                    if frames:
                        from kestrel_bringup.episode_media import write_video
                        print(f"[evaluate] video: {write_video(frames, args.video)} "
                              f"({len(frames)} frames)", flush=True)
                if trace is None:
                    print(f"[evaluate] episode {i + 1} (seed {seed}) could not start",
                          file=sys.stderr)
                    continue
                traces.append(trace)
                print(f"[evaluate] episode {i + 1}/{len(seeds)} seed {seed} '{trace.instruction}'"
                      f": {trace.stage}"
                      + (f" ({'; '.join(trace.plan_reasons)})" if trace.plan_reasons else ""),
                      flush=True)
                if trace.stage != "success":
                    print(f"[evaluate]   position error (m) {trace.position_error_m}; steps: "
                          f"{' | '.join(trace.steps) or 'none ended'}", flush=True)
        except KeyboardInterrupt:  # SIGINT, or SIGTERM (main): the ended episodes count
            print(f"[evaluate] interrupted after {len(traces)} of {len(seeds)} episodes",
                  file=sys.stderr, flush=True)
    finally:
        if ev is not None:
            speed = ev.sim_speed()
            ev.close()
        if runner is not None:
            runner.stop()
    return traces, speed, 0
