"""The deployment checklist's parameter checks: a stack's params files (or the values read from
running nodes) against each node's ParamSpecs, and the settings a deployment should have:
precision, compile / CUDA graph where the device allows, files present, the TensorRT engine
for its key, the time source the same on every node. No rclpy.

Values are flat dicts of dotted names per node ({"control": {"loop.rt_priority": 80, ...}}).
KNOBS names each parameter a check reads (a rename is one edit here).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from kestrel_bench.doctor_host import FAIL, PASS, SKIP, WARN, Check
from kestrel_bench.repo import ROOT, ensure_paths

# node -> module with its SPECS (sim: its specs live in the node module, a ROS import)
SPEC_MODULES = {"perception": "kestrel_perception.core.params",
                "control": "kestrel_control.control_params",
                "planner": "kestrel_planner.params"}
# declared by every node (kestrel_common.base_node.BASE_SPECS)
BASE_NAMES = ("gc_freeze", "autostart", "diagnostics_period")
KNOBS = {
    "perception": {"device": "runtime.device", "precision": "runtime.precision",
                   "compile": "runtime.compile", "cuda_graph": "runtime.cuda_graph",
                   "engine": "runtime.engine", "engine_dir": "runtime.trt_engine_dir",
                   "weights": "model.weights_path", "model": "model.path",
                   "cameras": "num_cameras", "warmup_size": "warmup_size"},
    "control": {"backend": "policy.backend", "weights": "policy.weights_path",
                "model": "policy.model_path", "rt_priority": "loop.rt_priority",
                "cpu_affinity": "loop.cpu_affinity", "lock_memory": "loop.lock_memory",
                "spin_us": "loop.spin_us", "rate_hz": "loop.rate_hz"},
    "planner": {"device": "device", "backend": "backend", "engine_compile": "engine_compile",
                "hf_dtype": "hf.dtype", "weights": "weights_path",
                "hf_model": "hf.model_path"},
}


def knob(node: str, values: dict, name: str, default: Any = None) -> Any:
    return values.get(KNOBS[node][name], default)


def load_params_files(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """YAML params files -> {node name: flat dotted values}; the node name is the last part of
    the file's top-level key (`/robot/control` -> control). Entries without ros__parameters
    (other YAML in a config folder) are skipped."""
    import yaml
    from kestrel_common.params import flatten_params

    nodes: dict[str, dict[str, Any]] = {}
    for path in paths:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(doc, dict):
            continue
        for key, body in doc.items():
            if not isinstance(body, dict) or not isinstance(body.get("ros__parameters"), dict):
                continue  # not a node's parameters (another kind of YAML in the folder)
            name = str(key).rstrip("/").rpartition("/")[2]
            nodes.setdefault(name, {}).update(flatten_params(body["ros__parameters"]))
    return nodes


def check_specs(nodes: dict[str, dict[str, Any]]) -> list[Check]:
    """Names known and values valid, as the node's configure would check them."""
    ensure_paths("kestrel_common", "kestrel_models", "kestrel_perception", "kestrel_control",
                 "kestrel_planner")
    from kestrel_common.params import ParamError, check_known_names, validate_params

    out = []
    for node, values in nodes.items():
        module_name = SPEC_MODULES.get(node)
        if module_name is None:
            out.append(Check(f"params.{node}", SKIP, "no parameter table without ROS for this "
                             "node (its node module declares them)"))
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - a broken install is itself a finding
            out.append(Check(f"params.{node}", FAIL, f"cannot import {module_name}: {exc}",
                             "make setup"))
            continue
        specs = module.SPECS
        try:
            check_known_names([s.name for s in specs] + list(BASE_NAMES), values)
            validate_params(specs, {k: v for k, v in values.items() if k not in BASE_NAMES})
            if node == "perception" and hasattr(module, "validate_perception_params"):
                full = validate_params(specs, values)
                module.validate_perception_params(full)
        except (ParamError, ValueError) as exc:
            out.append(Check(f"params.{node}", FAIL, str(exc), "correct the value in the "
                             f"{node} params file"))
            continue
        out.append(Check(f"params.{node}", PASS, f"{len(values)} values, all known and valid"))
    return out


