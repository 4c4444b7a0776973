"""`kestrel_bench control`: the control node's policy step and its 1 kHz loop.

Step latency: for each backend of the registry (`kestrel_models.control.BACKENDS`) that runs
here, a PolicyRunner with the reference policy (obs 256 -> 512 -> 256, LSTM 256, 12 actions; 6
joints) does `--step-iters` ticks on fresh observations: the full tick (`runner.step`: buffer
read, safety, inference, command) and the backend step alone. On a GPU also the window form
(8 LSTM steps over a history) in one CUDA graph, for reference. A backend name with the suffix
`+ts` runs the reference architecture (one action per joint) exported to TorchScript and
loaded as a user's policy file. Loops (`--loops backend@rate_hz:cycles[:thread|process|
process_py]`, control_loop.py; needs rclpy): the real-time loop with ROS I/O live; deadline
misses (by cause), wake error, period jitter, step latency, power per control step.

Roles and ratios: `--baseline` (default cuda_eager on a GPU, cpu_eager on a CPU) and
`--optimized` (cuda_graph / onnxruntime). ratios: optimized_vs_baseline_tick_p50 and
_tick_p99 (baseline tick / optimized tick), optimized_vs_baseline_step_p50 (backend step).
`--quick`: the CPU pair for 2,000 ticks each, no loop (seconds; the CI gate's input).

  python -m kestrel_bench control --quick
  python -m kestrel_bench control                  # GPU: 100,000 graph-path cycles at 1 kHz
  python -m kestrel_bench control --loop-cpus auto --shield --rt-priority 80 \
      --loops cuda_graph@1000:100000:process
Pinning: --loop-cpus (or 'auto': the CPU that served the fewest interrupts over 2 s, not CPU
0), --shield (move every other task and, with root, the interrupts off the loop CPU:
kestrel_control.core.cpu_shield), --node-cpus (this process), --publisher-cpus.
Left out: the resident kernel's programs sweep and its cost to co-tenant GPU work (a study
of cuda_persistent whose outcome is in docs/benchmarks), and the host tick's parts timed with a
no-op step (`kestrel_bench profile control` splits the tick instead).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kestrel_bench import record as rec_mod
from kestrel_bench import stats
from kestrel_bench.repo import ensure_paths

USER_FILE = "+ts"  # backend suffix: the policy as a user's TorchScript file


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="CPU pair (cpu_eager vs onnxruntime), 2,000 ticks each, no loop")
    ap.add_argument("--backends", default="all", help="comma list or 'all' (the registry)")
    ap.add_argument("--baseline", default="", help="baseline backend (default per device)")
    ap.add_argument("--optimized", default="", help="optimized backend (default per device)")
    ap.add_argument("--step-iters", type=int, default=5000)
    ap.add_argument("--loops", default=None,
                    help="comma list of backend@rate_hz:cycles[:thread|process|process_py] "
                         "('' = none; default: 100,000 graph-path cycles + eager GPU and CPU "
                         "10,000 each on a GPU machine, 10,000 CPU cycles elsewhere)")
    ap.add_argument("--loop-mode", choices=("thread", "process"), default="process",
                    help="mode of --loops entries without their own")
    ap.add_argument("--loops-first", action="store_true",
                    help="the loops before the step latencies (the long loop first)")
    ap.add_argument("--loop-cpus", default="", help="CPUs of the loop thread/process, or 'auto'")
    ap.add_argument("--shield", action="store_true",
                    help="move other tasks (and with root the interrupts) off --loop-cpus")
    ap.add_argument("--node-cpus", default="", help="CPUs of this process (ROS executor)")
    ap.add_argument("--publisher-cpus", default="", help="CPUs of the publisher process")
    ap.add_argument("--pub-rate", type=float, default=1000.0, help="joint states, Hz")
    ap.add_argument("--spin-us", type=float, default=200.0, help="busy-wait before a deadline")
    ap.add_argument("--rt-priority", type=int, default=0, help="SCHED_FIFO priority (0 = off)")
    ap.add_argument("--lock-memory", action="store_true", help="mlockall in the loop")
    ap.add_argument("--gil-switch-us", type=float, default=50.0,
                    help="sys.setswitchinterval while the loop runs")
    ap.add_argument("--no-miss-attribution", action="store_true",
                    help="the loop without its per-cycle miss-cause reads")
    ap.add_argument("--gpu-programs", type=int, default=64, help="cuda_persistent's programs")
    rec_mod.add_common_arguments(ap)


def _registry() -> tuple[tuple[str, ...], tuple[str, ...]]:
    import kestrel_models.control as kc

    names = tuple(kc.BACKENDS)
    try:
        from kestrel_models.control.registry import CUDA_BACKENDS
    except ImportError:  # older layout: the names say the device
        CUDA_BACKENDS = tuple(n for n in names if n.startswith(("cuda", "tensorrt")))
    return names, tuple(CUDA_BACKENDS)


def default_loops(cuda: bool, triton: bool) -> str:
    """On a GPU the graph path for 100,000 cycles at 1 kHz (the fused Triton step where triton
    is installed), then eager GPU and CPU for 10,000 cycles each, all in the loop process; on a
    CPU machine the CPU policy for 10,000 cycles."""
    if not cuda:
        return "cpu_eager@1000:10000"
    graph = "cuda_graph_triton" if triton else "cuda_graph"
    return (f"{graph}@1000:100000:process,cuda_eager@1000:10000:process,"
            "cpu_eager@1000:10000:process")


def parse_loops(text: str, default_mode: str) -> list[tuple[str, float, int, str]]:
    from kestrel_bench.control_loop import MODES

    out = []
    for spec in [s for s in text.split(",") if s]:
        try:
            backend, rest = spec.split("@")
            rate, cycles, *mode = rest.split(":")
            entry = (backend, float(rate), int(cycles), mode[0] if mode else default_mode)
        except ValueError:
            raise SystemExit(f"--loops {spec!r}: expected backend@rate_hz:cycles[:mode]") from None
        if entry[3] not in MODES:
            raise SystemExit(f"--loops {spec!r}: mode {entry[3]!r} must be one of {MODES}")
        out.append(entry)
    return out


def user_torchscript(cache: str):  # noqa: ANN201 (ModelSpec)
    """The reference architecture with one action per joint, its step scripted with h/c as
    explicit inputs/outputs, saved as a user's policy.pt."""
    import torch
    from kestrel_models.control.external import ModelSpec
    from kestrel_models.control.policy import PolicyConfig, build_policy
    from kestrel_models.control.runtimes import StepModule

    from kestrel_bench.control_loop import N_JOINTS

    cfg = PolicyConfig(num_actions=N_JOINTS)
    path = Path(cache) / "user_policy_step.pt"
    if not path.exists():
        torch.jit.script(StepModule(build_policy(cfg, seed=0), fused=True).eval()).save(str(path))
    shape = (1, cfg.lstm_hidden)
    return ModelSpec(path=str(path), format="torchscript", state_in_names=("h_in", "c_in"),
                     state_out_names=("h_out", "c_out"), state_shapes=(shape, shape),
                     obs_dim=cfg.obs_dim)


