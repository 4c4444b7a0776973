"""PolicyRunner: observation layout, command = pos + scale * tanh(action), safety, no allocation."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyStatus
from kestrel_control.core.stats import LoopStats
from kestrel_models.control.policy import PolicyConfig, build_policy

torch.set_num_threads(1)
N = 6
LOWER, UPPER = np.full(N, -2.0), np.full(N, 2.0)
TINY = PolicyConfig.tiny(obs_dim=32, num_actions=8)  # 3 * 6 + 8 = 26 <= 32
MS = 1_000_000


def make(**kwargs) -> PolicyRunner:
    args = {"joint_lower": LOWER, "joint_upper": UPPER, "policy": TINY, "action_scale": 0.1,
            "seed": 3, "warmup_steps": 2} | kwargs
    return PolicyRunner(RunnerConfig(**args), counters=LoopStats(1e-3))


def feed(runner: PolicyRunner, pos, vel, stamp_ns: int) -> None:
    runner.joint_states.write(np.stack([np.asarray(pos, float), np.asarray(vel, float)]), stamp_ns)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": PolicyConfig.tiny(obs_dim=64, num_actions=4)}, r"'num_actions' = 4:.* 6 "),
        ({"policy": PolicyConfig.tiny(obs_dim=20, num_actions=8)}, r"'obs_dim' = 20.*26"),
        ({"backend": "tensorrt"}, r"'backend' = 'tensorrt'"),
        ({"action_scale": 0.0}, "'action_scale'"),
        ({"max_obs_age_s": -1.0}, "'max_obs_age'"),
        ({"joint_lower": np.full(N, 3.0)}, "'joint_lower'"),
        ({"weights_path": "/nonexistent/policy.pt"}, "'weights_path' = '/nonexistent"),
    ],
)
def test_configuration_errors_name_parameter(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_backend_refused_without_cuda() -> None:
    with pytest.raises(ValueError, match="'backend' = 'cuda_eager': CUDA is not available"):
        make(backend="cuda_eager")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backend_matches_cpu() -> None:
    cpu, cuda = make(), make(backend="cuda_eager")
    assert cuda.model.policy_head.weight.is_cuda and cuda.backend.states[0].is_cuda
    rng = np.random.default_rng(1)
    for k in range(20):
        js = np.stack([rng.uniform(-1, 1, N), rng.uniform(-1, 1, N)])
        for r in (cpu, cuda):
            r.joint_states.write(js, k * MS)
        c_cpu, info_cpu = cpu.step(k * MS + 1)
        c_cuda, info_cuda = cuda.step(k * MS + 1)
        assert info_cpu.status is info_cuda.status is SafetyStatus.OK
        np.testing.assert_allclose(c_cuda, c_cpu, atol=1e-5)


def test_no_input_no_command_and_cpu_threads() -> None:
    runner = make()
    assert torch.get_num_threads() == 1
    _, info = runner.step(5 * MS)
    assert info.status is SafetyStatus.NO_INPUT and not info.valid


def test_command_matches_policy_on_documented_observation_layout() -> None:
    runner = make()
    ref = build_policy(TINY, seed=3)
    rng = np.random.default_rng(0)
    target = rng.uniform(-1, 1, N)
    runner.target.write(target, 1)
    h, c = ref.initial_state(1)
    prev_action = np.zeros(TINY.num_actions, np.float32)
    for k in range(4):
        pos, vel = rng.uniform(-1, 1, N), rng.uniform(-3, 3, N)
        feed(runner, pos, vel, stamp_ns=k * MS)
        command, info = runner.step(k * MS + MS // 2)
        assert info.status is SafetyStatus.OK and info.valid
        assert info.obs_age_s == pytest.approx(0.5e-3) and info.obs_stamp_ns == k * MS
        obs = np.zeros(TINY.obs_dim, np.float32)
        obs[:N], obs[N:2 * N], obs[2 * N:3 * N] = pos, vel, target
        obs[3 * N:3 * N + TINY.num_actions] = prev_action
        with torch.inference_mode():
            actions, _, h, c = ref.step(torch.from_numpy(obs)[None], h, c)
        prev_action = actions[0].numpy()
        expected = np.clip(pos + 0.1 * np.tanh(prev_action[:N].astype(np.float64)), LOWER, UPPER)
        np.testing.assert_allclose(command, expected, atol=1e-6)
    assert runner.counters.clamped_actions == 0


def test_clamped_to_limits_and_counted() -> None:
    runner = make(action_scale=5.0)
    feed(runner, np.full(N, 1.9), np.zeros(N), 0)
    command, info = runner.step(MS)
    assert info.status is SafetyStatus.OK
    assert np.all(command <= UPPER) and np.all(command >= LOWER)
    assert np.any(command == UPPER) or np.any(command == LOWER)
    assert runner.counters.clamped_actions == 1


def test_stale_observation_holds_last_command_and_counts() -> None:
    runner = make()
    feed(runner, np.full(N, 0.3), np.zeros(N), 0)
    good, info = runner.step(MS)
    good = good.copy()
    held, info = runner.step(25 * MS)  # 25 ms old > max_obs_age 20 ms
    assert info.status is SafetyStatus.STALE and info.valid
    np.testing.assert_array_equal(held, good)
    runner.step(26 * MS)
    assert runner.counters.stale_inputs == 2


def test_stale_first_observation_holds_current_position() -> None:
    runner = make()
    feed(runner, np.full(N, 0.3), np.zeros(N), 0)
    command, info = runner.step(100 * MS)
    assert info.status is SafetyStatus.STALE and info.valid
    np.testing.assert_array_equal(command, np.full(N, 0.3))


def test_nonfinite_observation_rejected_then_recovers() -> None:
    runner = make()
    feed(runner, np.zeros(N), np.zeros(N), 0)
    good = runner.step(MS)[0].copy()
    pos = np.zeros(N)
    pos[2] = np.nan
    feed(runner, pos, np.zeros(N), 2 * MS)
    held, info = runner.step(3 * MS)
    assert info.status is SafetyStatus.NONFINITE_OBS and info.valid
    np.testing.assert_array_equal(held, good)
    runner.target.write(np.full(N, np.inf), 3 * MS)  # a bad target is rejected too
    feed(runner, np.zeros(N), np.zeros(N), 4 * MS)
    assert runner.step(5 * MS)[1].status is SafetyStatus.NONFINITE_OBS
    runner.target.write(np.zeros(N), 5 * MS)
    command, info = runner.step(5 * MS)
    assert info.status is SafetyStatus.OK and np.all(np.isfinite(command))
    assert runner.counters.rejected_nonfinite == 2


@pytest.mark.parametrize("bad", ["position", "velocity", "huge"])
def test_implausible_observation_holds_and_never_commands_from_it(bad: str) -> None:
    """A finite but implausible joint state (a position past a limit by more than the margin,
    a speed above the bound, or 1e300: a wrong unit, a broken encoder) is held like a NaN one
    and counted; before any safe command nothing is sent at all: clamping the position to the
    nearest limit would be a legal-looking jump."""
    runner = make(obs_position_margin=0.5, max_obs_velocity=50.0)
    pos, vel = np.zeros(N), np.zeros(N)
    if bad == "position":
        pos[1] = 2.0 + 0.6  # the limits are +-2 rad
    elif bad == "velocity":
        vel[4] = -51.0
    else:
        pos[0] = 1e300
    feed(runner, pos, vel, 0)
    _, info = runner.step(MS)
    assert info.status is SafetyStatus.IMPLAUSIBLE_OBS and not info.valid  # nothing to send
    feed(runner, np.zeros(N), np.zeros(N), 2 * MS)
    good, info = runner.step(3 * MS)
    assert info.status is SafetyStatus.OK
    good = good.copy()
    feed(runner, pos, vel, 4 * MS)
    held, info = runner.step(5 * MS)
    assert info.status is SafetyStatus.IMPLAUSIBLE_OBS and info.valid
    np.testing.assert_array_equal(held, good)  # the last safe command
    assert runner.counters.rejected_implausible == 2 and runner.counters.rejected_nonfinite == 0
    pos_edge = np.full(N, 2.0 + 0.49)  # inside the margin: plausible (the command is clamped)
    feed(runner, pos_edge, np.full(N, 49.0), 6 * MS)
    assert runner.step(7 * MS)[1].status is SafetyStatus.OK


def test_plausibility_parameters_are_validated() -> None:
    with pytest.raises(ValueError, match="parameter 'obs_position_margin' = -1"):
        make(obs_position_margin=-1.0)
    with pytest.raises(ValueError, match="parameter 'max_obs_velocity' = 0"):
        make(max_obs_velocity=0.0)


def test_nonfinite_policy_output_holds_and_resets_recurrent_state() -> None:
    runner = make()
    feed(runner, np.zeros(N), np.zeros(N), 0)
    good = runner.step(MS)[0].copy()
    with torch.no_grad():
        runner.model.policy_head.bias[1] = float("nan")
    held, info = runner.step(2 * MS)
    assert info.status is SafetyStatus.NONFINITE_ACTION and info.valid
    np.testing.assert_array_equal(held, good)
    assert runner.counters.rejected_nonfinite == 1
    assert all(not s.abs().sum().isnan() for s in runner.backend.states)  # not poisoned
    assert np.all(runner._obs[3 * N:] == 0.0)  # previous action cleared


def test_weights_file_loaded(tmp_path: Path) -> None:
    path = tmp_path / "policy.pt"
    torch.save(build_policy(TINY, seed=11).state_dict(), path)
    loaded, seeded = make(weights_path=str(path), seed=0), make(seed=11)
    for r in (loaded, seeded):
        feed(r, np.full(N, 0.1), np.zeros(N), 0)
    np.testing.assert_array_equal(loaded.step(MS)[0], seeded.step(MS)[0])
    wrong = tmp_path / "wrong.pt"
    torch.save(build_policy(PolicyConfig.tiny(obs_dim=40), seed=1).state_dict(), wrong)
    with pytest.raises(ValueError, match="'weights_path'.*does not match"):
        make(weights_path=str(wrong))


def test_reference_sizes_run() -> None:
    runner = make(policy=PolicyConfig())  # obs 256, 512 -> 256, LSTM 256, 12 actions
    feed(runner, np.zeros(N), np.zeros(N), 0)
    command, info = runner.step(MS)
    assert info.valid and command.shape == (N,)


ISAAC_MAPPING = {"obs_layout": ("joint_pos_rel", "joint_vel*0.05", "zeros:2", "last_action"),
                 "action_mode": "position_offset", "action_clip": 0.5,
                 "default_joint_positions": (0.1,) * N}


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "mapping"), [("cpu_eager", {}), ("onnxruntime", {}),
                                                  ("cpu_eager", ISAAC_MAPPING)],
                         ids=["cpu_eager", "onnxruntime", "cpu_eager-isaac_mapping"])
def test_steady_state_steps_do_not_allocate(backend: str, mapping: dict,
                                            tmp_path: Path) -> None:
    """After warm-up, 1000 steps leave ~0 net Python-traced memory. (torch's / ONNX Runtime's
    own memory comes from their C++ allocators, outside tracemalloc; per-step wrappers are
    freed.) Latency compensation on: the prediction works in place too; so do the Isaac Lab
    terms and the clipped offset mapping (policy_io.RowIO)."""
    runner = make(backend=backend, cache_dir=str(tmp_path), latency_compensation=True,
                  **mapping)
    js = np.zeros((2, N))  # [positions; velocities], written like a subscription callback
    stamp = 0
    for k in range(200):
        stamp += MS
        js[0] = 0.2 + 1e-3 * k
        runner.joint_states.write(js, stamp)
        runner.step(stamp + 1000)
    def steps(count: int) -> None:
        nonlocal stamp
        for _ in range(count):
            stamp += MS
            js[1, 0] += 1e-3
            runner.joint_states.write(js, stamp)
            runner.step(stamp + 1000)  # fresh observation: the full inference path

    tracemalloc.start()
    try:
        steps(200)  # one-time caches first seen under tracing (numpy/ORT wrappers) settle here
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        steps(1000)
        mid, peak = tracemalloc.get_traced_memory()
        steps(2000)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert runner.info.status is SafetyStatus.OK and runner.counters.stale_inputs == 0
    # No growth: 2000 more steps retain nothing beyond a few live temporaries.
    assert mid - before < 2048, f"{mid - before} bytes retained over 1000 steps"
    assert after - mid < 2048, f"{after - mid} bytes retained over 2000 more steps"
    assert peak - before < 64 * 1024


def _prepare_peak_bytes(latency_compensation: bool) -> int:
    """tracemalloc's peak above the start over 2000 `_prepare` calls (the host side of a tick:
    read the buffer, checks, latency prediction, obs copy)."""
    runner = make(latency_compensation=latency_compensation)
    js = np.zeros((2, N))
    js[1] = 0.5  # velocities: the prediction has work to do
    stamp = 0
    for _ in range(50):
        stamp += MS
        runner.joint_states.write(js, stamp)
        assert runner._prepare(0, stamp + 1000)
    tracemalloc.start()
    try:
        for _ in range(100):  # warm under tracing
            runner._prepare(0, stamp + 1000)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            runner._prepare(0, stamp + 1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (runner.robots[0].info.predicted_s > 0) == latency_compensation
    return peak - before


def test_latency_prediction_adds_no_temporary_array() -> None:
    """Each numpy call of the tick makes a few transient bytes of its own (ufunc machinery:
    ~130-240 bytes of peak, freed at once, never growing). The latency prediction must add
    no array on top: the earlier `pos += vel * ahead` made a temporary [n] array every tick,
    peak 240 -> 360 bytes, which the net-memory test above cannot see."""
    off, on = _prepare_peak_bytes(False), _prepare_peak_bytes(True)
    assert on <= off + 32, f"prediction on: peak +{on} bytes vs +{off} without"


@pytest.mark.parametrize("actions", [N + 1, N + 2])
def test_a_model_file_needs_one_action_per_joint(actions: int, tmp_path: Path) -> None:
    """A user's exported policy (Isaac Lab's policy.pt) with more outputs than joints is not
    quietly cut to its first n: that mapping is not something the file says. (Fewer outputs
    than joints fail too: tests/test_control_multi_robot_dds.py.)"""
    from kestrel_models.control.external import ModelSpec

    net = torch.nn.Linear(32, actions)
    path = tmp_path / "policy.pt"
    torch.jit.script(net).save(str(path))
    with pytest.raises(ValueError, match=f"parameter 'model_path': the policy .* outputs "
                                         f"{actions} actions and the robot has {N} joints"):
        make(model=ModelSpec(path=str(path), obs_dim=32))
    good = tmp_path / "good.pt"
    torch.jit.script(torch.nn.Linear(32, N)).save(str(good))
    runner = make(model=ModelSpec(path=str(good), obs_dim=32))
    feed(runner, np.zeros(N), np.zeros(N), 0)
    assert runner.step(MS)[1].valid


def test_reset_forgets_the_joint_state_and_target_from_before() -> None:
    """Activation (reset) after a deactivation: a joint state received before, still fresh by
    its stamp, must not produce a command; the first one written after the reset does."""
    runner = make(max_obs_age_s=10.0)
    feed(runner, np.full(N, 0.2), np.zeros(N), 1 * MS)
    runner.target.write(np.full(N, 0.7), 1 * MS)
    _, info = runner.step(2 * MS)
    assert info.valid and np.all(runner.robots[0].target_now == 0.7)
    runner.reset()
    for k in range(3, 10):
        _, info = runner.step(k * MS)
        assert info.status is SafetyStatus.NO_INPUT and not info.valid
    feed(runner, np.full(N, 0.2), np.zeros(N), 10 * MS)
    _, info = runner.step(11 * MS)
    assert info.valid and np.all(runner.robots[0].target_now == 0.0)  # no target since


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choice")
def test_auto_backend_is_the_fastest_cpu_one_that_runs() -> None:
    """backend 'auto' on a CPU machine: onnxruntime for the reference policy (measured the
    fastest CPU step), with the same commands as cpu_eager."""
    auto, eager = make(backend="auto"), make()
    assert auto.backend.name == "onnxruntime"
    for k in range(5):
        for r in (auto, eager):
            feed(r, np.full(N, 0.1 * k), np.zeros(N), k * MS)
        (a, ia), (e, ie) = auto.step(k * MS + 1), eager.step(k * MS + 1)
        assert ia.valid and ie.valid
        np.testing.assert_allclose(a, e, atol=1e-5)
