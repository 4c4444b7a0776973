"""Users' policies: TorchScript / ONNX files (Isaac Lab export style) or state dict + config.

Isaac Lab exports `policy.pt` (TorchScript) and `policy.onnx`: input `obs` [B, obs_dim], output
`actions` [B, num_actions]; a recurrent policy adds its state as extra inputs/outputs
(`h_in`, `c_in` -> `h_out`, `c_out`, each [layers, B, H]). The file, the I/O names and the dims
are parameters (`ModelSpec`); `load_policy` checks them against the file and returns a
`StepPolicy` that the backends of `runtimes` run. Every mismatch raises ValueError naming the
parameter and the value, at configure time.

TorchScript contract: `module(obs, *state_in) -> actions` (no state) or
`(actions, *state_out)` (state names given). Its dims are found by one probe call on seeded
random values (zeros might leave a state unchanged), which also finds the state below.

A recurrent policy.pt from Isaac Lab's rsl_rl exporter keeps its state INSIDE the module: buffers
hidden_state / cell_state [layers, 1, H] that forward writes. (Its `reset()` cannot be relied on:
the exporter binds it per instance, which scripting drops; the feed-forward export has a no-op
`reset()`.) So a file is taken as internally stateful when a probe call changes one of its
buffers, or when it has buffers of those names; the backends then restore those buffers to
their values at load time (zeros), in place: after warm-up, at activation and after a
non-finite action, which would otherwise poison the state for good. Such buffers hold one robot,
so the file refuses a batch of more than one, and an ONNX export of it (which would freeze
them as constants).
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import StepPolicy, policy_from_actor_critic

FORMATS = ("auto", "torchscript", "onnx", "state_dict")


@dataclass
class ModelSpec:
    """Where the policy comes from. path '' = the reference ActorCritic (seeded or `weights`)."""

    path: str = ""  # policy.pt / policy.onnx / a state_dict file
    format: str = "auto"  # one of FORMATS; auto: by extension (.onnx, else TorchScript/state)
    obs_name: str = "obs"
    actions_name: str = "actions"
    state_in_names: tuple[str, ...] = ()  # e.g. ("h_in", "c_in"); () = not recurrent
    state_out_names: tuple[str, ...] = ()  # e.g. ("h_out", "c_out")
    state_shapes: tuple[tuple[int, ...], ...] = ()  # batch-1 shapes; () = from the file
    obs_dim: int = 0  # expected obs size; 0 = take it from the file
    num_actions: int = 0  # expected action count; 0 = take it from the file
    config: PolicyConfig = field(default_factory=PolicyConfig)  # for state dicts / no path
    seed: int = 0
    path_param: str = "model_path"  # the parameter that named `path` (errors name it)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"parameter 'model_format' = {self.format!r}: must be one of "
                             f"{FORMATS}")
        self.state_in_names = tuple(self.state_in_names)
        self.state_out_names = tuple(self.state_out_names)
        if len(self.state_in_names) != len(self.state_out_names):
            raise ValueError(f"parameter 'model_state_outputs' = {list(self.state_out_names)}: "
                             f"needs one name per state input {list(self.state_in_names)}")


def _err(param: str, value: object, reason: str) -> ValueError:
    return ValueError(f"parameter '{param}' = {value!r}: {reason}")


def _batch_dim(shape: tuple[int, ...]) -> int:
    return 1 if len(shape) == 3 else 0  # Isaac Lab: [layers, B, H]; else [B, H]


class _Scripted(nn.Module):
    """Wraps a TorchScript policy so the output is always a tuple (actions, *states)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, obs: torch.Tensor, *states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.inner(obs, *states)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)

    def track_state(self, names: list[str], initial: list[torch.Tensor]) -> None:
        """Buffers `names` of the file hold a recurrent state; `initial`: their load-time
        values (CPU)."""
        self._state_names, self._state_initial = list(names), list(initial)

    def reset_internal(self) -> None:
        """Restore the file's own recurrent state buffers in place: the tensors a captured
        CUDA graph reads keep their addresses (looked up now: .cuda() replaced the objects)."""
        buffers = dict(self.inner.named_buffers())
        with torch.no_grad():
            for name, value in zip(self._state_names, self._state_initial, strict=True):
                buffers[name].copy_(value)


STATE_BUFFER_NAMES = ("hidden_state", "cell_state")  # rsl_rl's recurrent export


def _internal_state(module: nn.Module, before: dict[str, torch.Tensor]
                    ) -> tuple[list[str], list[torch.Tensor]]:
    """(names, load-time values) of the buffers that the probe call changed (against `before`,
    taken at load) or that are named as rsl_rl's recurrent state; those buffers are restored
    to their load-time values."""
    buffers = dict(module.named_buffers())
    names = [name for name, b in buffers.items()
             if name.rsplit(".", 1)[-1] in STATE_BUFFER_NAMES or not torch.equal(b, before[name])]
    with torch.no_grad():
        for name in names:
            buffers[name].copy_(before[name])
    return names, [before[name] for name in names]


