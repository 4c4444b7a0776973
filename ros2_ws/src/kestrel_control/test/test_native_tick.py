"""The loop process's C tick (native_tick.c / .py) against the Python tick, on the CPU.

Two rigs on their own shared-memory segments, same seeded policy, same inputs each tick (sim
clock, so both see the same `now`): one ticks in Python, one with the C tick. After every tick
the commands in shared memory (values, versions, stamps), the safety counters, the command
counter, the eventfd count, the observation rows and the previous actions must be equal (host-
path commands within 1e-12 rad: numpy's and glibc's float64 tanh may differ by an ulp), through
stale and non-finite observations, a non-finite action, target changes, clamping, latency
compensation and two robots; and the C side must actually have run. The persistent kernel's
mailbox is served by a thread (the GPU kernel itself is tested on the GPU)."""

from __future__ import annotations

import os
import re
import threading
import time

import numpy as np
import pytest
import torch

from kestrel_control.core import native_tick as nt
from kestrel_control.core.loop_child import _Tick
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.shm_control import (_H_PUB, _H_SEQ, CLOCK_SIM, CTRL_CLOCK_MODE,
                                              CTRL_COMMANDS, CTRL_SIM_TIME_NS, ShmLayout,
                                              ShmSegment, ShmViews)
from kestrel_models.control.policy import PolicyConfig

torch.set_num_threads(1)
N = 6
LIMIT = 0.5  # rad, both ways: random positions of +-0.6 rad get clamped now and then

try:
    nt.build_library()
    NATIVE = ""
except nt.NativeUnavailable as exc:
    NATIVE = str(exc)
pytestmark = pytest.mark.skipif(bool(NATIVE), reason=f"C tick unavailable: {NATIVE}")


def _config(robots: int, backend: str = "cpu_eager", **mapping) -> RunnerConfig:
    return RunnerConfig(joint_lower=[-LIMIT] * N, joint_upper=[LIMIT] * N, max_obs_age_s=0.02,
                        latency_compensation=True, warmup_steps=0, num_robots=robots,
                        policy=PolicyConfig.tiny(), seed=3, backend=backend,
                        obs_position_margin=0.5, max_obs_velocity=60.0, **mapping)


def _fake_post(runner: PolicyRunner, nan_at: set[int]) -> None:
    """Give a CPU runner what an in-graph post-processing backend has: post rows [B, n + 2]
    (command | finite | clamped), float32 as in the graph; and NaN actions on the steps in
    `nan_at` (counted from 0)."""
    b, post = runner.backend, np.zeros((runner.batch, N + 2), np.float32)
    step, scale = b.step, np.float32(runner.config.action_scale)
    lo, hi = np.float32(-LIMIT), np.float32(LIMIT)
    calls = [0]

    def stepped() -> None:
        step()
        if calls[0] in nan_at:
            b.act_np[0, 1] = np.nan
        calls[0] += 1
        for r in range(runner.batch):
            prop = b.obs_np[r, :N] + scale * np.tanh(b.act_np[r, :N])
            post[r, :N] = np.minimum(np.maximum(prop, lo), hi)
            post[r, N] = float(np.isfinite(b.act_np[r]).all())
            post[r, N + 1] = float((post[r, :N] != prop).any())

    b.step = stepped
    runner._post = post


def _nan_actions(runner: PolicyRunner, nan_at: set[int]) -> None:
    b, step, calls = runner.backend, runner.backend.step, [0]

    def stepped() -> None:
        step()
        if calls[0] in nan_at:
            b.act_np[0, 2] = np.inf
        calls[0] += 1

    b.step = stepped


