#!/usr/bin/env python3
"""Benchmark of the control node's policy step and its 1 kHz loop (a script, not a test).

Phase 1, step latency: for every backend that can run here, a PolicyRunner with the reference
policy (obs 256 -> 512 -> 256, LSTM 256, 12 actions; 6 joints) does `--step-iters` ticks on fresh
observations; percentiles of the full tick (`runner.step`: buffer read, safety, inference,
command) and of the backend step alone.
Phase 2, the loop: for each `--loops` entry backend@rate_hz:cycles, the real-time loop
(kestrel_control.core.RealtimeLoop, absolute deadlines) runs the same tick with ROS I/O live:
a separate process publishes sensor_msgs/JointState at `--pub-rate` Hz, this process's
subscription writes them into the runner's double buffer (executor thread), and every tick
publishes the command (sensor_msgs/JointState) directly from the loop thread, as the node does.
Reported: wake error, period jitter, step latency percentiles, deadline misses, stale inputs.
Loop mode per entry (`backend@rate_hz:cycles[:thread|process|process_py]`, default
`--loop-mode`):
thread = the loop on a thread of this process, publishing directly (the node's thread mode);
process = the node's process mode (kestrel_control.core.loop_process): the loop in a child
interpreter over shared memory, this process's subscription writing the shared buffer and a
publisher thread, woken by the loop's eventfd, publishing the commands; there the delivery
latency (tick start -> publish call) is reported too. process runs the loop process's C tick
(`native_tick`, the node's default); process_py the same with the Python tick (A/B in one run).
A backend name with the suffix `+ts` (e.g. `cuda_graph+ts`, in --backends or --loops) runs the
reference architecture with one action per joint (6) exported to TorchScript and loaded as a
user's policy file (model_path, states as explicit I/O): the path an Isaac Lab export takes.
Phase 1 also times a window-form reference (ActorCritic.forward over 8 observations: 8 LSTM
steps) captured in a CUDA graph, beside the stateful backends (one LSTM cell step per tick).
The loop here is the node's core + I/O path with standard messages only (kestrel_interfaces is
not needed, so it runs on machines where only rclpy wheels exist).

  python scripts/bench_control.py --out docs/benchmarks/control_cpu.json \
      --loops cpu_eager@1000:20000,onnxruntime@1000:20000,cpu_eager@500:10000
  python scripts/bench_control.py --loop-mode process --loops cuda_graph@1000:100000 \
      --loops cuda_graph@1000:30000:thread,cuda_graph@1000:100000:process
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("models", "ros2_ws/src/kestrel_control"):
    sys.path.insert(0, str(ROOT / sub))
    # the loop process (process mode) imports the same packages
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / sub)] + [p for p in [os.environ.get("PYTHONPATH", "")] if p])

import bench_common  # noqa: E402 (scripts/ is on sys.path: this file's folder)
from bench_control_report import markdown, tail_pattern  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kestrel_control.core.loop_process import LoopProcess, LoopSettings  # noqa: E402
from kestrel_control.core.miss_cause import CAUSES as MISS_CAUSES  # noqa: E402
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig  # noqa: E402
from kestrel_control.core.rt_loop import RealtimeLoop  # noqa: E402
from kestrel_control.core.stats import LoopStats  # noqa: E402
from kestrel_models.control.external import ModelSpec  # noqa: E402
from kestrel_models.control.policy import PolicyConfig  # noqa: E402
from kestrel_models.control.runtimes import BACKENDS  # noqa: E402

N_JOINTS = 6
LOWER, UPPER = [-3.1] * N_JOINTS, [3.1] * N_JOINTS
NAMES = [f"joint_{i}" for i in range(N_JOINTS)]
TOPIC_IN, TOPIC_OUT = "/kestrel_bench/joint_states", "/kestrel_bench/joint_command"


def pct(samples: np.ndarray, scale: float = 1e6) -> dict[str, float]:
    """p50/p99/p99.9/max of `samples` (s) in us."""
    if samples.size == 0:
        return {}
    q = np.percentile(samples, [50, 99, 99.9])
    return {"p50": q[0] * scale, "p99": q[1] * scale, "p999": q[2] * scale,
            "max": float(samples.max()) * scale, "n": int(samples.size)}


GPU_PROGRAMS = [64]  # cuda_persistent's resident programs (--gpu-programs)


USER_FILE = "+ts"  # backend suffix: the policy as a user's TorchScript file


def user_torchscript(cache: str) -> ModelSpec:
    """The reference architecture with 6 actions (one per joint: a model file must match the
    joints), its step scripted with h/c as explicit inputs/outputs, as a user's policy.pt."""
    from kestrel_models.control.policy import build_policy
    from kestrel_models.control.runtimes import StepModule

    cfg = PolicyConfig(num_actions=N_JOINTS)
    path = Path(cache) / "user_policy_step.pt"
    if not path.exists():
        step = StepModule(build_policy(cfg, seed=0), fused=True).eval()
        torch.jit.script(step).save(str(path))
    shape = (1, cfg.lstm_hidden)
    return ModelSpec(path=str(path), format="torchscript", state_in_names=("h_in", "c_in"),
                     state_out_names=("h_out", "c_out"), state_shapes=(shape, shape),
                     obs_dim=cfg.obs_dim)


