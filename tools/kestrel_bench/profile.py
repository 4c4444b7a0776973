"""`kestrel_bench profile <target>`: where the time of a step goes and what bounds it.

Profiles the target (control | perception | planner, collected by kestrel_bench.traces), or
reads a chrome trace written by torch.profiler (`--trace FILE`, target then only picks the
advice), classifies every top-level record_function stage and the whole step as compute-,
memory-bandwidth-, launch/CPU-overhead- or transport-bound (kestrel_bench.bottleneck), and
prints a table and suggestions in the target's own parameters (kestrel_bench.advice).

    python -m kestrel_bench profile perception --device cuda
    python -m kestrel_bench profile control --trace trace.json --peaks flops=2e11,bw=2e10
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kestrel_bench import advice, bottleneck, peaks

TARGETS = ("control", "perception", "planner", "other")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=TARGETS,
                        help="what to profile (with --trace: whose parameters the advice names)")
    parser.add_argument("--trace", default="",
                        help="a chrome trace (torch.profiler export_chrome_trace) to analyse "
                             "instead of profiling the target here")
    parser.add_argument("--device", default="",
                        help="device the target runs on (default: cuda where available)")
    parser.add_argument("--peaks", default="auto",
                        help="'auto' (datasheet for a known GPU, else a probe), 'probe', or "
                             "'flops=<FLOP/s>,bw=<bytes/s>[,bf16=...]'")
    parser.add_argument("--machine-class", default="",
                        help="peaks table to use with --trace (h200, h100, a100, ...; default: "
                             "this machine's)")
    parser.add_argument("--steps", type=int, default=0, help="profiled steps (default: the "
                        "target's)")
    parser.add_argument("--config", default="", help="model config of the target (perception: "
                        "tiny | r50; planner: tiny | 0.5b)")
    parser.add_argument("--precision", default="", choices=("", "fp32", "bf16", "fp16"),
                        help="perception: autocast precision of the profiled forward")
    parser.add_argument("--json", default="", help="also write the analysis to this file")
    parser.add_argument("--keep-trace", default="",
                        help="write the collected chrome trace to this file")


def _collect(args: argparse.Namespace, device: str) -> Path:
    """Profile the target through kestrel_bench.traces; returns the chrome trace file."""
    from kestrel_bench import traces

    out = Path(args.keep_trace) if args.keep_trace else None
    options = {k: v for k, v in (("steps", args.steps), ("config", args.config),
                                 ("precision", args.precision)) if v}
    return Path(traces.collect(args.target, device=device, out=out, **options))


def _device(args: argparse.Namespace) -> str:
    if args.device:
        return args.device
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def format_table(analysis: bottleneck.Analysis) -> str:
    """A markdown table: one row per stage, then the whole step."""
    p = analysis.peaks
    head = ("| stage | n | host ms | wall ms | share | kernels | mean us | busy | idle ms | "
            "TFLOP/s | GB/s | class |")
    rows = [head, "|" + "---|" * 12]
    total = analysis.step.wall_us or sum(s.wall_us for s in analysis.stages) or 1.0
    for s in [*analysis.stages, analysis.step]:
        rate_f = s.flops / (s.busy_us * 1e-6) / 1e12 if s.busy_us else 0.0
        rate_b = s.bytes / (s.busy_us * 1e-6) / 1e9 if s.busy_us else 0.0
        rows.append(
            f"| {'**step**' if s is analysis.step else s.name} | {s.occurrences} | "
            f"{s.host_us / 1e3:.3f} | {s.wall_us / 1e3:.3f} | {s.wall_us / total:.0%} | "
            f"{s.kernels} | {s.mean_kernel_us:.1f} | {s.busy_share:.0%} | "
            f"{s.gaps_us / 1e3:.3f} | {rate_f:.3g} ({s.flop_util:.0%}) | "
            f"{rate_b:.3g} ({s.bw_util:.0%}) | {s.klass} |")
    rows.append("")
    rows.append(f"Peaks ({p.source}, {p.device}): "
                + ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in p.flops.items())
                + f", memory {p.bytes_per_s / 1e9:.4g} GB/s. Device: {analysis.device}.")
    return "\n".join(rows)


def report(analysis: bottleneck.Analysis, target: str) -> str:
    """Table, the step's verdict with its reason, the make-up by class, and suggestions."""
    lines = [format_table(analysis), ""]
    step = analysis.step
    lines.append(f"Step: {step.klass}-bound ({step.reason}).")
    share = bottleneck.verdict_by_time(analysis.stages)
    if share:
        lines.append("Stage time by class: " + ", ".join(f"{k} {v:.0%}" for k, v in
                                                         share.items()) + ".")
    lines.append("")
    lines.append("Suggestions:")
    # one suggestion per class, for the longest stage of that class (the step without stages)
    seen = set()
    ranked = sorted(analysis.stages, key=lambda s: -s.wall_us) or [step]
    for s in ranked:
        text = advice.suggest(target, s, analysis.device)
        if text and s.klass not in seen:
            seen.add(s.klass)
            lines.append(f"- {text}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = _device(args)
    if not args.trace and args.target == "other":
        print("profile: target 'other' needs --trace FILE")
        return 2
    trace = Path(args.trace) if args.trace else _collect(args, device)
    events = bottleneck.load_trace(trace)
    if not events:
        print(f"{trace}: no complete events")
        return 1
    gpu = any(e.cat in bottleneck.DEVICE_CATS for e in events)
    machine_class = args.machine_class
    if not machine_class:
        from kestrel_bench.record import machine_info
        machine_class = machine_info()["class"]
    try:
        p = peaks.resolve(args.peaks, machine_class, "cuda" if gpu else "cpu")
    except ValueError as exc:
        print(f"profile: {exc}")
        return 2
    analysis = bottleneck.analyze(events, p)
    print(report(analysis, args.target))
    if args.json:
        Path(args.json).write_text(json.dumps({"target": args.target, "trace": str(trace),
                                               **analysis.as_dict()}, indent=1) + "\n")
    return 0