def make_config(backend: str, cache: str, programs: int, warmup: int = 50):  # noqa: ANN201
    from kestrel_control.core.policy_runner import RunnerConfig
    from kestrel_models.control.policy import PolicyConfig

    from kestrel_bench.control_loop import N_JOINTS

    model = None
    if backend.endswith(USER_FILE):
        backend, model = backend[:-len(USER_FILE)], user_torchscript(cache)
    return RunnerConfig(joint_lower=[-3.1] * N_JOINTS, joint_upper=[3.1] * N_JOINTS,
                        policy=PolicyConfig(), backend=backend, max_obs_age_s=0.02,
                        warmup_steps=warmup, cache_dir=cache, latency_compensation=True,
                        gpu_programs=programs, model=model)


def bench_step(name: str, iters: int, cache: str, programs: int) -> dict:
    """Tick and backend-step latencies (ms summaries) of backend `name`, or {"skipped"}."""
    from kestrel_control.core.policy_runner import PolicyRunner

    from kestrel_bench.control_loop import N_JOINTS
    from kestrel_bench.power import PowerMeter
    from kestrel_bench.timing import time_calls

    t0 = time.perf_counter()
    try:
        runner = PolicyRunner(make_config(name, cache, programs))
    except ValueError as exc:  # BackendUnavailable included
        return {"skipped": str(exc)}
    build_s = time.perf_counter() - t0
    js = np.zeros((2, N_JOINTS))
    tick = np.empty(iters)
    clock = time.perf_counter_ns
    meter = PowerMeter() if name.startswith(("cuda", "tensorrt")) else None
    gc.collect()
    gc.disable()
    try:
        if meter is not None:
            meter.start()
        for i in range(iters):
            js[0, 0] = 1e-4 * i
            now = time.time_ns()
            runner.joint_states.write(js, now)
            a = clock()
            runner.step(now + 1000)
            tick[i] = (clock() - a) * 1e-9
        if meter is not None:
            meter.stop()
        infer = time_calls(runner.backend.step, iters)
    finally:
        gc.enable()
    status = runner.info.status.name
    runner.close()  # cuda_persistent: end its resident kernel before the next backend
    out = {"latency_ms": stats.summary(tick, 1e3), "step_ms": stats.summary(infer, 1e3),
           "build_s": build_s, "status": status,
           "power": meter.result(iters, "control step") if meter else None}
    print(f"  {name:22s} tick p50 {out['latency_ms']['p50'] * 1e3:8.1f} p99.9 "
          f"{out['latency_ms']['p999'] * 1e3:8.1f} us | step p50 "
          f"{out['step_ms']['p50'] * 1e3:8.1f} us | build {build_s:.1f} s", flush=True)
    return out


