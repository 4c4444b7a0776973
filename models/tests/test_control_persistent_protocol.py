"""cuda_persistent's host side of the mailbox (persistent_step.py), on the CPU: a thread plays
the resident kernel's part (poll ctrl[REQ], answer, set ctrl[DONE]; retire by setting
ctrl[RETIRED]), so the request numbering, its wrap-around, the relaunch of a retired kernel
(also one that retired without seeing a posted request) and the fail-fast after a silent GPU
are tested without a GPU. The kernel itself is tested on the GPU (test_control_triton.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kestrel_models.control.persistent_step import (DONE, REQ, RETIRED, SEQ_MAX, STOP,
                                                    PersistentTritonBackend, _next_seq)


class FakeKernel(threading.Thread):
    """Serves requests seq0, seq0+1, ... like the kernel: out <- the request number, then DONE.
    Retires after `idle_s` without a request, or at once with `retire_at_start`."""

    def __init__(self, backend, seq0: int, idle_s: float, retire_at_start: bool) -> None:
        super().__init__(daemon=True)
        self.b, self.seq, self.idle_s, self.retire_at_start = backend, seq0, idle_s, \
            retire_at_start
        self.served: list[int] = []

    def run(self) -> None:
        ctrl = self.b._ctrl
        while not self.retire_at_start:
            t0 = time.monotonic()
            while ctrl[REQ] not in (self.seq, STOP) and time.monotonic() - t0 < self.idle_s:
                time.sleep(1e-5)
            if ctrl[REQ] != self.seq:
                break  # stop or idle retirement
            self.b.out_np[:] = self.seq
            self.served.append(self.seq)
            ctrl[DONE] = self.seq
            self.seq = _next_seq(self.seq)
        ctrl[RETIRED] = 1


def host_side(idle_s: float = 5.0, timeout_s: float = 2.0, first_retires: bool = False):
    """A PersistentTritonBackend without its GPU parts; `_launch` starts a FakeKernel."""
    b = PersistentTritonBackend.__new__(PersistentTritonBackend)
    b._ctrl = np.zeros(64, dtype=np.int32)
    b._reset_np = np.zeros(2, dtype=np.int32)
    b._mb = np.zeros(4, dtype=np.int64)  # host state (S_*), as __init__ makes it
    b._reset_pending = False
    b.out_np = np.zeros((2, 3), dtype=np.float32)
    b._next, b._error, b.timeout_s, b.relaunches = 1, "", timeout_s, -1
    b.kernels = []

    def launch() -> None:  # as the real _launch: previous kernel ended, serve b._next first
        if b.kernels:
            b.kernels[-1].join(timeout_s)
        b._ctrl[RETIRED] = 0
        b._ctrl[REQ] = 0
        k = FakeKernel(b, b._next, idle_s, retire_at_start=first_retires and not b.kernels)
        b.kernels.append(k)
        k.start()
        b.relaunches += 1

    b._launch = launch
    b._ctrl[RETIRED] = 1
    launch()
    return b


def _wait_for(cond, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "bounded wait expired"
        time.sleep(1e-3)


def test_each_step_gets_its_own_answer_and_numbers_wrap() -> None:
    b = host_side()
    for k in range(1, 51):
        b.step()
        assert b.out_np[0, 0] == k and b._ctrl[DONE] == k
    assert b.kernels[-1].is_alive() and b.relaunches == 0  # still resident, serving
    b._ctrl[REQ] = STOP
    b.kernels[-1].join(5.0)
    # near the int32 limit: SEQ_MAX, then 1
    b2 = host_side()
    b2.step()
    b2._ctrl[REQ] = STOP
    _wait_for(lambda: bool(b2._ctrl[RETIRED]))
    b2._next = SEQ_MAX
    b2.step()  # relaunched at SEQ_MAX
    assert b2.out_np[0, 0] == SEQ_MAX and b2._next == 1
    b2.step()
    assert b2._ctrl[DONE] == 1 and b2.relaunches == 1
    b2._ctrl[REQ] = STOP


def test_a_retired_kernel_is_relaunched_and_numbering_goes_on() -> None:
    b = host_side(idle_s=0.02)
    b.step()
    _wait_for(lambda: bool(b._ctrl[RETIRED]))  # idle retirement
    b.step()
    assert b.relaunches == 1 and b.out_np[0, 0] == 2
    assert b.kernels[0].served == [1] and b.kernels[1].served == [2]
    b._ctrl[REQ] = STOP


def test_a_kernel_that_retires_without_seeing_the_request_is_relaunched() -> None:
    """The race: the host posts while the kernel decides to retire (here: at once, never
    serving): the wait sees RETIRED with DONE still old, relaunches, and gets its answer."""
    b = host_side(first_retires=True)
    b.kernels[0].join(5.0)
    b._ctrl[RETIRED] = 0  # as if the host read RETIRED just before the kernel set it
    t = threading.Timer(0.01, lambda: b._ctrl.__setitem__(RETIRED, 1))
    t.start()
    b.step()
    t.join()
    assert b.out_np[0, 0] == 1 and b.relaunches == 1
    assert b.kernels[0].served == [] and b.kernels[1].served == [1]  # served once, not twice
    b._ctrl[REQ] = STOP


def test_a_silent_gpu_fails_the_step_then_every_later_step_fast() -> None:
    b = host_side(timeout_s=0.05)
    b._ctrl[REQ] = STOP  # the fake kernel ends...
    b.kernels[0].join(5.0)
    b._ctrl[RETIRED] = 0  # ...but the host believes it is resident: nobody will answer
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no answer from the GPU within 0.05 s"):
        b.step()
    assert time.monotonic() - t0 >= 0.05
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="stays failed"):
        b.step()
    assert time.monotonic() - t0 < 0.05


def test_reset_flags_are_cleared_after_the_step_that_applied_them() -> None:
    b = host_side()
    b.reset_state(1)
    assert list(b._reset_np) == [0, 1] and b._reset_pending
    b.step()
    assert list(b._reset_np) == [0, 0] and not b._reset_pending
    b.reset_state()  # all rows (the kernel is resident: no relaunch)
    assert list(b._reset_np) == [1, 1] and b.relaunches == 0
    b._ctrl[REQ] = STOP