class Rig:
    def __init__(self, tag: str, robots: int, native: bool, post: bool,
                 nan_at: set[int], backend: str = "cpu_eager", mapping: dict | None = None
                 ) -> None:
        self.layout = ShmLayout(robots, N, 1e-3, stats_capacity=64)
        self.seg = ShmSegment(f"kestrel_native_{os.getpid()}_{tag}", self.layout.size,
                              create=True)
        self.views = ShmViews(self.seg.buf, self.layout)
        self.views.clear()
        self.views.control[CTRL_CLOCK_MODE] = CLOCK_SIM
        self.runner = PolicyRunner(_config(robots, backend, **(mapping or {})),
                                   counters=self.views.stats,
                                   buffers=list(zip(self.views.joint_states, self.views.targets,
                                                    strict=True)))
        if backend == "cpu_eager":  # the GPU backends post-process in their graph / kernel
            (_fake_post if post else _nan_actions)(self.runner, nan_at)
        self.efd = os.eventfd(0, os.EFD_NONBLOCK)
        self.tick = _Tick(self.runner, self.views, self.efd, native=native)
        self.codes: list[int] = []
        self.finished_in_c = 0
        if native:
            assert self.tick.native is not None, self.tick.native_status
            nat = self.tick.native
            tick, finish = nat.tick, nat.finish

            def counted_tick(now: int) -> int:
                self.codes.append(tick(now))
                return self.codes[-1]

            def counted_finish(now: int) -> int:
                done = finish(now)
                self.finished_in_c += done
                return done

            nat.tick, nat.finish = counted_tick, counted_finish

    def step(self, now: int) -> None:
        self.runner._lat[0] = 1.5e-3  # same compensation horizon in both rigs (not timing)
        self.views.control[CTRL_SIM_TIME_NS] = now
        self.tick(0)

    def state(self) -> dict:
        st = self.views.stats
        cmds = [c.read() for c in self.views.commands]
        try:
            events = os.eventfd_read(self.efd)
        except BlockingIOError:
            events = 0
        return {"cmd": [c[0].tolist() for c in cmds], "ver": [c[1] for c in cmds],
                "stamp": [c[2] for c in cmds], "stale": st.stale_inputs,
                "nonfinite": st.rejected_nonfinite, "clamped": st.clamped_actions,
                "implausible": st.rejected_implausible,
                "commands": int(self.views.control[CTRL_COMMANDS]), "events": events,
                "obs": self.runner.backend.obs_np.tolist(),
                "targets": [r.target_now.tolist() for r in self.runner.robots],
                "tver": self.runner._tver.tolist(),
                # (NaN -> a sentinel: the list comparison below treats NaN != NaN)
                "good": [[np.nan_to_num(b._good, nan=1e300).tolist(), b._good_vs.tolist()]
                         for b in (
                    *self.views.joint_states, *self.views.targets)],
                "safe": [r.safety.has_last_safe for r in self.runner.robots]}

    def close(self) -> None:
        os.close(self.efd)
        self.tick.native = None
        self.runner.close()
        self.views.release()
        self.seg.unlink()
        self.seg.close()


def _drive(rigs: list[Rig], robots: int, ticks: int = 120) -> None:
    rng = np.random.default_rng(7)
    now = 10**12
    for k in range(ticks):
        now += 1_000_000
        for r in range(robots):
            js = np.stack([rng.uniform(-0.6, 0.6, N), rng.uniform(-2.0, 2.0, N)])
            stamp = now - 3_000_000  # 3 ms old: compensated
            if k == 0:
                continue  # no input yet
            if (k == 30 and r == 0) or (k == 31 and r == robots - 1):
                stamp = now - 50_000_000  # stale
            if k == 40 and r == 0:
                js[1, 3] = np.nan  # non-finite observation
            if k == 45 and r == robots - 1:
                js[0, 2] = 9.0  # implausible position (limits +-0.5 rad, margin 0.5)
            if k == 46 and r == 0:
                js[1, 1] = 80.0  # implausible speed (bound 60 rad/s)
            for rig in rigs:
                rig.views.joint_states[r].write(js, stamp)
            if k % 25 == 1:
                tgt = rng.uniform(-0.3, 0.3, N)
                for rig in rigs:
                    rig.views.targets[r].write(tgt, now)
        stuck = []
        if k in (50, 52):  # the writer "laps" the reader: the published slot stays mid-write
            for rig in rigs:  # joint states (50), a new target (52): every read try fails
                buf = rig.views.joint_states[0] if k == 50 else rig.views.targets[0]
                if k == 52:
                    buf.write(np.full(N, 0.25), now)
                stuck.append(buf)
                buf._h[_H_SEQ + buf._h[_H_PUB]] += 1  # odd
        for rig in rigs:
            rig.step(now)
        for buf in stuck:
            buf._h[_H_SEQ + buf._h[_H_PUB]] += 1  # even again: the "write" completes
        a, b = (rig.state() for rig in rigs)
        # host-path commands: float64 tanh of glibc vs numpy's may differ by an ulp
        assert np.allclose(a.pop("cmd"), b.pop("cmd"), rtol=0.0, atol=1e-12), f"tick {k}"
        assert a == b, f"tick {k}: Python and C ticks differ"