def _load_failure(path: str, exc: BaseException) -> str:
    """Why `path` could not be loaded, in one line: the file's problem, never torch's advice
    (which suggests weights_only=False: loading arbitrary pickled code is not an option)."""
    try:
        if os.path.getsize(path) == 0:
            return "the file is empty"
    except OSError as err:
        return f"cannot read it ({err.strerror})"
    text = str(exc)
    what = "not a TorchScript file nor a state_dict saved by torch.save"
    if "weights_only" in text or "Weights only load failed" in text:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            return (f"it holds Python objects besides tensors ({found.group(1)}), which are "
                    "not loaded (only tensors are: loading pickled code could run it); save "
                    "the model's state_dict() with torch.save, or export TorchScript "
                    "(torch.jit.script / the Isaac Lab exporter)")
        detail = text.partition("WeightsUnpickler error:")[2].partition("Check the doc")[0]
        detail = " ".join(detail.split())
        return f"{what} (unreadable pickle{': ' + detail if detail else ''})"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{what} ({lines[0] if lines else type(exc).__name__})"


# the file's first op against obs [1, obs_dim]: (given size, the file's size) as groups 1, 2.
# A Linear layer ("(1 x given) and (in x out)"), an elementwise op such as rsl_rl's observation
# normaliser ("tensor a (given) ... tensor b (the file's)").
_SIZE_ERRORS = (
    re.compile(r"mat1 and mat2 shapes cannot be multiplied \(\d+x(\d+) and (\d+)x\d+\)"),
    re.compile(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)"),
)


def _probe_failure(spec: ModelSpec, exc: BaseException) -> ValueError:
    """A TorchScript probe call failed: the sizes when they are the cause (obs_dim against
    the file's input, as for ONNX files), else the last line of the error."""
    text = str(exc)
    for pattern in _SIZE_ERRORS:
        m = pattern.search(text)
        if m is not None and int(m.group(1)) == spec.obs_dim != int(m.group(2)):
            return _err("obs_dim", spec.obs_dim,
                        f"the model {spec.path!r} takes {int(m.group(2))} values")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return _err(spec.path_param, spec.path,
                f"a probe call with obs [1, {spec.obs_dim}] failed: "
                f"{lines[-1] if lines else type(exc).__name__}")


def _check_dims(spec: ModelSpec, obs_dim: int, num_actions: int) -> None:
    if spec.obs_dim and obs_dim != spec.obs_dim:
        raise _err("obs_dim", spec.obs_dim, f"the model {spec.path!r} takes {obs_dim} values")
    if spec.num_actions and num_actions != spec.num_actions:
        raise _err("num_actions", spec.num_actions,
                   f"the model {spec.path!r} outputs {num_actions} actions")


def _jit_load(path: str) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit deprecation notice
        return torch.jit.load(path, map_location="cpu")


def _load_torchscript(spec: ModelSpec) -> StepPolicy:
    try:
        module = _jit_load(spec.path).eval()
    except Exception as exc:  # noqa: BLE001 - configuration error
        raise _err(spec.path_param, spec.path,
                   f"cannot load as TorchScript: {_load_failure(spec.path, exc)}") from None
    if not spec.obs_dim:
        raise _err("obs_dim", spec.obs_dim, "must be given for a TorchScript model (> 0)")
    shapes = tuple(tuple(s) for s in spec.state_shapes)
    if len(shapes) != len(spec.state_in_names):
        raise _err("model_state_shapes", [list(s) for s in shapes],
                   f"needs one shape per state input {list(spec.state_in_names)}")
    wrapped = _Scripted(module).eval()
    loaded = {name: b.detach().clone() for name, b in module.named_buffers()}  # before any call
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            out = wrapped(torch.randn(1, spec.obs_dim, generator=g),
                          *(torch.randn(s, generator=g) for s in shapes))
    except Exception as exc:  # noqa: BLE001
        raise _probe_failure(spec, exc) from None
    if len(out) != 1 + len(shapes) or out[0].dim() != 2 or out[0].shape[0] != 1:
        raise _err("model_path", spec.path, f"returned {len(out)} outputs (first shape "
                   f"{tuple(out[0].shape)}); expected actions [1, A] + {len(shapes)} states")
    num_actions = int(out[0].shape[1])
    _check_dims(spec, spec.obs_dim, num_actions)
    # the buffers the probe wrote: the file's own recurrent state (restored to load time)
    names, initial = _internal_state(module, loaded)
    extra = {}
    if names:
        wrapped.track_state(names, initial)
        extra = {"reset": wrapped.reset_internal, "max_batch": 1, "state_buffers": names}
    return StepPolicy(
        obs_dim=spec.obs_dim, num_actions=num_actions, module=wrapped, state_shapes=shapes,
        state_batch_dims=tuple(_batch_dim(s) for s in shapes), obs_name=spec.obs_name,
        actions_name=spec.actions_name, state_in_names=spec.state_in_names,
        state_out_names=spec.state_out_names, source=f"TorchScript {spec.path}", extra=extra)