def _defaults(node: str) -> dict[str, Any]:
    try:
        module = importlib.import_module(SPEC_MODULES[node])
    except Exception:  # noqa: BLE001
        return {}
    return {s.name: s.default for s in module.SPECS}


def check_runtime_settings(nodes: dict[str, dict[str, Any]], cuda: bool) -> list[Check]:
    """Precision and compile / graph settings against the device this machine has."""
    out: list[Check] = []
    if "perception" in nodes:
        v = {**_defaults("perception"), **nodes["perception"]}
        out += _perception(v, cuda)
    if "control" in nodes:
        v = {**_defaults("control"), **nodes["control"]}
        out += _control(str(knob("control", v, "backend", "")), cuda)
    if "planner" in nodes:
        v = {**_defaults("planner"), **nodes["planner"]}
        out += _planner(v, cuda)
    return out


def _control(backend: str, cuda: bool) -> list[Check]:
    """The policy backend against the device, and (where the deployment is this machine) the
    registry's own check that it can run here (packages, CUDA)."""
    if backend == "auto":
        return [Check("control.backend", PASS, "policy.backend auto: the measured best that "
                      "runs here, picked at configure (the node logs which)")]
    on_gpu = backend.startswith("cuda") or backend == "tensorrt"
    if on_gpu and not cuda:
        return [Check("control.backend", FAIL, f"policy.backend {backend} needs a CUDA GPU; "
                      "this machine has none", "policy.backend: onnxruntime")]
    if not on_gpu and cuda:
        return [Check("control.backend", WARN, f"policy.backend {backend} on a machine with a "
                      "GPU", "policy.backend: cuda_graph_triton (or cuda_persistent on a GPU "
                      "the loop has to itself)")]
    try:
        ensure_paths("kestrel_models")
        import torch
        from kestrel_models.control.registry import check_backend
    except ImportError as exc:
        return [Check("control.backend", PASS, f"policy.backend {backend} (registry check "
                      f"skipped: {exc})")]
    if torch.cuda.is_available() != cuda:  # checking a deployment for another machine
        return [Check("control.backend", PASS, f"policy.backend {backend}")]
    try:
        check_backend(backend)
    except ValueError as exc:  # BackendUnavailable included
        return [Check("control.backend", FAIL, str(exc), "install what it names, or another "
                      "policy.backend (kestrel_models/control/registry.py says when each wins)")]
    return [Check("control.backend", PASS, f"policy.backend {backend}, runs here")]


def _perception(v: dict, cuda: bool) -> list[Check]:
    """The runtime options resolved as the node resolves them at configure
    (kestrel_models.perception.options): a combination that cannot run FAILs; on CUDA an fp32,
    uncompiled or ungraphed forward of the reference model WARNs."""
    device = str(knob("perception", v, "device", "cpu"))
    if device.startswith("cuda") and not cuda:
        return [Check("perception.device", FAIL, f"runtime.device {device}: no CUDA GPU here",
                      "runtime.device: cpu (or run on the GPU machine)")]
    out: list[Check] = []
    if device == "cpu" and cuda:
        out.append(Check("perception.device", WARN, "runtime.device cpu on a machine with a "
                         "GPU", "runtime.device: cuda"))
    model = str(knob("perception", v, "model", "") or "")
    user = None if not model else {".onnx": "onnx", ".pt2": "exported_program"}.get(
        Path(model).suffix, "torchscript")
    try:
        ensure_paths("kestrel_models")
        from kestrel_models.perception.options import OptionError, resolve_options
    except ImportError as exc:
        return out + [Check("perception.runtime", SKIP, f"options resolver not importable: "
                            f"{exc}")]
    try:
        opts = resolve_options(device, knob("perception", v, "engine", "auto"),
                               knob("perception", v, "precision", "auto"),
                               knob("perception", v, "compile", "auto"),
                               knob("perception", v, "cuda_graph", "auto"),
                               v.get("runtime.optimize", "auto"), user_format=user,
                               prefix="runtime.")
    except OptionError as exc:
        return out + [Check("perception.runtime", FAIL, str(exc),
                            f"change '{exc.name}' (or set it to auto)")]
    out.append(Check("perception.runtime", PASS, f"{device}: {opts.describe()}"))
    if not device.startswith("cuda") or user is not None or opts.engine != "torch":
        return out
    for name, bad, fix in (
            ("precision", opts.precision == "fp32", "runtime.precision: bf16 (or auto)"),
            ("cuda_graph", not opts.cuda_graph,
             "runtime.cuda_graph: true (one replay instead of a launch per kernel)"),
            ("compile", opts.compile == "off", "runtime.compile: branched (or auto)")):
        if bad:
            out.append(Check(f"perception.{name}", WARN, f"runtime.{name} resolves to "
                             f"{getattr(opts, name)} on CUDA", fix))
    return out


