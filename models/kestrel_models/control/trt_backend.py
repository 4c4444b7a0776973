"""`tensorrt` policy backend: an FP16 TensorRT engine built from the step's ONNX, cached on disk.

The step (`actions, *states' = f(obs, *states)`) is exported to ONNX at the loop's fixed batch
(or the user's ONNX file is used as given), and an engine is built from it ONCE: the engine file
is cached under `cache_dir` (default ~/.cache/kestrel/trt) as `policy_<key>.engine`, where the
key hashes the ONNX bytes, the GPU name, the TensorRT version, the precision and the batch, so
any change of model, GPU, TensorRT or shape builds another engine and nothing stale is reused.
The build (seconds to a minute for the reference MLP+LSTM) happens at configure, logged; the
loop never builds.

Per tick: pinned obs -> device (non_blocking on the backend's stream), `execute_async_v3` with
the recurrent states ping-ponging between two preallocated device sets (set k in, set 1-k out:
no copy-back), actions -> pinned host, then a poll of the stream (one host synchronisation).
Inputs and outputs stay float32 (the ONNX interface); with `precision` 'fp16' TensorRT runs
the layers in half precision inside the engine.

Where `tensorrt` or CUDA is absent, construction raises `BackendUnavailable` naming the
parameter; nothing here imports tensorrt at module import time.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kestrel_models.control.runtimes import (BackendUnavailable, PolicyBackend, StepPolicy,
                                             export_onnx)
from kestrel_models.trt import (PRECISIONS, TensorRTUnavailableError, build_engine,
                                tensorrt_version)

__all__ = ["TensorRTBackend", "check_tensorrt", "create_tensorrt_backend", "default_cache_dir",
           "policy_engine_key"]


def default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "kestrel" / "trt")


def policy_engine_key(onnx_bytes: bytes, gpu_name: str, trt_version: str, precision: str,
                      batch: int) -> str:
    """First 24 hex chars of a sha256 over everything an engine depends on."""
    if precision not in PRECISIONS:
        raise ValueError(f"parameter 'precision' = {precision!r}: must be one of {PRECISIONS}")
    h = hashlib.sha256(onnx_bytes)
    h.update(f"|gpu={gpu_name.strip()}|trt={trt_version}|{precision}|batch={int(batch)}".encode())
    return h.hexdigest()[:24]


class TensorRTBackend(PolicyBackend):
    """See the module docstring. `log` receives one line when an engine is built or loaded."""

    name = "tensorrt"
    device = torch.device("cuda")

    def __init__(self, policy: StepPolicy, batch: int, cache_dir: str = "",
                 precision: str = "fp16", log: Callable[[str], None] = print) -> None:
        try:
            version = tensorrt_version()
        except TensorRTUnavailableError as exc:
            raise BackendUnavailable(f"parameter 'backend' = 'tensorrt': {exc} Use 'cuda_graph' "
                                     "(GPU) or 'onnxruntime'.") from None
        if not torch.cuda.is_available():
            raise BackendUnavailable("parameter 'backend' = 'tensorrt': CUDA is not available")
        super().__init__(policy, batch)
        directory = cache_dir or default_cache_dir()
        os.makedirs(directory, exist_ok=True)
        onnx_path = policy.onnx_path or export_onnx(policy, self.batch, directory)
        key = policy_engine_key(Path(onnx_path).read_bytes(), torch.cuda.get_device_name(),
                                version, precision, self.batch)
        path = Path(directory) / f"policy_{key}.engine"
        if path.is_file():
            log(f"tensorrt: using the cached engine {path}")
        else:
            log(f"tensorrt: building a {precision} engine from {onnx_path} (TensorRT {version},"
                f" batch {self.batch}) -> {path}")
            build_engine(onnx_path, path, precision, workspace_gib=1.0)
        import tensorrt as trt  # type: ignore[import-not-found]

        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self._engine is None:
            raise BackendUnavailable(f"parameter 'backend' = 'tensorrt': the engine {path} "
                                     "could not be deserialised (delete it to rebuild)")
        self._ctx = self._engine.create_execution_context()
        n_states = len(policy.state_shapes)
        shapes = [policy.batched_state_shape(i, self.batch) for i in range(n_states)]
        dev = torch.device("cuda")
        self.obs_dev = torch.zeros(self.batch, policy.obs_dim, device=dev)  # [B, D]
        self.act_dev = torch.zeros(self.batch, policy.num_actions, device=dev)  # [B, A]
        self._sets = ([torch.zeros(s, device=dev) for s in shapes],
                      [torch.zeros(s, device=dev) for s in shapes])
        expected = {policy.obs_name: tuple(self.obs_dev.shape),
                    policy.actions_name: tuple(self.act_dev.shape)}
        for i in range(n_states):
            expected[policy.state_in_names[i]] = shapes[i]
            expected[policy.state_out_names[i]] = shapes[i]
        names = {self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)}
        for name, shape in expected.items():
            if name not in names:
                raise ValueError(f"parameter 'model_path' = {policy.source!r}: the engine has "
                                 f"no tensor {name!r} (it has {sorted(names)})")
            got = tuple(self._engine.get_tensor_shape(name))
            if got != shape:
                raise ValueError(f"parameter 'model_path' = {policy.source!r}: engine tensor "
                                 f"{name!r} has shape {got}, the loop needs {shape}")
        # Addresses per ping-pong phase k: inputs from set k, outputs into set 1 - k.
        self._addresses = []
        for k in (0, 1):
            addr = [(policy.obs_name, self.obs_dev.data_ptr()),
                    (policy.actions_name, self.act_dev.data_ptr())]
            for i in range(n_states):
                addr.append((policy.state_in_names[i], self._sets[k][i].data_ptr()))
                addr.append((policy.state_out_names[i], self._sets[1 - k][i].data_ptr()))
            self._addresses.append(tuple(addr))
        self._k = 0
        self._flip = 1 if n_states else 0
        self._stream = torch.cuda.Stream()
        self._handle = self._stream.cuda_stream
        self.engine_path = str(path)

    def step(self) -> None:
        ctx, stream = self._ctx, self._stream
        with torch.cuda.stream(stream):
            self.obs_dev.copy_(self.obs_host, non_blocking=True)  # pinned -> device
            for name, ptr in self._addresses[self._k]:
                ctx.set_tensor_address(name, ptr)
            if not ctx.execute_async_v3(self._handle):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            self.act_host.copy_(self.act_dev, non_blocking=True)  # device -> pinned
        self._k ^= self._flip
        query = stream.query
        while not query():
            pass

    def reset_state(self, index: int | None = None) -> None:
        with torch.no_grad():
            for states in self._sets:
                for i, s in enumerate(states):
                    if index is None:
                        s.zero_()
                    else:
                        s.select(self.policy.state_batch_dims[i], index).zero_()
        torch.cuda.synchronize()


def check_tensorrt() -> None:
    """Configure-time check: BackendUnavailable naming the parameter without TensorRT."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise BackendUnavailable(
            "parameter 'backend' = 'tensorrt': the tensorrt Python package is not installed "
            "here; use 'cuda_graph' (GPU) or 'onnxruntime'") from None


def create_tensorrt_backend(policy: StepPolicy, batch: int, *, cache_dir: str = "",
                            **_: object) -> TensorRTBackend:
    """The registry's factory (registry.py)."""
    return TensorRTBackend(policy, batch, cache_dir)
