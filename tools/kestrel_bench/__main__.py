"""`python -m kestrel_bench <subcommand> [args]` (also the `kestrel-bench` entry point).

Each subcommand is a module of this package with `add_arguments(parser)` and `run(args) -> int`;
modules are imported only when their subcommand runs, so `--help` needs neither torch nor rclpy.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). Keep in the order a user meets them.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "control": ("control", "the control policy step per backend and the 1 kHz loop with ROS I/O"),
    "perception": ("perception", "the perception forward per variant: latency, batch sweep, "
                   "drift vs fp32, memory, power; --compile-modes"),
    "perception-node": ("perception_node", "the perception node end to end with ROS I/O "
                        "(messages in -> result out)"),
    "transport": ("transport", "ROS 2 transport: camera sets, results, commands, DDS sizes"),
    "planner": ("planner", "planner decoding: our engine vs HF transformers, tok/s, TTFT"),
    "planner-hf": ("planner_hf", "HF VLM checkpoints (random weights, published shapes) on our "
                   "engine vs transformers: tok/s, TTFT, 16 streams, weight-bandwidth floor"),
    "planner-steps": ("planner_steps", "the engine's decode step per kernel option at the "
                      "planner-hf shapes: GPU time per step, weight-bandwidth floor"),
    "kernels": ("kernels", "GPU kernel micro-benchmarks: box medians, NMS rounds, decode "
                "kernels"),
    "profile": ("profile", "classify each stage of a step as compute-, memory-, launch- or "
                "transport-bound, with the knobs to turn"),
    "paired": ("paired", "baseline vs optimized paths timed interleaved: same-run ratios, "
               "the CI gate's input"),
    "gate": ("gate", "compare a record with a baseline of the same machine class and config; "
             "exit 1 on a regression"),
    "doctor": ("doctor", "deployment checklist: params, models, real-time settings, GPU, DDS, "
               "time source; PASS/WARN/FAIL with the fix"),
    "soak": ("soak", "the whole stack for a given time: per-node RSS, threads, fds, misses, "
             "drops; fails on growth or a crash"),
    "report": ("report", "render docs/benchmarks' records into REPORT.md with plots"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="kestrel_bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    for name, (_module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = importlib.import_module(f"kestrel_bench.{SUBCOMMANDS[name][0]}")
    sub_parser = argparse.ArgumentParser(prog=f"kestrel_bench {name}",
                                         description=SUBCOMMANDS[name][1])
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    args.argv = ["python", "-m", "kestrel_bench", *argv]
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