def make_config(backend: str, cache: str, warmup: int = 50) -> RunnerConfig:
    model = None
    if backend.endswith(USER_FILE):
        backend, model = backend[:-len(USER_FILE)], user_torchscript(cache)
    return RunnerConfig(
        joint_lower=LOWER, joint_upper=UPPER, policy=PolicyConfig(), backend=backend,
        max_obs_age_s=0.02, warmup_steps=warmup, cache_dir=cache, latency_compensation=True,
        gpu_programs=GPU_PROGRAMS[0], model=model)


def make_runner(backend: str, cache: str, warmup: int = 50) -> PolicyRunner:
    return PolicyRunner(make_config(backend, cache, warmup))


def bench_window_graph(iters: int) -> dict:
    """Reference: the window form (8 LSTM steps over a history) in one CUDA graph, batch 1."""
    if not torch.cuda.is_available():
        return {"skipped": "CUDA is not available"}
    from kestrel_models.control.policy import build_policy
    cfg = PolicyConfig()
    model = build_policy(cfg).cuda()
    hist_host = torch.zeros(1, cfg.history, cfg.obs_dim, pin_memory=True)
    act_host = torch.zeros(1, cfg.num_actions, pin_memory=True)
    hist = hist_host.cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(hist)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hist.copy_(hist_host, non_blocking=True)
            act_host.copy_(model(hist)[0], non_blocking=True)
    stream = torch.cuda.current_stream()
    times = np.empty(iters)
    clock = time.perf_counter_ns
    for i in range(iters + 100):
        a = clock()
        graph.replay()
        while not stream.query():
            pass
        if i >= 100:
            times[i - 100] = (clock() - a) * 1e-9
    return {"backend_step_us": pct(times), "history": cfg.history}


def bench_eventfd(iters: int = 20000) -> dict:
    """Cost of the loop's notification (os.eventfd_write), us."""
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    times = np.empty(iters)
    clock = time.perf_counter_ns
    try:
        for i in range(iters):
            a = clock()
            os.eventfd_write(efd, 1)
            times[i] = (clock() - a) * 1e-9
            if i % 1000 == 999:
                os.eventfd_read(efd)
    finally:
        os.close(efd)
    return pct(times)


