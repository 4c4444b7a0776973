"""The `tensorrt` policy backend: cache key semantics and refusals run everywhere; the engine
build, FP16 equivalence with fp32 eager and engine reuse need TensorRT and a GPU (skipped with
that reason: none of this project's machines has TensorRT)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import BackendUnavailable, policy_from_actor_critic
from kestrel_models.control.trt_backend import TensorRTBackend, policy_engine_key
from kestrel_models.trt import build_engine

torch.set_num_threads(1)
CFG = PolicyConfig.tiny(obs_dim=48, num_actions=6)
try:
    import tensorrt  # noqa: F401
    HAVE_TRT = True
except ImportError:
    HAVE_TRT = False


def test_the_cache_key_changes_with_everything_an_engine_depends_on() -> None:
    base = dict(onnx_bytes=b"onnx", gpu_name="NVIDIA H200", trt_version="10.9",
                precision="fp16", batch=1)
    key = policy_engine_key(**base)
    assert len(key) == 24 and key == policy_engine_key(**base)
    for field, value in (("onnx_bytes", b"onnx2"), ("gpu_name", "Orin"),
                         ("trt_version", "10.10"), ("precision", "fp32"), ("batch", 2)):
        assert policy_engine_key(**{**base, field: value}) != key, field
    with pytest.raises(ValueError, match="parameter 'precision' = 'int4'"):
        policy_engine_key(**{**base, "precision": "int4"})
    with pytest.raises(ValueError, match="parameter 'precision' = 'int4'"):
        build_engine("x.onnx", "x.engine", precision="int4")


def test_refused_with_the_reason_where_tensorrt_or_cuda_is_missing(monkeypatch) -> None:
    policy = policy_from_actor_critic(build_policy(CFG))
    if not HAVE_TRT:
        with pytest.raises(BackendUnavailable, match="'tensorrt': TensorRT is not installed"):
            TensorRTBackend(policy, 1)
    if not torch.cuda.is_available():  # a tensorrt module present, no GPU
        monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.0"))
        with pytest.raises(BackendUnavailable, match="'tensorrt': CUDA is not available"):
            TensorRTBackend(policy, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAVE_TRT, reason="needs the tensorrt package")
@pytest.mark.parametrize("batch", [1, 4])
def test_fp16_engine_equals_fp32_eager_and_is_reused(tmp_path, batch: int) -> None:
    model = build_policy(CFG).eval()
    logs: list[str] = []
    backend = TensorRTBackend(policy_from_actor_critic(model), batch, str(tmp_path),
                              log=logs.append)
    assert "building" in logs[-1]
    torch.manual_seed(0)
    h, c = model.initial_state(batch, "cpu")
    for _ in range(20):
        x = torch.randn(batch, CFG.obs_dim)
        with torch.no_grad():
            ref, _, h, c = model.step(x, h, c)
        backend.obs_host.copy_(x)
        backend.step()
        torch.testing.assert_close(backend.act_host, ref, atol=2e-2, rtol=0)  # fp16 layers
    engine = tmp_path / backend.engine_path.split("/")[-1]
    mtime = engine.stat().st_mtime_ns
    again = TensorRTBackend(policy_from_actor_critic(model), batch, str(tmp_path),
                            log=logs.append)
    assert "using the cached engine" in logs[-1] and engine.stat().st_mtime_ns == mtime
    assert again.engine_path == backend.engine_path
