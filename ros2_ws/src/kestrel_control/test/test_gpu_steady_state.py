"""No allocation in the steady state on the GPU paths: after warm-up, thousands of ticks make no
CUDA caching-allocator call (torch.cuda.memory_stats: allocation and free counts unchanged)
and retain no Python memory (tracemalloc), with the obs/action buffers pinned; through
PolicyRunner.step (the host tick around the backend) for each graph backend, and a user's
TorchScript file with the Isaac Lab mapping on cuda_graph. (The CPU paths: test_policy_runner.)
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyStatus
from kestrel_control.core.stats import LoopStats
from kestrel_models.control.external import ModelSpec
from kestrel_models.control.policy import PolicyConfig

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
N, MS = 6, 1_000_000
KEYS = ("allocation.all.allocated", "allocation.all.freed", "segment.all.allocated",
        "allocated_bytes.all.current")


def _runner(backend: str, tmp_path: Path, user_file: bool) -> PolicyRunner:
    kwargs: dict = {}
    if user_file:
        width = 3 * N
        path = tmp_path / "policy.pt"
        torch.jit.script(torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ELU(),
                                             torch.nn.Linear(64, N))).save(str(path))
        kwargs = {"model": ModelSpec(path=str(path), obs_dim=width),
                  "obs_layout": ("joint_pos_rel", "joint_vel", "last_action"),
                  "action_mode": "position_offset", "action_scale": 0.5, "action_clip": 1.0,
                  "default_joint_positions": (0.1,) * N}
    config = RunnerConfig(joint_lower=[-2.0] * N, joint_upper=[2.0] * N,
                          policy=PolicyConfig.tiny(), backend=backend, seed=1,
                          latency_compensation=True, warmup_steps=20, **kwargs)
    return PolicyRunner(config, counters=LoopStats(1e-3))


CASES = [("cuda_graph", False), ("cuda_graph", True), ("cuda_graph_triton", False),
         ("cuda_persistent", False)]


@pytest.mark.parametrize(("backend", "user_file"), CASES,
                         ids=[f"{b}{'-user_file' if u else ''}" for b, u in CASES])
def test_graph_ticks_do_not_allocate(backend: str, user_file: bool, tmp_path: Path) -> None:
    if backend in ("cuda_graph_triton", "cuda_persistent"):
        pytest.importorskip("triton")
    runner = _runner(backend, tmp_path, user_file)
    try:
        b = runner.backend
        assert b.obs_host.is_pinned() and b.act_host.is_pinned()
        js = np.zeros((2, N))
        stamp = 0

        def ticks(count: int) -> None:
            nonlocal stamp
            for _ in range(count):
                stamp += MS
                js[0, 0] = 0.3 * np.sin(stamp * 1e-8)
                js[1, 1] += 1e-4
                runner.joint_states.write(js, stamp)
                runner.step(stamp + 500_000)  # 0.5 ms old: compensated, the full path

        def cuda_counts() -> dict:
            stats = torch.cuda.memory_stats()
            return {k: stats[k] for k in KEYS}

        ticks(300)
        torch.cuda.synchronize()
        cuda_counts()  # memory_stats' own first-call caches, outside the traced window
        tracemalloc.start()
        try:
            ticks(200)
            before = cuda_counts()
            snap0 = tracemalloc.take_snapshot()
            before_py = tracemalloc.get_traced_memory()[0]  # only the ticks in between
            ticks(3000)
            after_py = tracemalloc.get_traced_memory()[0]
            top = [str(d) for d in tracemalloc.take_snapshot().compare_to(snap0, "lineno")[:5]]
            after = cuda_counts()
        finally:
            tracemalloc.stop()
        assert runner.info.status is SafetyStatus.OK and runner.info.valid
        assert after == before, f"CUDA allocator used in the steady state: {before} -> {after}"
        assert after_py - before_py < 2048, f"{after_py - before_py} bytes retained: {top}"
    finally:
        runner.close()