@pytest.mark.parametrize("robots,post", [(1, False), (1, True), (2, False), (2, True)])
def test_c_tick_equals_the_python_tick(robots: int, post: bool) -> None:
    nan_at = {60, 61}
    rigs = [Rig(f"py{robots}{post}", robots, False, post, nan_at),
            Rig(f"c{robots}{post}", robots, True, post, nan_at)]
    try:
        _drive(rigs, robots)
        py, c = rigs
        st = py.views.stats
        assert st.stale_inputs >= 2 and st.rejected_nonfinite >= 3 and st.clamped_actions > 10
        assert st.rejected_implausible == 2
        assert c.codes.count(nt.KT_PY_INFER) > 80  # prepared in C (no mailbox: Python infers)
        assert c.codes.count(nt.KT_PY_ALL) >= 5  # no input, stale, NaN, 2 implausible
        assert c.finished_in_c > 80  # and finished in C, except for the NaN actions
    finally:
        for rig in rigs:
            rig.close()


# observation layouts and action mappings other than the reference (policy_io.py)
MAPPINGS = {
    "isaac_offset": {"obs_layout": ("joint_pos_rel", "joint_vel*0.05", "zeros:3", "target_rel",
                                    "last_action"),
                     "action_mode": "position_offset", "action_scale": 5.0, "action_clip": 0.1,
                     "default_joint_positions": (0.4, -0.4, 0.0, 0.2, -0.1, 0.3),
                     "action_scales": (5.0, 4.0, 6.0, 5.0, 3.0, 5.5)},
    "delta_no_last_action": {"obs_layout": ("joint_vel", "joint_pos*2.0"),
                             "action_mode": "position_delta", "action_scale": 0.3},
}


@pytest.mark.parametrize("robots", [1, 2])
@pytest.mark.parametrize("mapping", sorted(MAPPINGS))
def test_c_tick_equals_the_python_tick_with_other_mappings(mapping: str, robots: int) -> None:
    """Isaac Lab style terms (q - default_q, scaled terms, zero columns, last action clipped),
    the offset and delta action modes: same rows, commands and counters in C and Python."""
    rigs = [Rig(f"mpy{mapping}{robots}", robots, False, False, {60}, mapping=MAPPINGS[mapping]),
            Rig(f"mc{mapping}{robots}", robots, True, False, {60}, mapping=MAPPINGS[mapping])]
    try:
        _drive(rigs, robots)
        py, c = rigs
        assert py.runner._post is None and not py.runner.io.is_reference
        assert py.views.stats.clamped_actions > 5
        assert c.codes.count(nt.KT_PY_INFER) > 80 and c.finished_in_c > 80
    finally:
        for rig in rigs:
            rig.close()


class ThreadMailbox:
    """cuda_persistent's mailbox served by a thread that runs the CPU policy step: the C tick's
    request / answer protocol and its late path without a GPU. `slow_at`: steps answered after
    300 ms (beyond the C side's spin limit, set to 100 ms here: a CPU thread's answer is not a
    GPU's)."""

    def __init__(self, backend, slow_at: set[int]) -> None:
        self.b, self.slow_at = backend, slow_at
        self.ctrl = np.zeros(64, np.int32)
        self.mb = np.zeros(4, np.int64)
        self.mb[0] = 1
        self.served = 0
        self.stop = False
        self.step_cpu = backend.step
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        last = 0
        while not self.stop:
            seq = int(self.ctrl[0])
            if seq == last:
                time.sleep(2e-5)
                continue
            if self.served in self.slow_at:
                time.sleep(0.3)
            self.step_cpu()
            self.served += 1
            last = seq
            self.ctrl[16] = seq

    def mailbox(self):
        return self.ctrl, self.mb

    def step(self) -> None:  # PersistentTritonBackend.step's host side
        seq = int(self.mb[0])
        self.mb[0] = seq + 1
        self.ctrl[0] = seq
        self.finish(seq)

    def finish_late(self) -> None:
        self.finish(int(self.mb[3]))

    def finish(self, seq: int) -> None:
        end = time.monotonic() + 5.0
        while self.ctrl[16] != seq:
            assert time.monotonic() < end, "mailbox thread did not answer"
            time.sleep(1e-5)