def _load_onnx(spec: ModelSpec) -> StepPolicy:
    import onnx

    try:
        model = onnx.load(spec.path)
    except Exception as exc:  # noqa: BLE001
        raise _err("model_path", spec.path, f"cannot load as ONNX: {exc}") from exc
    init = {i.name for i in model.graph.initializer}

    def dims(value_info) -> tuple:
        return tuple(d.dim_value if d.HasField("dim_value") else -1
                     for d in value_info.type.tensor_type.shape.dim)

    inputs = {i.name: dims(i) for i in model.graph.input if i.name not in init}
    outputs = {o.name: dims(o) for o in model.graph.output}
    for param, names, table, kind in (
            ("model_input", [spec.obs_name], inputs, "inputs"),
            ("model_output", [spec.actions_name], outputs, "outputs"),
            ("model_state_inputs", list(spec.state_in_names), inputs, "inputs"),
            ("model_state_outputs", list(spec.state_out_names), outputs, "outputs")):
        missing = [n for n in names if n not in table]
        if missing:
            raise _err(param, names if len(names) > 1 else names[0],
                       f"not among the model's {kind} {sorted(table)} ({spec.path})")
    extra = sorted(set(inputs) - {spec.obs_name, *spec.state_in_names})
    if extra:
        raise _err("model_state_inputs", list(spec.state_in_names),
                   f"the model has further inputs {extra} ({spec.path})")
    obs_shape, act_shape = inputs[spec.obs_name], outputs[spec.actions_name]
    obs_dim = obs_shape[-1] if obs_shape and obs_shape[-1] > 0 else spec.obs_dim
    num_actions = act_shape[-1] if act_shape and act_shape[-1] > 0 else spec.num_actions
    if obs_dim <= 0 or num_actions <= 0:
        raise _err("obs_dim", spec.obs_dim, f"the model's sizes are dynamic ({obs_shape} -> "
                   f"{act_shape}): give obs_dim and num_actions")
    _check_dims(spec, obs_dim, num_actions)
    shapes = tuple(tuple(s) for s in spec.state_shapes) or tuple(
        tuple(1 if d <= 0 else d for d in inputs[n]) for n in spec.state_in_names)
    batch_dims = tuple(_batch_dim(s) for s in shapes)
    for name, s in zip(spec.state_in_names, shapes, strict=True):
        if any(d <= 0 for d in s):
            raise _err("model_state_shapes", [list(x) for x in shapes], f"bad shape for {name}")
    return StepPolicy(
        obs_dim=obs_dim, num_actions=num_actions, onnx_path=spec.path, state_shapes=shapes,
        state_batch_dims=batch_dims, obs_name=spec.obs_name, actions_name=spec.actions_name,
        state_in_names=spec.state_in_names, state_out_names=spec.state_out_names,
        source=f"ONNX {spec.path}", extra={"fixed_batch": obs_shape[0] if obs_shape else -1})


def _load_state_dict(spec: ModelSpec) -> StepPolicy:
    try:
        state = torch.load(spec.path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise _err(spec.path_param, spec.path, _load_failure(spec.path, exc)) from None
    if not isinstance(state, dict):
        raise _err(spec.path_param, spec.path, f"holds a {type(state).__name__}, not a "
                   "state_dict")
    try:
        model = build_policy(spec.config, seed=spec.seed, state_dict=state)
    except RuntimeError as exc:
        raise _err(spec.path_param, spec.path,
                   f"does not match the policy dims: {exc}") from exc
    policy = policy_from_actor_critic(model)
    policy.extra["model"] = model
    return policy


def load_policy(spec: ModelSpec) -> StepPolicy:
    """The StepPolicy described by `spec` (see the module docstring); ValueError when invalid."""
    if not spec.path:
        model = build_policy(spec.config, seed=spec.seed)
        policy = policy_from_actor_critic(model)
        policy.extra["model"] = model
        return policy
    if not os.path.isfile(spec.path):
        raise _err(spec.path_param, spec.path, "no such file")
    fmt = spec.format
    if fmt == "auto":
        if spec.path.endswith(".onnx"):
            fmt = "onnx"
        else:
            try:
                _jit_load(spec.path)
                fmt = "torchscript"
            except Exception:  # noqa: BLE001 - not TorchScript: a state dict
                fmt = "state_dict"
    if fmt == "onnx":
        return _load_onnx(spec)
    if fmt == "torchscript":
        return _load_torchscript(spec)
    return _load_state_dict(spec)