def _planner(v: dict, cuda: bool) -> list[Check]:
    device = str(knob("planner", v, "device", "cpu"))
    backend = str(knob("planner", v, "backend", ""))
    if device.startswith("cuda") and not cuda:
        return [Check("planner.device", FAIL, f"device {device}: no CUDA GPU here",
                      "device: cpu")]
    if not device.startswith("cuda"):
        return [Check("planner.backend", WARN if cuda else PASS, f"{backend} on {device}",
                      "device: cuda" if cuda else "")]
    out = []
    if backend == "generate":
        out.append(Check("planner.backend", WARN, "backend generate on CUDA",
                         "backend: engine (KV-cache slots, CUDA-graph decode)"))
    elif backend == "engine":
        comp = bool(knob("planner", v, "engine_compile", False))
        out.append(Check("planner.backend", PASS if comp else WARN,
                         f"backend engine, engine_compile {comp}",
                         "" if comp else "engine_compile: true (compiled decode step)"))
    elif backend == "hf":
        dt = knob("planner", v, "hf_dtype", "auto")
        out.append(Check("planner.backend", WARN if dt == "float32" else PASS,
                         f"backend hf, hf.dtype {dt}",
                         "hf.dtype: bfloat16" if dt == "float32" else ""))
    else:
        out.append(Check("planner.backend", PASS, f"backend {backend}"))
    return out


def resolve_file(path: str) -> Path | None:
    """A params file's path -> an existing file, or None. package://<pkg>/<rel>: the installed
    share of <pkg>, else its source folder ros2_ws/src/<pkg>/<rel>."""
    if not path.startswith("package://"):
        p = Path(os.path.expanduser(path))
        return p if p.is_file() else None
    pkg, _, rel = path[len("package://"):].partition("/")
    cands = [ROOT / "ros2_ws" / "src" / pkg / rel]
    try:
        from ament_index_python.packages import get_package_share_directory
        cands.insert(0, Path(get_package_share_directory(pkg)) / rel)
    except Exception:  # noqa: BLE001 - not installed
        pass
    return next((c for c in cands if c.is_file()), None)


def check_files(nodes: dict[str, dict[str, Any]]) -> list[Check]:
    """Weights and model files named by the params exist."""
    out = []
    for node in ("perception", "control", "planner"):
        for key in ("weights", "model", "hf_model"):
            name = KNOBS.get(node, {}).get(key)
            value = nodes.get(node, {}).get(name) if name else None
            if not value:
                continue
            if key == "hf_model":
                ok = Path(value).is_dir()
            else:
                ok = resolve_file(str(value)) is not None
            out.append(Check(f"{node}.{key}", PASS if ok else FAIL,
                             f"{name} {value}: {'found' if ok else 'not found'}",
                             "" if ok else f"fix the path of {name}"))
    return out


