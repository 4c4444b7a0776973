"""loop_mode 'process': shared-memory seqlock buffers across processes, the loop child (same
commands as the in-process runner, statistics visible to the node), start failures, and no
/dev/shm segment or child left behind (after close, and after the node is killed)."""

from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from kestrel_control.core.loop_process import LoopProcess, LoopProcessError, LoopSettings
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyStatus
from kestrel_control.core.shm_control import ShmLayout, ShmSegment, ShmViews
from kestrel_models.control.policy import PolicyConfig

# needs the machine to itself (timed loop processes; checks /dev/shm for segments left
# behind): run one at a time
pytestmark = pytest.mark.serial

torch.set_num_threads(1)
N = 6


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kestrel_control_{pid}_*")


def _wait(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)  # polling interval of a bounded wait
    return pred()


@pytest.fixture
def segment():
    layout = ShmLayout(num_robots=2, num_joints=N, period_s=1e-3, stats_capacity=64)
    seg = ShmSegment(f"kestrel_control_{os.getpid()}_test", layout.size, create=True)
    views = ShmViews(seg.buf, layout)
    views.clear()
    yield seg, layout, views
    views.release()
    seg.unlink()
    seg.close()
    assert not os.path.exists(seg.path)


def test_shared_buffer_newest_value_stamp_and_failed_fill(segment) -> None:
    _, _, views = segment
    buf = views.joint_states[1]
    out = np.full((2, N), 7.0)
    assert buf.read_into(out) == (0, 0) and np.all(out == 0.0)
    for k in range(1, 4):
        assert buf.write(np.full((2, N), float(k)), stamp_ns=100 * k) == k
    assert buf.read_into(out) == (3, 300) and np.all(out == 3.0)

    def bad_fill(slot: np.ndarray) -> None:
        slot[...] = 99.0
        raise KeyError("unknown joint")

    with pytest.raises(KeyError):
        buf.write_with(bad_fill, 400)
    assert buf.read_into(out) == (3, 300) and np.all(out == 3.0)
    assert views.joint_states[0].version == 0  # robots do not share buffers


def test_shared_stats_written_by_one_view_read_by_another(segment) -> None:
    seg, layout, views = segment
    other = ShmViews(ShmSegment(seg.name, layout.size, create=False).buf, layout)
    for i in range(10):
        views.stats.record(1e-6 * i, 1e-4, 1e-3 if i else None, 5_000_000 + i)
    views.stats.stale_inputs += 3
    assert other.stats.counters()["cycles"] == 10 and other.stats.stale_inputs == 3
    snap = other.stats.snapshot()
    assert snap.cycles_window == 10 and snap.step_latency_p50 == pytest.approx(1e-4)
    assert other.stats.window_end_wake_ns == 5_000_009  # the reporter's stamp anchor
    assert other.stats.snapshot().cycles_window == 0  # the reader's own window marks
    other.release()


WRITER = textwrap.dedent("""
    import sys, threading
    import numpy as np
    from kestrel_control.core.shm_control import ShmLayout, ShmSegment, ShmViews
    name, size = sys.argv[1], int(sys.argv[2])
    layout = ShmLayout(num_robots=2, num_joints={n}, period_s=1e-3, stats_capacity=64)
    views = ShmViews(ShmSegment(name, layout.size, create=False).buf, layout)
    buf = views.joint_states[0]
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    k = 0
    while not stop.is_set():  # until the reader has seen enough (it closes our stdin)
        k += 1
        def fill(slot, k=k):
            slot[0] = k
            slot[1] = -k
        buf.write_with(fill, k)
    print(k, flush=True)
""").format(n=N)