def bench_window_graph(iters: int) -> dict:
    """The window form (8 LSTM steps over a history) in one CUDA graph, batch 1 (reference)."""
    import torch
    from kestrel_models.control.policy import PolicyConfig, build_policy

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
    for i in range(iters + 100):
        a = time.perf_counter_ns()
        graph.replay()
        while not stream.query():
            pass
        if i >= 100:
            times[i - 100] = (time.perf_counter_ns() - a) * 1e-9
    return {"latency_ms": stats.summary(times, 1e3), "history": cfg.history}


def pick_loop_cpu() -> str:
    """The CPU (not CPU 0) that served the fewest interrupts over 2 s."""
    from kestrel_control.core.cpu_shield import irq_counts

    cpus = sorted(os.sched_getaffinity(0))
    a = irq_counts()
    time.sleep(2.0)
    b = irq_counts()
    cand = [c for c in cpus if c != 0] or cpus
    return str(min(cand, key=lambda c: b.get(c, 0) - a.get(c, 0)))


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models", "kestrel_common", "kestrel_control")
    import torch

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    names, cuda_names = _registry()
    baseline = args.baseline or ("cuda_eager" if cuda else "cpu_eager")
    optimized = args.optimized or ("cuda_graph" if cuda else "onnxruntime")
    if args.quick:
        baseline, optimized = args.baseline or "cpu_eager", args.optimized or "onnxruntime"
        backends, args.step_iters = [baseline, optimized], min(args.step_iters, 2000)
        args.loops = ""
    elif args.backends == "all":
        backends = [n for n in names if cuda or n not in cuda_names]
    else:
        backends = [b for b in args.backends.split(",") if b]
    for b in (baseline, optimized, *backends):
        if b.removesuffix(USER_FILE) not in names:
            raise SystemExit(f"backend {b!r}: must be one of {', '.join(names)} (+ '{USER_FILE}')")
    if args.loops is None:
        import importlib.util
        args.loops = default_loops(cuda, importlib.util.find_spec("triton") is not None)
    loops = parse_loops(args.loops, args.loop_mode)
    if args.node_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.node_cpus.split(",")})
    notes = []
    if loops and args.loop_cpus == "auto":
        args.loop_cpus = pick_loop_cpu()
        notes.append(f"loop CPU {args.loop_cpus}: the fewest interrupts over 2 s")
    if loops and args.shield and args.loop_cpus:
        from kestrel_control.core.cpu_shield import main as shield_main

        shield_main(["--cpus", args.loop_cpus, "--irqs"])
        notes.append(f"CPU {args.loop_cpus} shielded (other tasks and interrupts moved off)")
    cache = tempfile.mkdtemp(prefix="kestrel_bench_")
    config = {"quick": args.quick, "policy": "reference (obs 256, MLP 512-256, LSTM 256, 12 "
              "actions)", "joints": 6, "step_iters": args.step_iters, "backends": backends,
              "baseline": baseline, "optimized": optimized, "loops": args.loops,
              "loop_cpus": args.loop_cpus, "node_cpus": args.node_cpus,
              "publisher_cpus": args.publisher_cpus, "rt_priority": args.rt_priority,
              "spin_us": args.spin_us, "gil_switch_us": args.gil_switch_us,
              "lock_memory": args.lock_memory}
    record = rec_mod.Record("control", config, getattr(args, "argv", None), args.commit)
    for n in notes:
        record.note(n)

    def steps() -> None:
        print("step latency (tick and backend step)", flush=True)
        for name in dict.fromkeys(backends):
            r = bench_step(name, args.step_iters, cache, args.gpu_programs)
            role = ("baseline" if name == baseline else "optimized" if name == optimized
                    else "variant")
            if "skipped" in r:
                record.add(name, role, skipped=r["skipped"])
                continue
            record.add(name, role, latency_ms=r["latency_ms"], power=r["power"],
                       throughput=1e3 / r["latency_ms"]["p50"], unit="Hz",
                       metrics={"backend_step_p50_us": r["step_ms"]["p50"] * 1e3,
                                "backend_step_p999_us": r["step_ms"]["p999"] * 1e3,
                                "build_s": r["build_s"]},
                       config={"measure": "tick (runner.step)", "status": r["status"]})
        if cuda and not args.quick:
            w = bench_window_graph(args.step_iters)
            record.add("window_form_graph", "variant", latency_ms=w["latency_ms"],
                       config={"measure": f"{w['history']} LSTM steps in one CUDA graph "
                               "(reference)"})

    def loop_rows() -> None:
        from kestrel_bench.control_loop import run_loop

        for backend, rate, cycles, mode in loops:
            print(f"loop {backend}@{rate:g} Hz x {cycles} [{mode}] with ROS I/O", flush=True)
            name = f"loop:{backend}@{rate:g}Hz:{mode}"
            cfg = make_config(backend, cache, args.gpu_programs)
            r = run_loop(cfg, rate, cycles, mode, args)
            if "skipped" in r:
                record.add(name, "variant", skipped=r["skipped"])
                continue
            record.add(name, "variant", latency_ms=r["latency_ms"], metrics=r["metrics"],
                       power=r["power"], config={"backend": backend, "rate_hz": rate,
                                                 "cycles": cycles, "mode": mode,
                                                 "measure": "loop step latency"},
                       loop=r["extra"],
                       **({"histogram_us": r["histogram_us"]} if r.get("histogram_us") else {}))

    for phase in ((loop_rows, steps) if args.loops_first else (steps, loop_rows)):
        phase()
    b, o = record.result(baseline), record.result(optimized)
    if b and o and "latency_ms" in b and "latency_ms" in o:
        for q in ("p50", "p99"):
            record.ratio(f"optimized_vs_baseline_tick_{q}",
                         stats.ratio(b["latency_ms"][q], o["latency_ms"][q]))
        record.ratio("optimized_vs_baseline_step_p50",
                     stats.ratio(b["metrics"]["backend_step_p50_us"],
                                 o["metrics"]["backend_step_p50_us"]))
    rec_mod.finish(record, args)
    return 0
