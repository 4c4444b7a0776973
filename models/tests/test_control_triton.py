"""cuda_graph_triton (triton_step.py): refusals on machines without triton/CUDA (CPU), and on
a GPU the fused Triton step equals fp32 eager over many recurrent steps at the reference sizes,
keeps NaN rows to themselves, and resets one row's state."""

from __future__ import annotations

import pytest
import torch
from policy_reference import eager_rollout
from torch import nn

from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import (BackendUnavailable, PostSpec, StepPolicy,
                                             check_backend, create_backend,
                                             policy_from_actor_critic)
from kestrel_models.control.triton_step import _lower, _rows_per_program, check_triton

torch.set_num_threads(1)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_unavailable_here_names_the_backend_and_the_reason() -> None:
    try:
        check_backend("cuda_graph_triton")
        check_triton()
    except BackendUnavailable as exc:  # CI: no CUDA (or no triton)
        msg = str(exc)
        assert "parameter 'backend' = 'cuda_graph_triton'" in msg
        assert "CUDA is not available" in msg or "triton package is not usable" in msg
    else:
        assert torch.cuda.is_available()


def test_only_the_kestrel_step_module_is_lowered() -> None:
    policy = StepPolicy(obs_dim=4, num_actions=2, module=nn.Linear(4, 2), source="TorchScript x")
    with pytest.raises(BackendUnavailable, match="'cuda_graph_triton': needs the kestrel "
                                                 r"ActorCritic step \(TorchScript x\)"):
        _lower(policy)
    step = policy_from_actor_critic(build_policy(PolicyConfig.tiny()))
    step.fused_module.encoder[2] = nn.ReLU()  # not the ELU the kernels compute
    with pytest.raises(BackendUnavailable, match="Linear/LayerNorm/ELU"):
        _lower(step)


def test_programs_spread_rows_and_bound_the_tile() -> None:
    assert _rows_per_program(512, 256) == 4  # 128 programs of 4 x 256 floats
    assert _rows_per_program(256, 512) == 2
    assert _rows_per_program(256, 256, gates=8) == 2  # LSTM: 8 gate tiles per unit block
    assert _rows_per_program(32, 64) == 1
    assert _rows_per_program(100_000, 4096) == 2  # tile bound: 2 x 4096 floats


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_reference_sizes_over_many_recurrent_steps(batch: int) -> None:
    model = build_policy(PolicyConfig(), seed=1)  # 256 -> 512 -> 256, LSTM 256, 12 actions
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(batch, 256, generator=gen) * (1.0 + 2.0 * (k % 7 == 0))
          for k in range(200)]
    expected, (h_ref, c_ref) = eager_rollout(model, xs)
    h_ref, c_ref = h_ref[0], c_ref[0]
    backend = create_backend("cuda_graph_triton", policy_from_actor_critic(model), batch=batch)
    worst = 0.0
    for x, want in zip(xs, expected, strict=True):
        backend.obs_host.copy_(x)
        backend.step()
        worst = max(worst, (backend.act_host - want).abs().max().item())
    # 1e-4 per step as for cuda_graph; 200 steps through the recurrent state: 2e-4
    assert worst <= 2e-4, f"max |diff| {worst:.2e}"
    torch.testing.assert_close(backend.h.cpu(), h_ref, atol=2e-4, rtol=0)
    torch.testing.assert_close(backend.c.cpu(), c_ref, atol=2e-4, rtol=0)
    assert expected[-1].abs().max() > 0.05


@pytest.mark.gpu
@needs_gpu
def test_nan_rows_stay_in_their_row_and_a_reset_recovers() -> None:
    cfg = PolicyConfig.tiny(obs_dim=48, num_actions=6)
    model = build_policy(cfg, seed=5)
    n, lower, upper = 4, (-1.0,) * 4, (1.0,) * 4
    backend = create_backend("cuda_graph_triton", policy_from_actor_critic(model), batch=4,
                             post=PostSpec(n, lower, upper, 0.5))
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 48, generator=gen) for _ in range(12)]
    xs[4] = xs[4].clone()
    xs[4][1, 3] = float("inf")
    xs[4][2, 0] = float("nan")
    expected, _ = eager_rollout(model, xs)
    for k, x in enumerate(xs):
        backend.obs_host.copy_(x)
        backend.step()
        if k == 4:
            assert not torch.isfinite(backend.act_host[1:3]).all(dim=1).any()
        if k == 5:  # rows 1, 2 are poisoned since step 4: reset them, compare from here
            assert not torch.isfinite(backend.act_host[1:3]).any()
            assert (backend.post_np[1:3, n] == 0).all() and (backend.post_np[[0, 3], n] == 1).all()
            backend.reset_state(1)
            backend.reset_state(2)
            fresh, _ = eager_rollout(model, [xx[1:3] for xx in xs[6:]])
        if k < 4 or k == 5:
            ok = [0, 3] if k >= 4 else [0, 1, 2, 3]
            torch.testing.assert_close(backend.act_host[ok], expected[k][ok], atol=1e-4, rtol=0)
        if k >= 6:
            torch.testing.assert_close(backend.act_host[[0, 3]], expected[k][[0, 3]], atol=1e-4,
                                       rtol=0)
            torch.testing.assert_close(backend.act_host[1:3], fresh[k - 6], atol=1e-4, rtol=0)
            assert (backend.post_np[:, n] == 1).all()
