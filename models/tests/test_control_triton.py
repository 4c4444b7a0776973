"""cuda_graph_triton (triton_step.py) and cuda_persistent (persistent_step.py, the same fused
step as one resident kernel): refusals on machines without triton/CUDA (CPU), and on a GPU the
fused step equals fp32 eager over many recurrent steps at the reference sizes, keeps NaN rows to
themselves and resets one row's state; cuda_persistent also retires when idle and relaunches
with its state intact, and ends on close()."""

from __future__ import annotations

import time

import pytest
import torch
from policy_reference import eager_rollout
from torch import nn

from kestrel_models.control.policy import PolicyConfig, build_policy
from kestrel_models.control.runtimes import (BackendUnavailable, PostSpec, StepPolicy,
                                             check_backend, create_backend,
                                             policy_from_actor_critic)
from kestrel_models.control.persistent_step import check_persistent, plan_programs
from kestrel_models.control.triton_step import _lower, _rows_per_program, check_triton

torch.set_num_threads(1)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", ["cuda_graph_triton", "cuda_persistent"])
def test_unavailable_here_names_the_backend_and_the_reason(name: str) -> None:
    try:
        check_backend(name)
        (check_triton if name == "cuda_graph_triton" else check_persistent)()
    except BackendUnavailable as exc:  # CI: no CUDA (or no triton)
        msg = str(exc)
        assert f"parameter 'backend' = '{name}'" in msg
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


def test_persistent_programs_cover_every_layer_and_bound_registers() -> None:
    # reference sizes on 64 programs: 512 rows -> 8 each, 256 -> 4, 256 LSTM units -> 4 each;
    # 8x256 + 4x512 + 4x4x(256 + 256) floats = 12288 -> 8 warps (48 floats per thread)
    assert plan_programs([256, 512, 256], 256, 64) == {"rows": [8, 4], "units": 4,
                                                       "num_warps": 8}
    assert plan_programs([256, 512, 256], 256, 128) == {"rows": [4, 2], "units": 2,
                                                        "num_warps": 4}
    plan = plan_programs([48, 100, 60, 30], 40, 16)  # non-powers of two: rounded up
    assert plan["rows"] == [8, 4, 2] and plan["units"] == 4
    for n, r in zip([100, 60, 30], plan["rows"], strict=True):
        assert -(-n // r) <= 16  # 16 programs of r rows cover n rows


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["cuda_graph_triton", "cuda_persistent"])
@pytest.mark.parametrize("batch", [1, 8])
def test_reference_sizes_over_many_recurrent_steps(name: str, batch: int) -> None:
    model = build_policy(PolicyConfig(), seed=1)  # 256 -> 512 -> 256, LSTM 256, 12 actions
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(batch, 256, generator=gen) * (1.0 + 2.0 * (k % 7 == 0))
          for k in range(200)]
    expected, (h_ref, c_ref) = eager_rollout(model, xs)
    h_ref, c_ref = h_ref[0], c_ref[0]
    backend = create_backend(name, policy_from_actor_critic(model), batch=batch)
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
    backend.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", ["cuda_graph_triton", "cuda_persistent"])
def test_nan_rows_stay_in_their_row_and_a_reset_recovers(name: str) -> None:
    cfg = PolicyConfig.tiny(obs_dim=48, num_actions=6)
    model = build_policy(cfg, seed=5)
    n, lower, upper = 4, (-1.0,) * 4, (1.0,) * 4
    backend = create_backend(name, policy_from_actor_critic(model), batch=4,
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
    backend.close()


def _wait_until(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.gpu
@needs_gpu
def test_persistent_retires_when_idle_and_relaunches_with_its_state() -> None:
    """Idle for longer than idle_retire_s: the kernel ends by itself (RETIRED set, the stream
    drains); the next step relaunches it and the recurrent state carried on across."""
    from kestrel_models.control.persistent_step import RETIRED, PersistentTritonBackend

    model = build_policy(PolicyConfig.tiny(obs_dim=48, num_actions=6), seed=7)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 48, generator=gen) for _ in range(8)]
    expected, _ = eager_rollout(model, xs)
    backend = PersistentTritonBackend(policy_from_actor_critic(model), 2, programs=8,
                                      idle_retire_s=0.05, backoff_ns=200)  # + the sleep path
    for k, x in enumerate(xs):
        if k in (3, 6):
            assert _wait_until(lambda: bool(backend._ctrl[RETIRED])), "kernel did not retire"
            assert _wait_until(backend._stream.query), "retired kernel still on the stream"
        backend.obs_host.copy_(x)
        backend.step()
        torch.testing.assert_close(backend.act_host, expected[k], atol=1e-4, rtol=0)
    assert backend.relaunches == 2
    backend.close()
    assert backend._stream.query()  # close() waited for the end
    torch.cuda.synchronize()  # nothing resident: a device-wide sync returns
    backend.obs_host.copy_(xs[0])
    backend.step()  # a step after close() launches again
    assert backend.relaunches == 3
    backend.close()


@pytest.mark.gpu
@needs_gpu
def test_persistent_refuses_more_programs_than_sms() -> None:
    from kestrel_models.control.persistent_step import PersistentTritonBackend

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match=f"parameter 'programs' = {sms + 1}: must be in"):
        PersistentTritonBackend(policy_from_actor_critic(build_policy(PolicyConfig.tiny())), 1,
                                programs=sms + 1)
