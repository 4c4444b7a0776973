"""Policy backends: each one equals fp32 eager `ActorCritic.step` on random inputs (stated
tolerances), per-row state reset, configure-time refusals, no allocation per step."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from policy_reference import eager_rollout

from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import (BACKENDS, BackendUnavailable, PostSpec,
                                             check_backend, create_backend,
                                             policy_from_actor_critic)

torch.set_num_threads(1)
CFG = PolicyConfig.tiny(obs_dim=48, num_actions=6)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Max abs difference of actions vs fp32 eager: rounding only (different op order / fused kernels;
# TF32 is off by default for matmuls).
TOLERANCE = {"cpu_eager": 1e-6, "onnxruntime": 1e-5, "cuda_eager": 1e-4, "cuda_graph": 1e-4,
             "cuda_graph_triton": 1e-4, "cuda_persistent": 1e-4}
CPU_BACKENDS = ["cpu_eager", "onnxruntime"]
CUDA_BACKENDS = ["cuda_eager", "cuda_graph", "cuda_graph_triton", "cuda_persistent"]
PARAMS = [pytest.param(b, id=b) for b in CPU_BACKENDS] + [
    pytest.param(b, id=b, marks=[pytest.mark.gpu, GPU]) for b in CUDA_BACKENDS]


@pytest.mark.parametrize("name", PARAMS)
def test_backend_matches_fp32_eager(name: str, tmp_path) -> None:
    model = build_policy(CFG, seed=4)
    ref_model = build_policy(CFG, seed=4)  # CPU copy (CUDA backends move `model`)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, CFG.obs_dim, generator=gen) for _ in range(6)]
    expected, _ = eager_rollout(ref_model, inputs)
    backend = create_backend(name, policy_from_actor_critic(model), batch=4,
                             cache_dir=str(tmp_path))
    assert backend.obs_host.shape == (4, CFG.obs_dim) and backend.act_host.shape == (4, 6)
    assert backend.obs_host.is_pinned() == name.startswith("cuda")
    for x, want in zip(inputs, expected, strict=True):
        backend.obs_host.copy_(x)
        backend.step()
        err = (backend.act_host - want).abs().max().item()
        assert err <= TOLERANCE[name], f"{name}: max |diff| {err:.2e}"
    assert expected[-1].abs().max() > 0.05  # the comparison is not between near-zeros
    backend.close()


@pytest.mark.parametrize("name", ["cpu_eager", "onnxruntime"] + [pytest.param(
    b, marks=[pytest.mark.gpu, GPU]) for b in ("cuda_graph_triton", "cuda_persistent")])
def test_reset_one_row_keeps_the_others(name: str, tmp_path) -> None:
    model = build_policy(CFG, seed=2)
    backend = create_backend(name, policy_from_actor_critic(model), batch=2,
                             cache_dir=str(tmp_path))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(2, CFG.obs_dim, generator=gen) for _ in range(4)]
    for x in xs[:3]:
        backend.obs_host.copy_(x)
        backend.step()
    backend.reset_state(1)
    backend.obs_host.copy_(xs[3])
    backend.step()
    row0 = eager_rollout(model, [x[:1] for x in xs])[0][-1]  # never reset
    row1 = eager_rollout(model, [xs[3][1:]])[0][-1]  # from the zero state
    tol = max(1e-5, TOLERANCE[name])
    torch.testing.assert_close(backend.act_host[:1], row0, atol=tol, rtol=0)
    torch.testing.assert_close(backend.act_host[1:], row1, atol=tol, rtol=0)
    backend.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cpu_eager", "onnxruntime"])
def test_step_does_not_allocate(name: str, tmp_path) -> None:
    backend = create_backend(name, policy_from_actor_critic(build_policy(CFG)), batch=1,
                             cache_dir=str(tmp_path))
    for _ in range(50):
        backend.step()
    tracemalloc.start()
    try:
        for _ in range(200):  # one-time wrapper caches first seen under tracing settle here
            backend.step()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            backend.step()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 2048, f"{after - before} bytes retained over 2000 steps"


def test_unknown_and_unavailable_backends_name_the_parameter() -> None:
    for name in ("tpu", "cpu_int8", "cuda_compile"):  # not backends
        with pytest.raises(ValueError, match=rf"parameter 'backend' = '{name}': must be one of "
                                             "auto, cpu_eager, onnxruntime, .*cuda_persistent"):
            check_backend(name)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        if torch.cuda.is_available():
            with pytest.raises(BackendUnavailable, match="'tensorrt': the tensorrt Python "
                                                         "package is not installed"):
                check_backend("tensorrt")
    if not torch.cuda.is_available():
        for name in CUDA_BACKENDS + ["tensorrt"]:
            with pytest.raises(BackendUnavailable, match=f"'{name}': CUDA is not available"):
                check_backend(name)
    assert set(CPU_BACKENDS + CUDA_BACKENDS + ["tensorrt"]) == set(BACKENDS)


def test_reference_sizes_on_onnxruntime(tmp_path) -> None:
    model = build_policy(PolicyConfig(), seed=0)  # obs 256 -> 512 -> 256, LSTM 256, 12 actions
    backend = create_backend("onnxruntime", policy_from_actor_critic(model), batch=1,
                             cache_dir=str(tmp_path))
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3))
    backend.obs_host.copy_(x)
    backend.step()
    torch.testing.assert_close(backend.act_host, eager_rollout(model, [x])[0][0], atol=1e-5,
                               rtol=0)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("name", ["cuda_graph_triton", "cuda_persistent"])
def test_in_graph_post_processing_matches_the_host_formula(name: str) -> None:
    """cuda_graph_triton / cuda_persistent with a PostSpec: command =
    clamp(q + scale * tanh(a[:n])) and the finite / clamped flags, per row, as computed on the
    host from the same step's outputs."""
    n, scale = 4, 0.5
    lower, upper = (-1.0, -1.0, -1.0, -0.05), (1.0, 1.0, 1.0, 0.05)
    backend = create_backend(name, policy_from_actor_critic(build_policy(CFG)),
                             batch=4, post=PostSpec(n, lower, upper, scale))
    gen = torch.Generator().manual_seed(5)
    for k in range(5):
        x = torch.randn(4, CFG.obs_dim, generator=gen) * 0.5
        if k == 3:
            x[2, 7] = float("nan")  # row 2: non-finite actions
        backend.obs_host.copy_(x)
        backend.step()
        act = torch.from_numpy(backend.act_np.copy())
        raw = x[:, :n] + scale * torch.tanh(act[:, :n])
        want = torch.clamp(raw, torch.tensor(lower), torch.tensor(upper))
        post = torch.from_numpy(backend.post_np.copy())
        finite = torch.isfinite(act).all(dim=1)
        assert torch.equal(post[:, n] != 0, finite)
        ok = finite.nonzero().flatten()
        torch.testing.assert_close(post[ok, :n], want[ok], atol=1e-6, rtol=0)
        assert torch.equal(post[ok, n + 1] != 0, (want[ok] != raw[ok]).any(dim=1))
        if k == 3:
            assert not bool(finite[2]) and bool(finite[0])
    assert (backend.post_np[:, n + 1] != 0).any()  # the clamp was exercised
    backend.close()