def check_trt_engine(nodes: dict[str, dict[str, Any]], cuda: bool) -> list[Check]:
    """runtime.engine tensorrt: TensorRT installed and the engine for the node's key built."""
    v = nodes.get("perception")
    if not v or knob("perception", v, "engine") != "tensorrt":
        return []
    ensure_paths("kestrel_models")
    from kestrel_models.trt import TensorRTUnavailableError, tensorrt_version

    try:
        version = tensorrt_version()
    except TensorRTUnavailableError as exc:
        return [Check("perception.trt_engine", FAIL, f"runtime.engine tensorrt: {exc}",
                      "install TensorRT on this machine, or runtime.engine: torch")]
    if not cuda:
        return [Check("perception.trt_engine", FAIL, "runtime.engine tensorrt needs a CUDA GPU",
                      "runtime.engine: torch")]
    try:
        return [_find_engine(v, version)]
    except Exception as exc:  # noqa: BLE001 - the key needs the whole model: report why not
        return [Check("perception.trt_engine", WARN, f"engine key not computed: {exc}",
                      "run the node once: configure fails naming the build command")]


def _find_engine(v: dict, version: str) -> Check:
    import torch
    from kestrel_models.perception.export import (EngineMissingError, build_command,
                                                  find_engine, perception_engine_key)
    from kestrel_models.perception.trt_runtime import default_engine_dir
    from kestrel_models.perception.model import MultiTaskPerceptionModel, load_weights
    from kestrel_perception.core import params as pparams
    from kestrel_perception.core.perception_core import resolve_weights_path

    full = {**_defaults("perception"), **v}
    cfg = pparams.core_config(full)
    with torch.random.fork_rng(devices=[]):  # the node's seeded initialisation
        torch.manual_seed(cfg.seed)
        model = MultiTaskPerceptionModel(cfg.model).eval()
    if cfg.weights_path:
        load_weights(model, resolve_weights_path(cfg.weights_path))
    heads = frozenset(h for h in ("detection", "segmentation", "depth")
                      if full.get(f"enable_{h}", True))
    w, h = full[KNOBS["perception"]["warmup_size"]]
    cams = int(full[KNOBS["perception"]["cameras"]])
    precision = str(full[KNOBS["perception"]["precision"]])
    directory = full.get(KNOBS["perception"]["engine_dir"]) or default_engine_dir()
    key = perception_engine_key(model, heads, cams, (h, w), precision,
                                torch.cuda.get_device_name(0), version)
    try:
        path = find_engine(directory, key)
    except EngineMissingError:
        return Check("perception.trt_engine", FAIL, f"no engine for key {key} in {directory}",
                     build_command(heads, cams, (h, w), precision, directory, cfg.model))
    return Check("perception.trt_engine", PASS, f"engine {path}")


def check_time_source(nodes: dict[str, dict[str, Any]]) -> list[Check]:
    """use_sim_time the same on every node that reads a clock: a node on wall time beside nodes
    on /clock compares stamps from two clocks. The stack's launch sets it per node (the sim,
    which publishes /clock, on wall time); a params file's value is what the node gets only
    where the launch does not set it."""
    ensure_paths("kestrel_common")
    try:
        from kestrel_bringup.stack import STACK
        launch = {e.name: e.use_sim_time for e in STACK}
    except ImportError:
        launch = {}
    clocks = {}
    for node, values in nodes.items():
        if node == "sim":
            continue
        clocks[node] = bool(values.get("use_sim_time", launch.get(node, False)))
    if len(set(clocks.values())) > 1:
        return [Check("time.use_sim_time", FAIL, "use_sim_time differs between nodes: "
                      + ", ".join(f"{n}={v}" for n, v in sorted(clocks.items())),
                      "the same use_sim_time on every node (true with the sim, false on a "
                      "robot)")]
    if not clocks:
        return []
    value = next(iter(clocks.values()))
    return [Check("time.use_sim_time", PASS, f"use_sim_time {value} on "
                  + ", ".join(sorted(clocks)))]