@pytest.mark.slow
def test_no_torn_reads_with_a_concurrent_writer_process(segment) -> None:
    """A writer process publishes [k, -k] rows as fast as it can; every read in this process
    is one complete write: one value throughout, the stamp matching it, versions never back.
    The reader decides when it has seen enough (2,000 reads of > 100 distinct writes, or 60 s),
    so a loaded machine makes the test slower, not flaky (it once read nothing while the
    writer ran for a fixed second)."""
    seg, layout, views = segment
    writer = subprocess.Popen([sys.executable, "-c", WRITER, seg.name, str(layout.size)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    buf = views.joint_states[0]
    out = np.zeros((2, N))
    reads, last_version, distinct = 0, 0, set()
    try:
        deadline = time.monotonic() + 60.0
        while writer.poll() is None and time.monotonic() < deadline and \
                (reads < 2000 or len(distinct) <= 100):
            version, stamp = buf.read_into(out)
            if version == 0 or version == last_version:
                continue  # not started yet / nothing new (the fallback returns the last one)
            k = out[0, 0]
            assert np.all(out[0] == k) and np.all(out[1] == -k), out  # not torn
            assert stamp == k and version > last_version
            last_version = version
            distinct.add(k)
            reads += 1
        written = int(writer.communicate(input="", timeout=10.0)[0])
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(5)
    assert reads >= 2000 and len(distinct) > 100, (written, reads, len(distinct))
    assert written >= reads and buf.version == written


def _config(**kw) -> RunnerConfig:
    kw.setdefault("policy", PolicyConfig.tiny())
    return RunnerConfig(joint_lower=[-3.0] * N, joint_upper=[3.0] * N, max_obs_age_s=30.0,
                        latency_compensation=False, warmup_steps=2, **kw)


@pytest.mark.slow
def test_loop_process_commands_equal_the_in_process_runner() -> None:
    """Same observation every tick: the command after v ticks in the child equals the in-process
    runner's after v steps (same seeded weights); statistics and publisher reach the node side."""
    proc = LoopProcess(_config(), LoopSettings(period_s=2e-3, switch_interval_s=1e-4,
                                               rt_priority=20), start_timeout_s=60.0)
    js = np.array([[0.3, -0.2, 0.1, 0.0, 0.5, -0.4], [0.0] * N])
    published: list[tuple[int, np.ndarray, int]] = []
    switch_before = sys.getswitchinterval()
    try:
        info = proc.start()
        assert info["batch"] == 1 and info["backend"] == "cpu_eager"
        assert len(_segments(os.getpid())) == 1
        applied = proc.activate(lambda r, c, s: published.append((r, c.copy(), s)))
        assert "gc" in applied
        proc.joint_states[0].write(js, time.time_ns())  # after activation: what came before
        # it is forgotten
        # the node process too (its publisher thread), while active
        assert sys.getswitchinterval() == pytest.approx(1e-4)
        assert _wait(lambda: len(published) >= 20, 20.0), "no commands published"
        # the publisher thread: SCHED_FIFO below the loop where permitted (root here)
        assert proc.publisher_priority == "SCHED_FIFO 10" or \
            proc.publisher_priority.startswith("not applied"), proc.publisher_priority
        proc.deactivate()
        assert sys.getswitchinterval() == switch_before
        cmd, version, stamp = proc.views.commands[0].read()
        stats = proc.stats.counters()
    finally:
        proc.close()
    assert not _segments(os.getpid())
    assert proc.proc.returncode == 0
    assert stats["cycles"] >= version >= 20 and proc.published >= 20
    assert published[-1][0] == 0 and np.array_equal(published[-1][1], cmd)
    runner = PolicyRunner(_config())
    runner.joint_states.write(js, 1)
    for _ in range(version):
        expected, _info = runner.step(2)
    np.testing.assert_allclose(cmd, expected, rtol=0, atol=1e-12)
    assert np.max(np.abs(cmd - js[0])) <= 0.05 + 1e-12  # action_scale bound


@pytest.mark.slow
def test_child_error_fails_start_with_its_message_and_leaves_nothing(capfd) -> None:
    """... and what the child says goes to the node's logger (its warnings to `warn`), never
    straight to the node's stdout/stderr past the ROS log."""
    info, warn = [], []
    proc = LoopProcess(_config(weights_path="/nonexistent/w.pt"), LoopSettings(),
                       log=info.append, warn=warn.append)
    with pytest.raises(LoopProcessError, match=r"loop process failed to start: ValueError: "
                       r"parameter 'weights_path' = '/nonexistent/w.pt': no such file"):
        proc.start()
    assert not _segments(os.getpid()) and proc.proc.returncode == 1
    assert any("start failed:" in m for m in warn), warn
    assert any("no such file" in m for m in warn)  # the traceback, line by line
    assert all(m.startswith("[control loop process ") for m in info + warn), info + warn
    out, err = capfd.readouterr()
    assert "control loop process" not in out + err, out + err


@pytest.mark.slow
def test_child_messages_reach_the_log_callbacks() -> None:
    info, warn = [], []
    proc = LoopProcess(_config(), LoopSettings(period_s=2e-3), start_timeout_s=60.0,
                       log=info.append, warn=warn.append)
    try:
        proc.start()
        assert _wait(lambda: any("native tick:" in m for m in info), 10.0), (info, warn)
    finally:
        proc.close()


PARENT = textwrap.dedent("""
    import os, sys, time
    from kestrel_control.core.loop_process import LoopProcess, LoopSettings
    from kestrel_control.core.policy_runner import RunnerConfig
    from kestrel_models.control.policy import PolicyConfig
    cfg = RunnerConfig(joint_lower=[-1.0] * 6, joint_upper=[1.0] * 6, warmup_steps=1,
                       policy=PolicyConfig.tiny())
    proc = LoopProcess(cfg, LoopSettings(period_s=5e-3))
    proc.start()
    proc.activate(lambda r, c, s: None)
    print(proc.proc.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.slow
def test_killed_node_child_exits_and_unlinks_the_segment() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60.0)
        assert ready, "the parent process did not start its loop process within 60 s"
        child_pid = int(parent.stdout.readline())
        assert _segments(parent.pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)

        def child_gone() -> bool:
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                return True
            try:
                with open(f"/proc/{child_pid}/stat") as f:  # exited, not yet reaped by init
                    return f.read().split(") ")[1][0] == "Z"
            except FileNotFoundError:
                return True

        assert _wait(child_gone, 10.0), "loop process outlived its node"
        assert _wait(lambda: not _segments(parent.pid), 5.0), _segments(parent.pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)


@pytest.mark.slow
@pytest.mark.parametrize("native", [False, True], ids=["python_tick", "c_tick"])
def test_child_tick_on_shared_buffers_does_not_allocate(segment, native: bool) -> None:
    """The loop process's tick (runner on shared buffers, command write, eventfd) retains no
    memory in steady state, in Python and with the C tick (native_tick.py: prepare and finish
    in C around the CPU backend's step); the shared stats record into the segment."""
    import tracemalloc

    from kestrel_control.core.loop_child import _Tick

    _, _, views = segment
    runner = PolicyRunner(_config(num_robots=2), counters=views.stats,
                          buffers=list(zip(views.joint_states, views.targets, strict=True)))
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    tick = _Tick(runner, views, efd, native=native)
    if native and tick.native is None:
        pytest.skip(f"C tick unavailable: {tick.native_status}")
    js = np.zeros((2, N))
    try:
        for r in range(2):
            views.joint_states[r].write(js, time.time_ns())
        for _ in range(100):
            tick(0)
            views.stats.record(0.0, 1e-4, 1e-3)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(1000):
                tick(0)
                views.stats.record(0.0, 1e-4, 1e-3)
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert os.eventfd_read(efd) == 1100  # one notification per tick with commands
    finally:
        os.close(efd)
    assert after - before < 2048, f"{after - before} bytes retained over 1000 ticks"
    assert views.commands[1].version == 1100 and views.stats.cycles == 1100


def _thread_cpus(pid: int) -> dict[int, str]:
    out = {}
    for status in glob.glob(f"/proc/{pid}/task/*/status"):
        fields = dict(line.split(":", 1) for line in open(status).read().splitlines()
                      if ":" in line)
        out[int(status.split("/")[4])] = fields["Cpus_allowed_list"].strip()
    return out


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_only_the_loop_thread_runs_on_the_loop_cpu() -> None:
    """cpu_affinity [c]: the child's loop thread is pinned to c and every other thread of the
    child (main, torch/CUDA helpers) is kept off c, so nothing of ours preempts the loop."""
    loop_cpu = min(os.sched_getaffinity(0))
    proc = LoopProcess(_config(), LoopSettings(period_s=5e-3, cpu_affinity=(loop_cpu,)),
                       start_timeout_s=60.0)
    try:
        proc.start()
        proc.activate(lambda r, c, s: None)
        cpus = _thread_cpus(proc.proc.pid)
    finally:
        proc.close()
    on_loop = [tid for tid, c in cpus.items() if c == str(loop_cpu)]
    assert len(on_loop) == 1, cpus  # the loop thread alone
    for tid, c in cpus.items():
        if tid not in on_loop:
            assert str(loop_cpu) not in c.replace("-", ",").split(","), cpus


@pytest.mark.slow
def test_failed_activation_leaves_no_publisher_and_restores_the_gil_interval() -> None:
    """The child not answering 'activate' (timeout, death) must not leave the publisher thread
    or the node's GIL switch interval behind."""
    proc = LoopProcess(_config(), LoopSettings(period_s=2e-3, switch_interval_s=1e-4),
                       start_timeout_s=60.0)
    before = sys.getswitchinterval()
    try:
        proc.start()

        def no_answer(timeout, what):
            raise LoopProcessError(f"loop process did not answer '{what}'")

        proc._reply = no_answer
        with pytest.raises(LoopProcessError, match="did not answer 'activate'"):
            proc.activate(lambda r, c, s: None)
        assert proc._pub_thread is None
        assert sys.getswitchinterval() == before
    finally:
        del proc._reply
        proc.close()


@pytest.mark.parametrize("native", [False, True], ids=["python_tick", "c_tick"])
def test_reset_forgets_inputs_until_fresh_ones(segment, native: bool) -> None:
    """Activation (runner.reset) clears the shared input buffers: the joint state written
    before it, though still fresh by its stamp, gives no command, in Python and in the C tick;
    the first joint state written after it does."""
    from kestrel_control.core.loop_child import _Tick

    _, _, views = segment
    runner = PolicyRunner(_config(num_robots=2), counters=views.stats,
                          buffers=list(zip(views.joint_states, views.targets, strict=True)))
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    tick = _Tick(runner, views, efd, native=native)
    if native and tick.native is None:
        pytest.skip(f"C tick unavailable: {tick.native_status}")
    js = np.full((2, N), 0.1)
    try:
        for r in range(2):
            views.joint_states[r].write(js, time.time_ns())
            views.targets[r].write(np.full(N, 0.5), time.time_ns())
        for _ in range(5):
            tick(0)
        sent = [c.version for c in views.commands]
        assert sent == [5, 5]
        runner.reset()  # deactivate -> activate
        assert [b.version for b in views.joint_states] == [0, 0]
        for _ in range(5):
            tick(0)
        assert [c.version for c in views.commands] == sent  # nothing from before
        assert runner.robots[0].info.status is SafetyStatus.NO_INPUT
        views.joint_states[1].write(js, time.time_ns())  # robot 1 only: fresh input
        tick(0)
        assert [c.version for c in views.commands] == [sent[0], sent[1] + 1]
        assert np.all(runner.robots[1].target_now == 0.0)  # the old target is gone too
    finally:
        os.close(efd)
        runner.close()
