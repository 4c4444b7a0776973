"""Inference backends for the stateful policy step, on static (preallocated) buffers.

A backend runs `actions, *states' = f(obs, *states)` once per control tick:
  obs_host  [B, obs_dim]     float32 CPU tensor (pinned when the backend runs on CUDA), written
                             by the caller before `step()`;
  act_host  [B, num_actions] float32 CPU tensor (pinned on CUDA), valid after `step()` returns;
  the recurrent states stay inside the backend, on its device, between ticks.
`step()` allocates nothing on the Python side (torch's own allocators aside) and makes one
host synchronisation. B is fixed at construction (the runner pads its robots to a power of 2).

The backends a user picks, and when each wins, are listed in `registry.py` (name -> factory,
imported on first use); the factories of the plain torch and ONNX Runtime ones are here.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kestrel_models.control.policy import ActorCritic
from kestrel_models.control.registry import (BACKENDS, CUDA_BACKENDS, POST_BACKENDS,
                                             BackendUnavailable, check_backend, create_backend)

__all__ = ["BACKENDS", "CUDA_BACKENDS", "POST_BACKENDS", "BackendUnavailable", "CudaGraphBackend",
           "OrtBackend", "PolicyBackend", "PostSpec", "StepModule", "StepPolicy", "TorchBackend",
           "check_backend", "create_backend", "export_onnx", "graph_handles",
           "policy_from_actor_critic"]


class StepModule(nn.Module):
    """`ActorCritic.step` with 2-D states and only plain ops: forward(obs [B, D], h [B, H],
    c [B, H]) -> (actions [B, A], h' [B, H], c' [B, H]).

    fused=True: one torch.lstm_cell (fastest in eager); fused=False: the gates written out with
    two Linear layers carrying the LSTM's weights (ONNX-exportable).
    """

    def __init__(self, model: ActorCritic, fused: bool = True) -> None:
        super().__init__()
        self.encoder, self.policy_head = model.encoder, model.policy_head
        self.fused = fused
        lstm = model.lstm
        self.lstm = lstm
        hidden, width = lstm.hidden_size, lstm.input_size
        self.ih = nn.Linear(width, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden)
        with torch.no_grad():
            self.ih.weight.copy_(lstm.weight_ih_l0)
            self.ih.bias.copy_(lstm.bias_ih_l0)
            self.hh.weight.copy_(lstm.weight_hh_l0)
            self.hh.bias.copy_(lstm.bias_hh_l0)
        self.ih.to(lstm.weight_ih_l0.device)
        self.hh.to(lstm.weight_ih_l0.device)

    def forward(self, obs: torch.Tensor, h: torch.Tensor, c: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats = self.encoder(obs)  # [B, E]
        if self.fused:
            lstm = self.lstm
            h2, c2 = torch.lstm_cell(feats, (h, c), lstm.weight_ih_l0, lstm.weight_hh_l0,
                                     lstm.bias_ih_l0, lstm.bias_hh_l0)
        else:
            gates = self.ih(feats) + self.hh(h)  # [B, 4H], gate order i, f, g, o
            i, f, g, o = gates.chunk(4, dim=1)
            c2 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h2 = torch.sigmoid(o) * torch.tanh(c2)
        return self.policy_head(h2), h2, c2


@dataclass
class PostSpec:
    """In-graph command post-processing (POST_BACKENDS): the first `num_joints` observation
    columns are the joint positions (rad) the command is relative to."""

    num_joints: int
    lower: tuple[float, ...]  # [n] rad
    upper: tuple[float, ...]  # [n] rad
    action_scale: float  # rad per unit tanh(action)


@dataclass
class StepPolicy:
    """What a backend runs: `module(obs, *states) -> (actions, *states')` (or an ONNX file).

    obs_dim, num_actions: sizes of obs [B, obs_dim] and actions [B, num_actions].
    state_shapes: per recurrent state, its shape for batch 1 with the batch axis at
    `state_batch_dims[i]` (e.g. (1, H) at 0; Isaac Lab's (layers, 1, H) at 1).
    onnx_path: an ONNX file of the same step (used by 'onnxruntime'; exported from `module`
    when empty). io_names: ONNX names (obs, actions, state inputs, state outputs).
    """

    obs_dim: int
    num_actions: int
    module: nn.Module | None = None
    fused_module: nn.Module | None = None  # faster eager variant of `module`, if any
    state_shapes: tuple[tuple[int, ...], ...] = ()
    state_batch_dims: tuple[int, ...] = ()
    onnx_path: str = ""
    obs_name: str = "obs"
    actions_name: str = "actions"
    state_in_names: tuple[str, ...] = ()
    state_out_names: tuple[str, ...] = ()
    source: str = "kestrel ActorCritic"
    extra: dict = field(default_factory=dict)

    def batched_state_shape(self, i: int, batch: int) -> tuple[int, ...]:
        shape = list(self.state_shapes[i])
        shape[self.state_batch_dims[i]] = batch
        return tuple(shape)


def policy_from_actor_critic(model: ActorCritic) -> StepPolicy:
    """The reference policy as a StepPolicy (states h, c: [B, lstm_hidden], batch axis 0)."""
    cfg = model.config
    return StepPolicy(
        obs_dim=cfg.obs_dim, num_actions=cfg.num_actions,
        module=StepModule(model, fused=False).eval(),
        fused_module=StepModule(model, fused=True).eval(),
        state_shapes=((1, cfg.lstm_hidden), (1, cfg.lstm_hidden)), state_batch_dims=(0, 0),
        state_in_names=("h_in", "c_in"), state_out_names=("h_out", "c_out"))


class PolicyBackend:
    """Base: static host buffers + `step()`; subclasses fill in `_run`."""

    name = "base"
    device = torch.device("cpu")

    def __init__(self, policy: StepPolicy, batch: int) -> None:
        if batch < 1:
            raise ValueError(f"parameter 'batch' = {batch!r}: must be >= 1")
        self.policy, self.batch = policy, int(batch)
        pin = self.device.type == "cuda"
        self.obs_host = torch.zeros(self.batch, policy.obs_dim, pin_memory=pin)  # [B, D]
        self.act_host = torch.zeros(self.batch, policy.num_actions, pin_memory=pin)  # [B, A]
        self.obs_np = self.obs_host.numpy()  # views sharing the memory
        self.act_np = self.act_host.numpy()

    def step(self) -> None:
        """obs_host -> act_host; advances the recurrent state."""
        raise NotImplementedError

    def reset_state(self, index: int | None = None) -> None:
        """Zero the recurrent state of batch row `index` (None: all rows)."""
        raise NotImplementedError

    def warmup(self, steps: int = 10) -> None:
        for _ in range(steps):
            self.step()
        self.reset_state()

    def close(self) -> None:
        """Release what the backend holds beyond memory (cuda_persistent: its resident kernel)."""


class TorchBackend(PolicyBackend):
    """Eager torch module on CPU or CUDA (states kept on the device)."""

    def __init__(self, name: str, policy: StepPolicy, batch: int, device: str = "cpu") -> None:
        self.name, self.device = name, torch.device(device)
        super().__init__(policy, batch)
        if policy.module is None:
            raise BackendUnavailable(f"parameter 'backend' = {name!r}: needs a torch model "
                                     f"(got {policy.source}); use 'onnxruntime' for ONNX files")
        if batch > policy.extra.get("max_batch", batch):
            raise ValueError(f"parameter 'robots': {batch} robots in one batch, and the policy "
                             f"({policy.source}) keeps the recurrent state of one robot in its "
                             "own buffers (rsl_rl's policy.pt); run one robot per node, or "
                             "export the state as inputs/outputs (policy.onnx: h_in, c_in)")
        self.fn = policy.fused_module if policy.fused_module is not None else policy.module
        with torch.no_grad():
            self.obs_dev = self.obs_host if self.device.type == "cpu" \
                else torch.zeros_like(self.obs_host, device=self.device)
            self.states = [torch.zeros(policy.batched_state_shape(i, batch), device=self.device)
                           for i in range(len(policy.state_shapes))]

    def _forward(self) -> torch.Tensor:
        out = self.fn(self.obs_dev, *self.states)
        if isinstance(out, torch.Tensor):
            return out
        for state, new in zip(self.states, out[1:], strict=True):
            state.copy_(new)
        return out[0]

    def step(self) -> None:
        with torch.no_grad():
            if self.obs_dev is not self.obs_host:
                self.obs_dev.copy_(self.obs_host, non_blocking=True)
            self.act_host.copy_(self._forward())  # CUDA: device -> pinned host, synchronises

    def reset_state(self, index: int | None = None) -> None:
        with torch.no_grad():
            for i, state in enumerate(self.states):
                if index is None:
                    state.zero_()
                else:
                    state.select(self.policy.state_batch_dims[i], index).zero_()
            reset = self.policy.extra.get("reset")
            if reset is not None:  # the file's own state (one robot: index is 0 or None)
                reset()


class CudaGraphBackend(TorchBackend):
    """The whole tick captured once: H2D copy, step, state copy-back, D2H copy; replay + sync.

    sync='poll' waits for the stream by polling `Stream.query()` (keeps the GIL: another Python
    thread cannot take it in the middle of the tick for up to the switch interval);
    sync='block' uses `Stream.synchronize()` (releases the GIL while waiting).
    """

    def __init__(self, policy: StepPolicy, batch: int, sync: str = "poll",
                 name: str = "cuda_graph") -> None:
        if sync not in ("poll", "block"):
            raise ValueError(f"parameter 'sync' = {sync!r}: must be 'poll' or 'block'")
        self.sync = sync
        super().__init__(name, policy, batch, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):  # warm-up outside capture (cuBLAS handles, workspaces, compile)
                self._tick_ops()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad():
            self._tick_ops()
        self._stream = torch.cuda.current_stream()
        self.reset_state()
        torch.cuda.synchronize()

    def _tick_ops(self) -> None:
        """What the graph holds: H2D obs, the step, the D2H copy of the actions."""
        self.obs_dev.copy_(self.obs_host, non_blocking=True)  # pinned -> device
        self.act_host.copy_(self._forward(), non_blocking=True)  # device -> pinned

    def step(self) -> None:
        self.graph.replay()
        if self.sync == "poll":
            query = self._stream.query
            while not query():
                pass
        else:
            self._stream.synchronize()

    def graph_handles(self) -> tuple[int, int] | None:
        """(cudaGraphExec_t, cudaStream_t) for the loop process's C tick, which launches the
        graph and polls the stream itself (native_tick.c), as step() does with sync='poll'.
        So a user's TorchScript policy gets the same C launch as cuda_graph_triton."""
        return graph_handles(self.graph, self._stream) if self.sync == "poll" else None

    def finish_late(self) -> None:
        """The C tick launched the graph and stopped polling: wait here (raises the CUDA
        error if the graph failed)."""
        query = self._stream.query
        while not query():
            pass


def graph_handles(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream
                  ) -> tuple[int, int] | None:
    """(cudaGraphExec_t, cudaStream_t) of a captured graph as integers, or None when this torch
    cannot give the executable or the graph is replayed on another stream than the default.

    The C tick holds the executable for the process's life: nothing may reset() or
    re-instantiate the graph. Only on the default stream, which replay() in the loop thread
    and reset_state() use too (a backend built under another stream: Python replays)."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None or stream != torch.cuda.default_stream():
        return None
    return int(raw()), int(stream.cuda_stream)


class OrtBackend(PolicyBackend):
    """ONNX Runtime (CPU EP, 1 thread) with I/O binding on preallocated numpy arrays."""

    name = "onnxruntime"

    def __init__(self, policy: StepPolicy, batch: int, cache_dir: str = "") -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise BackendUnavailable("parameter 'backend' = 'onnxruntime': the onnxruntime "
                                     f"package is not installed ({exc})") from exc
        fixed = policy.extra.get("fixed_batch", -1)
        if policy.onnx_path and fixed > 0 and fixed != batch:
            raise BackendUnavailable(f"parameter 'model_path' = {policy.onnx_path!r}: the ONNX "
                                     f"model has a fixed batch {fixed}, the loop needs {batch}")
        super().__init__(policy, batch)
        path = policy.onnx_path or export_onnx(policy, batch, cache_dir)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        n = len(policy.state_shapes)
        shapes = [policy.batched_state_shape(i, batch) for i in range(n)]
        self._sets = ([np.zeros(s, np.float32) for s in shapes],
                      [np.zeros(s, np.float32) for s in shapes])
        self._bindings = []
        for k in (0, 1):  # binding k reads set k, writes set 1-k
            b = self.session.io_binding()
            b.bind_cpu_input(policy.obs_name, self.obs_np)
            b.bind_output(policy.actions_name, "cpu", 0, np.float32, self.act_np.shape,
                          self.act_np.ctypes.data)
            for i in range(n):
                src, dst = self._sets[k][i], self._sets[1 - k][i]
                b.bind_cpu_input(policy.state_in_names[i], src)
                b.bind_output(policy.state_out_names[i], "cpu", 0, np.float32, dst.shape,
                              dst.ctypes.data)
            self._bindings.append(b)
        self._k = 0
        self._run = self.session.run_with_iobinding

    def step(self) -> None:
        self._run(self._bindings[self._k])
        if self.policy.state_shapes:
            self._k ^= 1

    def reset_state(self, index: int | None = None) -> None:
        for states in self._sets:
            for i, s in enumerate(states):
                if index is None:
                    s.fill(0.0)
                else:
                    np.moveaxis(s, self.policy.state_batch_dims[i], 0)[index] = 0.0


def export_onnx(policy: StepPolicy, batch: int, cache_dir: str = "") -> str:
    """Export `policy.module` (the step, states as extra I/O) to ONNX at a fixed batch."""
    if policy.module is None:
        raise BackendUnavailable("no torch module to export to ONNX")
    if "reset" in policy.extra:  # an ONNX graph would freeze the buffers as constants
        raise BackendUnavailable(
            f"parameter 'backend': {policy.source} keeps its recurrent state in its own buffers "
            "(rsl_rl's policy.pt), which an ONNX export would freeze; give the ONNX file "
            "(policy.onnx, state as h_in/c_in) as model_path, or use a torch backend")
    directory = cache_dir or tempfile.mkdtemp(prefix="kestrel_policy_")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"policy_step_b{batch}.onnx")
    obs = torch.zeros(batch, policy.obs_dim)
    states = tuple(torch.zeros(policy.batched_state_shape(i, batch))
                   for i in range(len(policy.state_shapes)))
    import warnings
    module = policy.module
    # a user's TorchScript file (external._Scripted wraps it): the exporter takes the script
    # module itself, not a Python module that calls it
    inner = getattr(module, "inner", None)
    if isinstance(inner, torch.jit.ScriptModule):
        module = inner
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice
            torch.onnx.export(module, (obs, *states), path, dynamo=False,
                              input_names=[policy.obs_name, *policy.state_in_names],
                              output_names=[policy.actions_name, *policy.state_out_names])
    except Exception as exc:  # noqa: BLE001 - a configuration error, named
        raise BackendUnavailable(
            f"parameter 'backend' = 'onnxruntime': exporting {policy.source} to ONNX failed "
            f"({type(exc).__name__}: {exc}); give the ONNX file itself as model_path (Isaac "
            "Lab exports policy.onnx beside policy.pt)") from exc
    return path


def check_onnxruntime() -> None:
    """BackendUnavailable naming the parameter when the onnxruntime package is missing."""
    try:
        import onnxruntime  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable("parameter 'backend' = 'onnxruntime': the onnxruntime "
                                 f"package is not installed ({exc})") from None


# ---- factories of the registry (registry.py): f(policy, batch, **options) -> PolicyBackend ----
def make_cpu_eager(policy: StepPolicy, batch: int, **_: object) -> PolicyBackend:
    return TorchBackend("cpu_eager", policy, batch)


def make_onnxruntime(policy: StepPolicy, batch: int, *, cache_dir: str = "",
                     **_: object) -> PolicyBackend:
    return OrtBackend(policy, batch, cache_dir)


def _to_cuda(policy: StepPolicy) -> None:
    policy.module.cuda()
    if policy.fused_module is not None:
        policy.fused_module.cuda()


def make_cuda_eager(policy: StepPolicy, batch: int, **_: object) -> PolicyBackend:
    _to_cuda(policy)
    return TorchBackend("cuda_eager", policy, batch, device="cuda")


def make_cuda_graph(policy: StepPolicy, batch: int, **_: object) -> PolicyBackend:
    _to_cuda(policy)
    return CudaGraphBackend(policy, batch)