@pytest.mark.slow
def test_c_tick_serves_the_persistent_mailbox() -> None:
    """With a mailbox the whole tick runs in one C call (KT_DONE); a late answer goes to
    Python's finish_late; commands equal the Python tick's."""
    rigs = [Rig("mpy", 1, False, False, set()), Rig("mc", 1, True, False, set())]
    boxes = []
    try:
        for rig in rigs:
            box = ThreadMailbox(rig.runner.backend, slow_at={50})
            boxes.append(box)
            rig.runner.backend.step = box.step
            rig.runner.backend.mailbox = box.mailbox
            rig.runner.backend.finish_late = box.finish_late
        c = rigs[1]
        # the C tick built now (after the mailbox exists), as a CDLL: the serving thread needs
        # the GIL while C waits
        native = nt.NativeTick(c.runner, c.views, c.efd, release_gil=True)
        native.ints[nt.I_SPIN_NS] = 100_000_000
        tick = native.tick

        def counted(now: int) -> int:
            c.codes.append(tick(now))
            return c.codes[-1]

        native.tick = counted
        c.tick.native = native
        late_dt: list[float] = []
        infer_late = c.runner._infer_late

        def timed_late(t0_ns: int) -> None:
            infer_late(t0_ns)
            late_dt.append(c.runner._last_step_s)

        c.runner._infer_late = timed_late
        _drive(rigs, 1, ticks=80)
        assert late_dt and late_dt[0] >= 0.25  # the late step's time counts from C's request
        assert c.codes.count(nt.KT_DONE) > 60, c.codes
        # the deliberately slow answer (tick 50) is late; on a loaded machine the Python
        # thread serving the mailbox can miss C's 100 ms wait once or twice more (seen at load
        # 6-8 on 2 cores): a late answer still reaches Python's finish_late, counted as such
        assert 1 <= c.codes.count(nt.KT_PY_LATE) <= 5, c.codes
        assert boxes[1].served == boxes[0].served
    finally:
        for box in boxes:
            box.stop = True
            box.thread.join(5.0)
        for rig in rigs:
            rig.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-driver case")
def test_no_cuda_driver_leaves_the_graph_step_to_python() -> None:
    ints = np.zeros(nt.I_GLOBAL, dtype=np.int64)
    assert nt.load().kt_init_cuda(int(ints.ctypes.data)) == 0 and ints[nt.I_CU_CTX] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cuda_persistent", "cuda_graph_triton", "cuda_graph"])
def test_c_tick_equals_the_python_tick_on_the_gpu(backend: str) -> None:
    """The real in-graph post-processing (cuda_graph: the host command); the whole tick in one
    C call (KT_DONE): with cuda_persistent through the resident kernel's mailbox, with the graph
    backends by launching the graph through the CUDA driver API. Commands equal (the same
    float32 rows; host commands within 1e-12 rad)."""
    if backend in ("cuda_persistent", "cuda_graph_triton"):
        pytest.importorskip("triton")
    rigs = [Rig(f"gpy{backend}", 2, False, False, set(), backend),
            Rig(f"gc{backend}", 2, True, False, set(), backend)]
    try:
        _drive(rigs, 2)
        c = rigs[1]
        # cuda_graph_triton: the graph launched from C wherever torch gives its executable
        if backend != "cuda_persistent" and hasattr(torch.cuda.CUDAGraph,
                                                    "raw_cuda_graph_exec"):
            assert "graph launch" in c.tick.native_status, c.tick.native_status
        in_c = backend == "cuda_persistent" or "graph launch" in c.tick.native_status
        assert c.codes.count(nt.KT_DONE if in_c else nt.KT_PY_INFER) > 80, (
            c.tick.native_status, c.codes)
        assert rigs[0].views.stats.clamped_actions > 10
    finally:
        for rig in rigs:
            rig.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_c_tick_launches_a_user_files_graph(tmp_path) -> None:
    """A user's TorchScript policy (Isaac Lab style terms and offset mapping) on cuda_graph:
    the C tick launches its graph through the driver API, as for Kestrel's own Triton step, and
    the commands equal the Python tick's."""
    from kestrel_models.control.external import ModelSpec

    torch.manual_seed(0)
    mapping = dict(MAPPINGS["isaac_offset"])
    width = 6 + 6 + 3 + 6 + 6  # the layout's columns
    path = tmp_path / "policy.pt"
    torch.jit.script(torch.nn.Sequential(torch.nn.Linear(width, 32), torch.nn.Tanh(),
                                         torch.nn.Linear(32, N))).save(str(path))
    mapping["model"] = ModelSpec(path=str(path), obs_dim=width)
    rigs = [Rig("ufpy", 1, False, False, set(), "cuda_graph", mapping),
            Rig("ufc", 1, True, False, set(), "cuda_graph", mapping)]
    try:
        _drive(rigs, 1)
        c = rigs[1]
        assert c.runner.policy.source.startswith("TorchScript")
        if hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"):
            assert "graph launch" in c.tick.native_status, c.tick.native_status
            assert c.codes.count(nt.KT_DONE) > 80, c.codes
        assert rigs[0].views.stats.clamped_actions > 5
    finally:
        for rig in rigs:
            rig.close()


