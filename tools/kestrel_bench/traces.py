"""torch.profiler traces of one target's step, the data `kestrel_bench profile` classifies.

    path = collect("control" | "perception" | "planner", device="cuda", out=None)

Writes a chrome trace (torch.profiler export_chrome_trace, record_shapes and with_flops on, so
the bottleneck identifier has FLOP and byte counts) and returns its path. Each step is split
into top-level record_function stages:
  control     observation (host obs -> device), policy (the reference policy's recurrent
              step), command (action -> host, tanh, clamp): `steps` ticks, batch 1
  perception  h2d (uint8 images -> device, CUDA), then the model's parts in call order:
              backbone, fpn, det_head, dense_neck, seg_head, depth_head (eager; `precision`
              fp32 | bf16 autocast, `channels_last`); r50 at 6 x 640x640 on CUDA, the tiny
              config at 1 x 128x128 on the CPU unless given
  planner     prefill (vision encode + prompt, one pass) and decode (each step), the engine
              without CUDA graphs so that every kernel shows
Options (keyword arguments of collect): steps, config, cams, image_hw, precision,
channels_last, new_tokens.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kestrel_bench.repo import ensure_paths

TARGETS = ("control", "perception", "planner")


def collect(target: str, device: str = "cpu", out: str | Path | None = None,
            **options: Any) -> Path:
    """Profile `target` on `device` and write its chrome trace to `out` (default: a
    temporary file); returns the path."""
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: must be one of {TARGETS}")
    ensure_paths("kestrel_models")
    import torch

    dev = torch.device(device)
    step, warm = {"control": _control, "perception": _perception,
                  "planner": _planner}[target](dev, **options)
    for _ in range(warm):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    steps = int(options.get("steps", {"control": 50, "perception": 5, "planner": 1}[target]))
    with torch.profiler.profile(activities=acts, record_shapes=True, with_flops=True) as prof:
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    path = Path(out) if out else Path(tempfile.mkstemp(prefix=f"kestrel_{target}_",
                                                       suffix=".json")[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    _add_flops(prof, path)
    return path


def _add_flops(prof: Any, path: Path) -> None:
    """Write the profiler's FLOP counts (computed from the shapes, kept on its events but not
    exported) into the trace as args["flops"] of the matching ops: per op name, the i-th event
    in start order of both."""
    import json

    by_name: dict[str, list[tuple[float, int]]] = {}
    for e in prof.events():
        if getattr(e, "flops", 0):
            by_name.setdefault(e.name, []).append((e.time_range.start, int(e.flops)))
    if not by_name:
        return
    doc = json.loads(path.read_text())
    ops: dict[str, list[dict]] = {}
    for e in doc.get("traceEvents", []):
        if e.get("cat") == "cpu_op" and e.get("name") in by_name:
            ops.setdefault(e["name"], []).append(e)
    for name, flops in by_name.items():
        evs = sorted(ops.get(name, []), key=lambda e: e.get("ts", 0))
        if len(evs) != len(flops):
            continue  # no one-to-one match: leave this op without counts
        for e, (_, f) in zip(evs, sorted(flops), strict=True):
            e.setdefault("args", {})["flops"] = f
    path.write_text(json.dumps(doc))


def _control(dev: Any, **_: Any) -> tuple[Callable[[], None], int]:
    import numpy as np
    import torch
    from kestrel_models.control.policy import PolicyConfig, build_policy
    from torch.profiler import record_function

    cfg = PolicyConfig()
    model = build_policy(cfg, seed=0).to(dev).eval()
    h, c = model.initial_state(1, dev)
    obs = np.zeros((1, cfg.obs_dim), np.float32)
    lower, upper = -3.1, 3.1
    state = {"h": h, "c": c}

    @torch.no_grad()
    def step() -> None:
        with record_function("observation"):
            obs[0, 0] += 1e-4
            x = torch.from_numpy(obs).to(dev, non_blocking=True)
        with record_function("policy"):
            a, _, state["h"], state["c"] = model.step(x, state["h"], state["c"])
        with record_function("command"):
            np.clip(0.05 * np.tanh(a.cpu().numpy()), lower, upper)

    return step, 20


def _perception(dev: Any, config: str = "", cams: int = 0, image_hw: tuple[int, int] = (),
                precision: str = "fp32", channels_last: bool = True,
                **_: Any) -> tuple[Callable[[], None], int]:
    import torch
    from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig
    from torch.profiler import record_function

    cuda = dev.type == "cuda"
    config = config or ("r50" if cuda else "tiny")
    cams = cams or (6 if cuda else 1)
    hw = tuple(image_hw) or ((640, 640) if cuda else (128, 128))
    cfg = (PerceptionConfig(backbone_depth=50, base_width=64, fpn_channels=256)
           if config == "r50" else PerceptionConfig.tiny())
    model = MultiTaskPerceptionModel(cfg).eval().to(dev)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    for name, child in model.named_children():
        _label(child, name)
    host = torch.randint(0, 256, (cams, 3, *hw), dtype=torch.uint8)
    if cuda:
        host = host.pin_memory()
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]

    @torch.no_grad()
    def step() -> None:
        with record_function("h2d"):
            images = host.to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            model(images)

    return step, 2


def _label(module: Any, name: str) -> None:
    """Wrap every call of `module` in a record_function range named `name`."""
    from torch.profiler import record_function

    ranges: list = []

    def pre(_m: Any, _inp: Any) -> None:
        r = record_function(name)
        r.__enter__()
        ranges.append(r)

    def post(_m: Any, _inp: Any, _out: Any) -> None:
        ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _planner(dev: Any, config: str = "", new_tokens: int = 0,
             **_: Any) -> tuple[Callable[[], None], int]:
    import torch
    from kestrel_models.planner import VisionLanguageModel, get_config
    from kestrel_models.planner.engine import DecodeEngine
    from torch.profiler import record_function

    cuda = dev.type == "cuda"
    config = config or ("0.5b" if cuda else "tiny")
    new_tokens = new_tokens or (32 if cuda else 8)
    torch.manual_seed(0)
    with torch.device(dev):
        model = VisionLanguageModel(get_config(config))
    model = model.to(torch.bfloat16 if cuda else torch.float32).eval()
    eng = DecodeEngine(model, 1, 1024, eos_id=-1, cuda_graph=False, prefill_graph=False)

    def labelled(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrap(*a: Any, **k: Any) -> Any:
            with record_function(name):
                return fn(*a, **k)
        return wrap

    eng._prefill_body = labelled("prefill", eng._prefill_body)
    eng._body = labelled("decode", eng._body)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (64,), generator=g).tolist()
    image = torch.randint(0, 256, (3, 448, 448), dtype=torch.uint8, generator=g).to(dev)

    def step() -> None:
        eng.submit(prompt, new_tokens, image)
        eng.run()

    return step, 2