# ---- phase 1 -----------------------------------------------------------------------------------
def bench_steps(backends: list[str], iters: int, cache: str) -> dict:
    results = {}
    for name in backends:
        t0 = time.perf_counter()
        try:
            runner = make_runner(name, cache)
        except ValueError as exc:  # BackendUnavailable included
            results[name] = {"skipped": str(exc)}
            print(f"  {name:20s} skipped: {exc}", flush=True)
            continue
        build_s = time.perf_counter() - t0
        js = np.zeros((2, N_JOINTS))
        tick = np.empty(iters)
        clock = time.perf_counter_ns
        gc.collect()
        gc.disable()
        try:
            for i in range(iters):
                js[0, 0] = 1e-4 * i
                now = time.time_ns()
                runner.joint_states.write(js, now)
                a = clock()
                runner.step(now + 1000)
                tick[i] = (clock() - a) * 1e-9
            infer = bench_common.time_calls(runner.backend.step, iters)
        finally:
            gc.enable()
        results[name] = {"build_s": build_s, "tick_us": pct(tick), "backend_step_us": pct(infer),
                         "status": runner.info.status.name}
        r = results[name]
        print(f"  {name:20s} tick p50 {r['tick_us']['p50']:8.1f} p99.9 "
              f"{r['tick_us']['p999']:8.1f} max {r['tick_us']['max']:9.1f} us | backend p50 "
              f"{r['backend_step_us']['p50']:8.1f} us | build {build_s:.1f} s", flush=True)
        runner.close()  # cuda_persistent: end its resident kernel before the next backend
        del runner
    return results


