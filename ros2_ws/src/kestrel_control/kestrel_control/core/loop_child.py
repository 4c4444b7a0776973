"""The loop process of `loop.mode: process` (see loop_process.py): `python -m` this module.

No rclpy here. Protocol on stdin/stdout (loop_process.Channel): the node sends
{config: RunnerConfig, settings: LoopSettings, layout: ShmLayout}; this process attaches the
segment (shm_control.ShmSegment: no resource tracker), builds
the PolicyRunner on the shared buffers (policy load, backend warm-up / graph capture) and
answers ('ready', info) or ('error', message). Then commands: 'activate' (reset the policy state
and statistics, start the RealtimeLoop; answer ('active', applied settings)), 'deactivate'
(stop it; ('inactive', {})), 'exit'. It exits when stdin closes or the parent pid changes;
it ignores SIGINT (sent to the whole process group by Ctrl-C: the node decides).

Per tick (the loop thread): now = node clock (time.time_ns(), or the /clock value the node
writes into the segment under use_sim_time; 0 -> no command, counted), PolicyRunner.step_all,
each valid robot's command into its shared command buffer (stamp = now), then one eventfd
write to wake the node's publisher thread. With `native_tick` (default) the common case of
all that runs in one C call (native_tick.py) and Python runs only what C hands back.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback

from kestrel_common.shm import unlink_segment

from kestrel_control.core.loop_process import LOG_INFO, LOG_WARN, Channel
from kestrel_control.core.native_tick import (I_LATE_T0, KT_DONE, KT_PY_ALL, KT_PY_FINISH,
                                              KT_PY_INFER, KT_PY_LATE)
from kestrel_control.core.shm_control import (AUX_COMPUTE_LATENCY, CLOCK_SIM, CTRL_CLOCK_MODE,
                                              CTRL_COMMANDS, CTRL_NO_CLOCK, CTRL_SIM_TIME_NS,
                                              CTRL_STATE, STATE_READY, STATE_RUNNING,
                                              ShmSegment, ShmViews)


# How often the idle main thread wakes to check that the node is alive (the pipe's EOF is the
# normal signal). Every wake-up takes the GIL from the loop thread (a forced switch after the
# switch interval, then a cross-core hand-back); rare wake-ups keep that out of the loop's
# tail.
PARENT_CHECK_S = 30.0


def _log(message: str, warn: bool = False) -> None:
    """One message to the node's ROS log: stderr lines tagged with the level (the node's
    LoopProcess relays them, loop_process._relay_stderr)."""
    tag = LOG_WARN if warn else LOG_INFO
    text = "".join(f"{tag}[control loop process {os.getpid()}] {line}\n"
                   for line in str(message).splitlines() or [""])
    sys.stderr.write(text)
    sys.stderr.flush()


class _Tick:
    """The loop's step function (preallocated state; no allocation per call).

    native: run the tick's common case in C (native_tick.py); its status string says whether
    it could (`native_status`), else the Python tick runs."""

    def __init__(self, runner, views: ShmViews, event_fd: int, native: bool = False) -> None:
        self.runner, self.views, self.efd = runner, views, event_fd
        self.ctrl, self.aux = views.control, views.aux
        self.commands = views.commands
        self.sim = int(views.control[CTRL_CLOCK_MODE]) == CLOCK_SIM
        self.first_error = True
        self.native = None
        self.native_status = "off (parameter native_tick)"
        if native:
            from kestrel_control.core.native_tick import NativeTick, NativeUnavailable
            try:
                self.native = NativeTick(runner, views, event_fd)
                self.native_status = self.native.status
            except NativeUnavailable as exc:
                self.native_status = f"unavailable, the Python tick runs: {exc}"

    def __call__(self, deadline_ns: int) -> None:
        ctrl = self.ctrl
        now = int(ctrl[CTRL_SIM_TIME_NS]) if self.sim else time.time_ns()
        if now <= 0:  # use_sim_time and no /clock yet
            ctrl[CTRL_NO_CLOCK] += 1
            return
        native = self.native
        runner = self.runner
        # a backwards time jump: the inputs of before are forgotten (PolicyRunner.check_time),
        # which the C tick cannot see: Python until every robot has a joint state of after it
        if native is None or runner.check_time(now) or runner.after_jump:
            self._python(now)
            return
        code = native.tick(now)
        if code == KT_DONE:  # common case: the whole tick ran in C
            return
        if code == KT_PY_ALL:  # an input C does not take (none yet, stale, non-finite, ...)
            self._python(now)
            return
        # every robot prepared by C; the inference (or its end) and/or the finish are ours
        if code == KT_PY_INFER:
            runner._infer()
        elif code == KT_PY_LATE:
            runner._infer_late(int(native.ints[I_LATE_T0]))
        if code != KT_PY_FINISH and native.finish(now):
            return
        runner._finish_all(all_ready=True)
        self._write(runner.commands, runner._infos, now)

    def _python(self, now: int) -> None:
        commands, infos = self.runner.step_all(now)
        self._write(commands, infos, now)

    def _write(self, commands, infos, now: int) -> None:
        wrote = False
        for r, info in enumerate(infos):
            if info.valid:
                self.commands[r].write(commands[r], now)
                wrote = True
        self.aux[AUX_COMPUTE_LATENCY] = self.runner.compute_latency_s
        if wrote:
            self.ctrl[CTRL_COMMANDS] += 1
            os.eventfd_write(self.efd, 1)


def keep_off_loop_cpus(loop_cpus) -> str:
    """Move this (main) thread off the loop's CPUs before anything else starts threads: the CUDA
    driver's helper threads and torch's pools inherit the mask, so only the loop thread (which
    pins itself to `loop_cpus` at start) runs there. No-op when no CPU would be left."""
    if not loop_cpus:
        return "not requested"
    rest = set(os.sched_getaffinity(0)) - {int(c) for c in loop_cpus}
    if not rest:
        return f"kept (no CPU besides {sorted(loop_cpus)})"
    os.sched_setaffinity(0, rest)
    return f"applied (other threads on cpus {sorted(rest)})"


def serve(chan: Channel, shm_name: str, event_fd: int, parent_pid: int) -> int:
    setup = chan.recv(30.0)
    try:
        off_loop = keep_off_loop_cpus(setup["settings"].cpu_affinity)
        from kestrel_control.core.policy_runner import PolicyRunner
        from kestrel_control.core.rt_loop import RealtimeLoop

        config, settings, layout = setup["config"], setup["settings"], setup["layout"]
        views = ShmViews(ShmSegment(shm_name, layout.size, create=False).buf, layout)
        runner = PolicyRunner(config, counters=views.stats,
                              buffers=list(zip(views.joint_states, views.targets, strict=True)))
        tick = _Tick(runner, views, event_fd, native=settings.native_tick)
        _log(f"threads other than the loop kept off its cpus: {off_loop}")
        _log(f"native tick: {tick.native_status}")
        loop = RealtimeLoop(settings.period_s, tick, views.stats, spin_s=settings.spin_s,
                            rt_priority=settings.rt_priority,
                            cpu_affinity=list(settings.cpu_affinity),
                            lock_memory=settings.lock_memory, manage_gc=settings.manage_gc,
                            switch_interval_s=settings.switch_interval_s,
                            miss_attribution=settings.miss_attribution,
                            name="kestrel-control-loop", log=_log)
    except Exception as exc:  # reported to the node, which fails configure with it
        _log("start failed:\n" + traceback.format_exc(), warn=True)
        chan.send(("error", f"{type(exc).__name__}: {exc}"))
        return 1
    views.control[CTRL_STATE] = STATE_READY
    chan.send(("ready", {"pid": os.getpid(), "batch": runner.batch,
                         "source": runner.policy.source, "backend": runner.backend.name,
                         "compute_latency_s": runner.compute_latency_s,
                         "native_tick": tick.native_status}))
    try:
        while True:
            try:
                kind, _ = chan.recv(PARENT_CHECK_S)
            except TimeoutError:
                if os.getppid() != parent_pid:
                    _log("parent process is gone: exiting", warn=True)
                    unlink_segment(shm_name)  # the node died without its cleanup
                    return 0
                continue
            except EOFError:  # the node closed the pipe: it died, or it is exiting
                unlink_segment(shm_name)  # the node died without its cleanup
                return 0
            if kind == "activate":
                try:
                    runner.reset()
                    views.stats.reset()
                    applied = loop.start(timeout_s=30.0)
                    views.control[CTRL_STATE] = STATE_RUNNING
                    chan.send(("active", applied))
                except Exception as exc:
                    chan.send(("error", f"{type(exc).__name__}: {exc}"))
            elif kind == "deactivate":
                loop.stop(timeout_s=2.0)
                views.control[CTRL_STATE] = STATE_READY
                if loop.last_error:
                    _log(f"last step error: {loop.last_error}", warn=True)
                chan.send(("inactive", {}))
            elif kind == "exit":
                return 0
    finally:
        loop.stop(timeout_s=2.0)
        runner.close()  # cuda_persistent: end the resident kernel before os._exit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Kestrel control loop process (started by the node)")
    ap.add_argument("--shm", required=True)
    ap.add_argument("--event-fd", type=int, required=True)
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    # Ctrl-C / SIGINT to the process group is the node's to handle: it stops this process
    # through the pipe (or this process sees the pipe close when the node exits).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The protocol owns fds 0/1: anything printed goes to stderr (the node's log).
    chan = Channel(os.dup(0), os.dup(1))
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if os.getppid() != args.parent_pid:
        return 0
    try:
        return serve(chan, args.shm, args.event_fd, args.parent_pid)
    except (EOFError, BrokenPipeError):
        return 0


if __name__ == "__main__":
    _code = main()
    # Skip the interpreter's finalisation: torch/CUDA teardown can take seconds on a loaded
    # machine, and the node waits for this exit (bounded) on its own shutdown path. Nothing
    # here needs it: the shared memory is the node's to unlink, and stderr is flushed.
    sys.stderr.flush()
    os._exit(_code)