def test_after_a_backwards_jump_the_python_tick_runs_until_a_joint_state_of_after_it(
) -> None:
    """The C tick knows nothing of time jumps (PolicyRunner.check_time): after /clock went
    back, the Python tick runs until every robot has a joint state written after the jump, so
    the joint state of before is not acted on; then C runs again, and the target of before
    stays forgotten (the runner marked its version as read)."""
    rig = Rig("jump", 1, True, False, set())
    try:
        js, tg = rig.views.joint_states[0], rig.views.targets[0]
        robot = rig.runner.robots[0]
        before, after, ms = 100 * 10**9, 3 * 10**9, 10**6
        for k in range(3):  # C prepares the tick (the CPU backend's inference is Python's)
            js.write(np.stack([np.full(N, 0.1), np.zeros(N)]), before + k * ms)
            tg.write(np.full(N, 0.3), before)
            rig.step(before + k * ms + ms // 2)
        assert rig.codes[-1] == nt.KT_PY_INFER and (robot.target_now == 0.3).all()
        commands, codes = rig.state()["commands"], len(rig.codes)
        for k in range(3):  # the jump; no joint state of after it yet: no command, no C
            rig.step(after + k * ms)
        assert rig.views.stats.time_jumps_back == 1 and len(rig.codes) == codes
        assert rig.state()["commands"] == commands and (robot.target_now == 0.0).all()
        for k in (3, 4):  # joint states of after the jump: C again, without the old target
            js.write(np.stack([np.full(N, -0.2), np.zeros(N)]), after + k * ms)
            rig.step(after + k * ms + ms // 2)
        assert rig.codes[codes:] == [nt.KT_PY_INFER] * 2
        assert (robot.target_now == 0.0).all() and (robot.pos == -0.2).all()
        assert rig.state()["commands"] == commands + 2
    finally:
        rig.close()


def test_offsets_match_the_c_source() -> None:
    src = nt.SOURCE.read_text()

    def names(first: str) -> list[str]:
        body = re.search(r"enum\s*\{[^{}]*?\b" + first + r"\b[^}]*\}", src).group(0)
        body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
        return re.findall(r"\b([A-Z][A-Z0-9_]+)\b", body.split("{", 1)[1])

    for first in ("I_ROBOTS", "R_JS_H", "D_MAX_AGE"):
        for i, name in enumerate(names(first)):
            assert getattr(nt, name) == i, (name, i)
    # constants with explicit values, against the Python modules that own them
    from kestrel_control.core import policy_io, shm_control
    from kestrel_models.control import persistent_step

    values = {m[0]: int(m[1]) for m in re.findall(r"\b([A-Z][A-Z0-9_]+) = (\d+)", src)}
    owners = {"KT_": (nt, ""), "H_": (shm_control, "_H_"), "MB_": (persistent_step, ""),
              "S_": (persistent_step, "S_"), "SRC_": (policy_io, "SRC_"),
              "MODE_": (policy_io, "MODE_")}
    checked = 0
    for name, value in values.items():
        for prefix, (module, py_prefix) in owners.items():
            if name.startswith(prefix):
                py_name = py_prefix + name[len(prefix):] if py_prefix else name
                if prefix == "MB_":
                    py_name = name[3:]  # MB_REQ -> REQ
                assert getattr(module, py_name) == value, (name, py_name)
                checked += 1
    assert checked >= 20, values


def test_no_compiler_is_reported_not_raised_at_the_loop(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "kestrel-no-such-compiler")
    with pytest.raises(nt.NativeUnavailable, match="no C compiler"):
        nt.build_library(tmp_path)
    rig = Rig("nocc", 1, False, False, set())
    try:
        tick = _Tick(rig.runner, rig.views, rig.efd, native=True)
        assert tick.native is None and "Python tick runs" in tick.native_status
    finally:
        rig.close()