# ---- phase 2 -----------------------------------------------------------------------------------
def publisher_main(rate: float, cpus: str) -> None:
    """Separate process: JointState at `rate` Hz on absolute deadlines until stdin closes, and
    the robot side of the commands: a RELIABLE subscriber (as a driver would be) that counts
    them, so the loop's publish() pays for a matched reader. Prints `commands_received N`."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import JointState

    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    rclpy.init()
    node = rclpy.create_node("kestrel_bench_publisher")
    qos = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                     reliability=ReliabilityPolicy.BEST_EFFORT)
    pub = node.create_publisher(JointState, TOPIC_IN, qos)
    received = [0]
    node.create_subscription(  # the command QoS of RosIo: RELIABLE, depth 10
        JointState, TOPIC_OUT, lambda _m: received.__setitem__(0, received[0] + 1),
        QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                   reliability=ReliabilityPolicy.RELIABLE))
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    threading.Thread(target=executor.spin, daemon=True).start()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    msg = JointState(name=NAMES, position=[0.1] * N_JOINTS, velocity=[0.0] * N_JOINTS)
    period = int(1e9 / rate)
    t0 = time.monotonic_ns()
    k = 0
    while not stop.is_set():
        k += 1
        delay = t0 + k * period - time.monotonic_ns()
        if delay > 0:
            time.sleep(delay * 1e-9)
        now = time.time_ns()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        msg.position[0] = 0.1 + 0.1 * np.sin(k * 1e-3)
        pub.publish(msg)
    print(f"commands_received {received[0]}", flush=True)
    executor.shutdown(timeout_sec=2.0)
    node.destroy_node()
    rclpy.try_shutdown()


def stop_publisher(pub: subprocess.Popen, out_file) -> int | None:
    """Close the publisher process's stdin, wait for it; the commands its subscriber got
    (from its stdout, a temporary file: a pipe could fill up and block it)."""
    if pub.stdin is not None and not pub.stdin.closed:
        pub.stdin.close()
    try:
        pub.wait(10)
    except subprocess.TimeoutExpired:
        pub.kill()
        pub.wait(5)
        return None
    out_file.seek(0)
    for line in out_file.read().decode(errors="replace").splitlines():
        if line.startswith("commands_received "):
            return int(line.split()[1])
    return None


class RosIo:
    """In-process node: subscription -> runner buffer; command publisher for the loop."""

    def __init__(self, runner: PolicyRunner | None, js_buffer=None) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import JointState

        rclpy.init()
        self.rclpy = rclpy
        self.node = rclpy.create_node("kestrel_bench_control")
        sensor = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                            reliability=ReliabilityPolicy.BEST_EFFORT)
        command = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                             reliability=ReliabilityPolicy.RELIABLE)
        self.runner = runner
        self.js_buffer = js_buffer if js_buffer is not None else runner.joint_states
        self.received = 0
        self.delivery = np.zeros(400_000)  # process mode: s from tick start to publish call
        self.n_delivery = 0
        self.node.create_subscription(JointState, TOPIC_IN, self._on_js, sensor)
        self.pub = self.node.create_publisher(JointState, TOPIC_OUT, command)
        import array
        self.msg = JointState(name=NAMES)
        self.msg.position = array.array("d", [0.0] * N_JOINTS)
        self.view = np.frombuffer(self.msg.position, dtype=np.float64)
        self.published = 0
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_js(self, msg) -> None:
        self.received += 1
        stamp = msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
        pos = np.frombuffer(msg.position, dtype=np.float64)

        def fill(slot: np.ndarray) -> None:
            slot[0] = pos
            slot[1] = 0.0

        self.js_buffer.write_with(fill, stamp)

    def publish_from_thread(self, r: int, command: np.ndarray, stamp_ns: int) -> None:
        """Process mode: the LoopProcess publisher thread hands over the newest command."""
        np.copyto(self.view, command)
        stamp = self.msg.header.stamp
        stamp.sec, stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
        self.pub.publish(self.msg)
        self.published += 1
        if self.n_delivery < self.delivery.shape[0]:
            self.delivery[self.n_delivery] = (time.time_ns() - stamp_ns) * 1e-9
            self.n_delivery += 1

    def tick(self, deadline_ns: int) -> None:
        now = time.time_ns()
        command, info = self.runner.step(now)
        if info.valid:
            np.copyto(self.view, command)
            stamp = self.msg.header.stamp
            stamp.sec, stamp.nanosec = divmod(now, 1_000_000_000)
            self.pub.publish(self.msg)
            self.published += 1

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        self.rclpy.try_shutdown()


def bench_loop(backend: str, rate: float, cycles: int, mode: str, args, cache: str) -> dict:
    """The loop with ROS I/O live, in `mode` 'thread' or 'process' (see the module docstring)."""
    proc = runner = None
    try:
        if mode in ("process", "process_py"):
            cpus = tuple(int(c) for c in args.loop_cpus.split(",")) if args.loop_cpus else ()
            proc = LoopProcess(make_config(backend, cache), LoopSettings(
                period_s=1.0 / rate, spin_s=args.spin_us * 1e-6, rt_priority=args.rt_priority,
                cpu_affinity=cpus, lock_memory=args.lock_memory, manage_gc=True,
                switch_interval_s=args.gil_switch_us * 1e-6,
                native_tick=mode == "process",
                miss_attribution=not args.no_miss_attribution), start_timeout_s=300.0,
                stats_capacity=cycles + 1000)
            info = proc.start()
        else:
            runner = make_runner(backend, cache)
    except ValueError as exc:
        if proc is not None:
            proc.close()
        return {"skipped": str(exc)}
    pub_out = tempfile.TemporaryFile()
    pub = subprocess.Popen([sys.executable, __file__, "--publisher", str(args.pub_rate),
                            "--publisher-cpus", args.publisher_cpus], stdin=subprocess.PIPE,
                           stdout=pub_out)
    io = RosIo(runner, proc.joint_states[0] if proc is not None else None)
    try:
        deadline = time.monotonic() + 30.0
        while io.received < 10 and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for the publisher's discovery
        if io.received < 10:
            return {"skipped": "no joint states from the publisher process within 30 s"}
        received0 = io.received
        if proc is not None:
            stats = proc.stats
            applied = proc.activate(io.publish_from_thread, timeout_s=60.0)
            loop = None
        else:
            stats = LoopStats(1.0 / rate, capacity=cycles + 1000)
            cpus = [int(c) for c in args.loop_cpus.split(",")] if args.loop_cpus else None
            loop = RealtimeLoop(1.0 / rate, io.tick, stats, spin_s=args.spin_us * 1e-6,
                                rt_priority=args.rt_priority, cpu_affinity=cpus,
                                lock_memory=args.lock_memory, manage_gc=True,
                                switch_interval_s=args.gil_switch_us * 1e-6,
                                miss_attribution=not args.no_miss_attribution,
                                name=f"bench-{backend}")
            applied = loop.start(timeout_s=30.0)  # mlockall of a CUDA process can take s
        t_start = time.monotonic()
        limit = t_start + cycles / rate * 3 + 30
        while stats.cycles + stats.deadline_misses < cycles and time.monotonic() < limit:
            time.sleep(0.2)  # progress poll of a bounded wait
        if proc is not None:
            proc.deactivate()
        else:
            loop.stop(2.0)
        wall = time.monotonic() - t_start
        commands_received = stop_publisher(pub, pub_out)  # after the loop stopped publishing
        period = stats.period.since(0)
        wake = stats.wake_error.since(0)
        lat = stats.step_latency.since(0)
        out = {
            "backend": backend, "rate_hz": rate, "loop_mode": mode, "cycles": stats.cycles,
            "wall_s": wall, "deadline_misses": stats.deadline_misses,
            "stale_inputs": stats.stale_inputs, "step_errors": stats.step_errors,
            "miss_causes": {name: int(getattr(stats, name)) for name in MISS_CAUSES},
            "last_error": loop.last_error if loop is not None else "",
            "commands_published": io.published,
            "commands_received_by_subscriber": commands_received,
            "joint_states_received": io.received - received0,
            "wake_error_us": pct(wake), "step_latency_us": pct(lat),
            "period_jitter_us": pct(np.abs(period - 1.0 / rate)),
            "compute_latency_ema_us": (proc or runner).compute_latency_s * 1e6,
            "rt_settings": applied, "gil_switch_interval_us": args.gil_switch_us,
            "tail": tail_pattern(lat, wake, rate),
        }
        if args.out:  # per-cycle trace for offline analysis of the tail (float32 us)
            np.savez_compressed(Path(args.out).with_suffix("").as_posix()
                                + f"_trace_{backend.replace('+', '_')}_{mode}.npz",
                                wake_us=(wake * 1e6).astype(np.float32),
                                step_us=(lat * 1e6).astype(np.float32))
        if proc is not None:
            out["child_pid"] = info["pid"]
            out["native_tick"] = info.get("native_tick", "")
            out["commands_coalesced"] = proc.coalesced
            out["delivery_us"] = pct(io.delivery[:io.n_delivery])  # tick start -> publish()
        else:
            out["cuda_graph_sync"] = getattr(runner.backend, "sync", None)
        print(f"  {backend}@{rate:g}Hz [{mode}]: {stats.cycles} cycles, misses "
              f"{stats.deadline_misses} {out['miss_causes']}, stale {stats.stale_inputs}, step p50 "
              f"{out['step_latency_us']['p50']:.1f} p99.9 {out['step_latency_us']['p999']:.1f} "
              f"max {out['step_latency_us']['max']:.1f} us, wake p99.9 "
              f"{out['wake_error_us']['p999']:.1f} us, commands published / received by the "
              f"subscriber {io.published} / {commands_received}", flush=True)
        return out
    finally:
        io.close()
        if proc is not None:
            proc.close()
        if runner is not None:
            runner.close()
        if pub.poll() is None:
            stop_publisher(pub, pub_out)
        pub_out.close()


# ---- report ------------------------------------------------------------------------------------
def machine_info() -> dict:
    info = bench_common.machine_info()
    try:
        import onnxruntime
        info["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return info


def _has_triton() -> bool:
    import importlib.util
    return importlib.util.find_spec("triton") is not None


def default_loops(cuda: bool, triton: bool) -> str:
    """Phase 2's loops when --loops is not given (issue 3's benchmark): on a GPU, the graph
    path for 100,000 cycles at 1 kHz (the fused Triton step where triton is installed), then
    eager GPU and CPU for 10,000 cycles each in the same run, all in the loop process; on a
    CPU machine, the CPU policy for 10,000 cycles."""
    if not cuda:
        return "cpu_eager@1000:10000"
    graph = "cuda_graph_triton" if triton else "cuda_graph"
    return (f"{graph}@1000:100000:process,cuda_eager@1000:10000:process,"
            "cpu_eager@1000:10000:process")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--publisher", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--publisher-cpus", default="", help="CPUs of the publisher process")
    ap.add_argument("--backends", default="all", help="comma list or 'all'")
    ap.add_argument("--step-iters", type=int, default=5000)
    ap.add_argument("--loops", default=None,
                    help="comma list of backend@rate_hz:cycles[:thread|process|process_py] "
                         "('' = none; default: default_loops(), 100,000 cycles of the graph "
                         "path + eager GPU and CPU on a GPU machine)")
    ap.add_argument("--loop-mode", choices=("thread", "process"), default="thread",
                    help="loop mode of --loops entries without their own ':mode'")
    ap.add_argument("--node-cpus", default="",
                    help="CPUs of this process (its ROS executor and publisher threads; the "
                         "loop thread / process then moves to --loop-cpus)")
    ap.add_argument("--pub-rate", type=float, default=1000.0)
    ap.add_argument("--spin-us", type=float, default=200.0)
    ap.add_argument("--no-miss-attribution", action="store_true",
                    help="the loop without its per-cycle schedstat/getrusage reads (A/B of their "
                    "cost)")
    ap.add_argument("--rt-priority", type=int, default=0)
    ap.add_argument("--gil-switch-us", type=float, default=50.0,
                    help="sys.setswitchinterval while the loop runs (the node's parameter)")
    ap.add_argument("--loop-cpus", default="")
    ap.add_argument("--lock-memory", action="store_true")
    ap.add_argument("--gpu-programs", type=int, default=64, help="cuda_persistent's programs")
    ap.add_argument("--label", default="")
    ap.add_argument("--note", default="")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--loops-first", action="store_true",
                    help="run phase 2 before phase 1 (the long loop first on a time budget)")
    args = ap.parse_args()
    if args.loops is None:
        args.loops = default_loops(torch.cuda.is_available(), _has_triton())
    if args.publisher:
        publisher_main(args.publisher, args.publisher_cpus)
        return 0
    torch.set_num_threads(1)
    GPU_PROGRAMS[0] = args.gpu_programs
    if args.node_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.node_cpus.split(",")})
    commit = bench_common.git_commit(args.commit)
    backends = list(BACKENDS) if args.backends == "all" else args.backends.split(",")
    cache = tempfile.mkdtemp(prefix="kestrel_bench_")

    def save() -> str:
        text = markdown(report)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
            Path(args.out).with_suffix(".md").write_text(text)
        return text

    report = {"label": args.label or platform.node(), "machine": machine_info(),
              "commit": commit or "unknown",
              "command": " ".join(["python", "scripts/bench_control.py", *sys.argv[1:]]),
              "note": args.note, "steps": {}, "loops": []}

    def phase1() -> None:
        print("phase 1: step latency", flush=True)
        report["steps"] = bench_steps(backends, args.step_iters, cache)
        report["window_form_graph"] = bench_window_graph(args.step_iters)
        report["eventfd_write_us"] = bench_eventfd()
        save()

    def phase2() -> None:
        print("phase 2: loops with ROS I/O", flush=True)
        for spec in [s for s in args.loops.split(",") if s]:
            backend, rest = spec.split("@")
            rate, cycles, *mode = rest.split(":")
            mode = mode[0] if mode else args.loop_mode
            if mode not in ("thread", "process", "process_py"):
                raise SystemExit(f"--loops {spec!r}: mode {mode!r} must be thread, process or "
                                 "process_py")
            result = bench_loop(backend, float(rate), int(cycles), mode, args, cache)
            result["spec"] = spec
            report["loops"].append(result)
            save()

    for phase in ((phase2, phase1) if args.loops_first else (phase1, phase2)):
        phase()
    print(save())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
