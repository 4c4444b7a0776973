"""`kestrel_bench doctor` (also `python -m kestrel_bringup.doctor`): the deployment checklist.

Checks a stack's params files (default: kestrel_bringup's config/*.yaml), or the parameters of
the running nodes (`--live`, through their parameter services: doctor_node.py), the models
given with `--model`, and this machine, each item PASS / WARN / FAIL / SKIP with the fix:
  params.<node>        names known and values valid, as configure would check them
  <node>.* settings    precision, compile and CUDA graph where the device allows, backends
  files                weights / model files present; the TensorRT engine for the node's key
  model.<file>         eval mode, gradients off, parameter dtypes
  time.use_sim_time    the same time source on every node
  rt.*                 SCHED_FIFO granted for loop.rt_priority, CPU affinity, mlock limit, the
                       kernel's real-time throttle
  gpu<i>.*             persistence mode and clocks (NVML; SKIP without a driver)
  dds.*                RMW and the Fast DDS profile for camera-sized samples
Exit 1 when any item FAILs.

    python -m kestrel_bench doctor
    python -m kestrel_bench doctor --params my_robot.yaml --model policy.pt --cuda yes
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from kestrel_bench import doctor_host, doctor_params
from kestrel_bench.doctor_host import FAIL, PASS, SKIP, WARN, Check
from kestrel_bench.repo import ROOT

CONFIG_DIR = ROOT / "ros2_ws" / "src" / "kestrel_bringup" / "config"


def check_model(model: object, name: str = "model", cuda: bool = False) -> list[Check]:
    """A torch module as it will serve: eval mode, no parameter that wants gradients, and its
    parameter dtypes (fp32 on a GPU: WARN, bf16/fp16 is faster)."""
    modules = list(model.modules()) if hasattr(model, "modules") else [model]
    training = [type(m).__name__ for m in modules if getattr(m, "training", False)]
    params = list(model.parameters()) if hasattr(model, "parameters") else []
    grads = sum(int(p.requires_grad) for p in params)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    out = [Check(f"model.{name}.eval", FAIL if training else PASS,
                 f"{len(training)} of {len(modules)} modules in training mode"
                 + (f" (e.g. {training[0]})" if training else ""),
                 "model.eval() before saving or serving (dropout / batch norm behave "
                 "differently in training mode)" if training else ""),
           Check(f"model.{name}.grad", WARN if grads else PASS,
                 f"{grads} of {len(params)} parameters require gradients",
                 "requires_grad_(False) on the parameters, or run under torch.inference_mode()"
                 if grads else "")]
    fp32_on_gpu = cuda and dtypes == ["float32"]
    out.append(Check(f"model.{name}.dtype", WARN if fp32_on_gpu else PASS,
                     f"parameters {', '.join(dtypes) or 'none'}",
                     "bf16 on the GPU (the node's precision setting, or cast the weights)"
                     if fp32_on_gpu else ""))
    return out


def check_model_file(path: Path, cuda: bool) -> list[Check]:
    """Load a TorchScript (.pt) or ExportedProgram (.pt2) file and check it; ONNX has no
    training mode (SKIP)."""
    import torch

    name = path.name
    if not path.is_file():
        return [Check(f"model.{name}", FAIL, f"{path}: no such file", "fix the path")]
    if path.suffix == ".onnx":
        return [Check(f"model.{name}", SKIP, "ONNX: no training mode or gradients to check")]
    try:
        if path.suffix == ".pt2":
            model = torch.export.load(str(path)).module()
        else:
            model = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any load failure is the finding
        return [Check(f"model.{name}", FAIL, f"cannot load {path}: {str(exc)[:200]}",
                      "save it with torch.jit.save / torch.export.save")]
    return check_model(model, name, cuda)


def run_checks(nodes: dict[str, dict], cuda: bool, models: list[Path] = (),
               host: bool = True, control: dict | None = None) -> list[Check]:
    """Every check of the list in the module docstring, in that order."""
    out = doctor_params.check_specs(nodes)
    out += doctor_params.check_runtime_settings(nodes, cuda)
    out += doctor_params.check_files(nodes)
    out += doctor_params.check_trt_engine(nodes, cuda)
    for m in models:
        out += check_model_file(Path(m), cuda)
    out += doctor_params.check_time_source(nodes)
    if host:
        if control is None:
            v = nodes.get("control", {})
            control = {k: v.get(name) for k, name in doctor_params.KNOBS["control"].items()
                       if name in v}
        out += doctor_host.check_realtime(control)
        out += doctor_host.check_gpu()
        out += doctor_host.check_dds()
    return out


def format_checks(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:4s}  {c.name:26s} {c.detail}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"{'':32s}fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, SKIP)}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", action="append", default=[], metavar="FILE",
                        help="a params file (repeatable; default: kestrel_bringup's config/"
                             "*.yaml)")
    parser.add_argument("--live", action="store_true",
                        help="read the parameters of the running stack's nodes instead (ROS)")
    parser.add_argument("--model", action="append", default=[], metavar="FILE",
                        help="a model file to check (TorchScript .pt, ExportedProgram .pt2)")
    parser.add_argument("--cuda", choices=("auto", "yes", "no"), default="auto",
                        help="does the deployment have a CUDA GPU (auto: this machine)")
    parser.add_argument("--no-host", action="store_true",
                        help="skip the checks of this machine (RT, GPU, DDS)")
    parser.add_argument("--json", default="", help="also write the items to this file")


def _cuda(choice: str) -> bool:
    if choice != "auto":
        return choice == "yes"
    try:
        import torch
        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def run(args: argparse.Namespace) -> int:
    if args.live:
        from kestrel_bench.doctor_node import read_live_params

        nodes = {n: {k: v.tolist() if hasattr(v, "tolist") else v for k, v in p.items()}
                 for n, p in read_live_params().items()}
        if not nodes:
            print("doctor: no node of the stack is running (same ROS_DOMAIN_ID?)")
            return 2
        source = "running nodes " + ", ".join(sorted(nodes))
    else:
        files = [Path(p) for p in args.params] or sorted(CONFIG_DIR.glob("*.yaml"))
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            print(f"doctor: no such params file: {', '.join(missing)}")
            return 2
        nodes = doctor_params.load_params_files(files)
        source = ", ".join(str(f) for f in files)
    cuda = _cuda(args.cuda)
    checks = run_checks(nodes, cuda, [Path(m) for m in args.model], host=not args.no_host)
    print(f"doctor: {source} (deployment {'with' if cuda else 'without'} a CUDA GPU)\n")
    print(format_checks(checks))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(c) for c in checks], indent=1) + "\n")
    return 1 if any(c.status == FAIL for c in checks) else 0
