"""PolicyRunner on cuda_graph_triton / cuda_persistent (command clamp +
finite check inside the CUDA graph, or the resident kernel):
its commands equal the host formula applied to its own actions (float32 rounding), and against
cpu_eager (host post-processing) the statuses and safety counters are the same and the commands
agree within the backends' numeric tolerance, through clamping, a NaN observation and
recovery. GPU only."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyCounters, SafetyStatus
from kestrel_models.control.policy import PolicyConfig

torch.set_num_threads(1)
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
LOWER, UPPER = [-2.0] * 5 + [-0.3], [2.0] * 5 + [0.3]


def _runner(backend: str) -> tuple[PolicyRunner, SafetyCounters]:
    counters = SafetyCounters()
    cfg = RunnerConfig(joint_lower=LOWER, joint_upper=UPPER, backend=backend, seed=3,
                       policy=PolicyConfig.tiny(obs_dim=48, num_actions=8), action_scale=0.2,
                       max_obs_age_s=1.0, latency_compensation=True, warmup_steps=3)
    return PolicyRunner(cfg, counters=counters), counters


@pytest.mark.parametrize("backend", ["cuda_graph_triton", "cuda_persistent"])
def test_in_graph_post_processing_equals_the_host_path(backend: str) -> None:
    runners = [_runner("cpu_eager"), _runner(backend), _runner("cuda_graph")]
    rng = np.random.default_rng(0)
    for k in range(40):
        js = np.stack([rng.uniform(-1, 1, 6), rng.uniform(-0.5, 0.5, 6)])
        js[0, 5] = 0.29  # near the 0.3 limit: clamped on many ticks
        if k == 10:
            js[0, 1] = math.nan
        outs = []
        for runner, _ in runners:
            runner.joint_states.write(js, 1_000_000_000)
            command, info = runner.step(1_000_000_000 + 2_000_000)
            outs.append((command.copy(), info.status, info.valid))
        (c0, s0, v0), (c1, s1, v1), (c2, s2, v2) = outs
        assert s0 == s1 == s2 and v0 == v1 == v2, k
        if k == 10:
            assert s0 is SafetyStatus.NONFINITE_OBS
            continue
        gpu = runners[1][0].robots[0]  # the host formula on the GPU runner's own outputs
        host = np.clip(gpu.pos + 0.2 * np.tanh(gpu.act[:6].astype(np.float64)), LOWER, UPPER)
        np.testing.assert_allclose(c1, host, atol=2e-6, rtol=0)  # float32 positions in-graph
        # cpu_eager vs the fused CUDA step: actions within the backends' 1e-4 tolerance per
        # step, compounded through the recurrent state over the ticks; x action_scale 0.2.
        np.testing.assert_allclose(c1, c0, atol=5e-4, rtol=0)
        np.testing.assert_allclose(c1, c2, atol=5e-4, rtol=0)  # cuda_graph: host post
        assert np.all(c1 >= LOWER) and np.all(c1 <= UPPER)
    (_, a), (_, b), (_, c) = runners
    # The seeded tiny policy clamps joint 5 on several of the 40 ticks; the point is that
    # clamping happens and is counted identically on every path.
    assert a == b == c and a.clamped_actions >= 5 and a.rejected_nonfinite == 1
    for runner, _ in runners:
        runner.close()
