"""The loop process's tick in C (`native_tick.c`), for its common case; Python for the rest.

Why: with a fast GPU step the host part of the tick (~20 numpy and Python calls) is a large
share of the tick, and the tick's tail comes from episodes where the machine runs all of it
slower (docs/benchmarks/control_h200.md). In C the same work is a few hundred
instructions, so the tick exposed to a slow episode is about the GPU step alone.

What runs in C (one ctypes call per tick, `kt_tick`): the joint-state and target seqlock reads,
the stale and finite checks, the latency compensation, the observation rows; with
`cuda_persistent` the request to the resident kernel and the wait for its answer, with
`cuda_graph` and `cuda_graph_triton` the graph launch and the stream
poll (CUDA driver API, libcuda loaded at run time, on torch's graph executable and stream: what
CUDAGraph.replay does for a graph without RNG state); the command
(the backend's in-graph post-processing, or positions + action_scale * tanh(actions) on the
host), the clamp to the joint limits (counted), the last safe command, the previous action, the
command into shared memory, the command counter and the eventfd that wakes the node's publisher.
Anything else returns a code and Python runs that part of the tick as before (loop_child._Tick):
no input, a stale or non-finite observation or action (counted and held by SafetyFilter), a
retired kernel, a late answer, a state reset, another backend's inference. The C side never
counts a safety event and never holds; tests compare it with the Python tick on the same inputs
(test_native_tick.py).

Build: the system C compiler (`$CC`, else `cc`) compiles the source once into
`$XDG_CACHE_HOME/kestrel/native/` (default ~/.cache/...) under a hash of the source and the
compiler; later processes load the cached library. No compiler, a failed build or buffers the C
side does not know (an in-process loop, other buffer types) -> `NativeUnavailable` with the
reason, and the loop process logs it and runs the Python tick. The ctypes binding is a PyDLL:
the GIL stays held during the call (as during the Python tick; no hand-off to another thread
in the middle of a tick).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

SOURCE = Path(__file__).with_name("native_tick.c")

# offsets of native_tick.c's ints[] / dbls[] (test_native_tick checks them against the source)
(I_ROBOTS, I_JOINTS, I_ACTIONS, I_OBS, I_OBS_STRIDE, I_ACT, I_ACT_STRIDE, I_POST,
 I_POST_STRIDE, I_LAT, I_COMPENSATE, I_CLAMP_CTR, I_CMD_CTR, I_AUX_LAT, I_EFD, I_MB_CTRL,
 I_MB_STATE, I_COMMANDS, I_LOWER, I_UPPER, I_READ_NS, I_SPIN_NS, I_LATE_T0, I_GRAPH_EXEC,
 I_STREAM, I_CU_CTX, I_PLAUS_C, I_PLAUS_H, I_TERMS, I_NTERMS, I_TERM_SCALE, I_DEFAULT_Q,
 I_ACT_MODE, I_PREV_COL, I_SCALES, I_GLOBAL) = range(36)
(R_JS_H, R_JS_S, R_TG_H, R_TG_S, R_CMD_H, R_CMD_S, R_INPUTS, R_TVER, R_LAST_SAFE,
 R_HAS_SAFE, R_JS_GOOD, R_JS_GVS, R_TG_GOOD, R_TG_GVS, R_SIZE) = range(15)
D_MAX_AGE, D_CLIP, D_SIZE = range(3)

# return codes: what Python still has to do for this tick
KT_DONE, KT_PY_ALL, KT_PY_INFER, KT_PY_LATE, KT_PY_FINISH = range(5)

# the persistent kernel's answer is waited for in C up to this long, then by Python's slow
# path (relaunch of a retired kernel, the backend's timeout); well above a normal answer
SPIN_NS = 200_000
# a seqlock read retries (writer mid-write) this long before Python's read takes over; far
# longer than a Python writer (the node's subscription callback) holds a slot
READ_NS = 20_000

_FLAGS = ["-O2", "-std=gnu11", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off",
          "-Wall"]


class NativeUnavailable(RuntimeError):
    """The C tick cannot be used here (the message says why); the Python tick runs instead."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kestrel" / "native"


def build_library(directory: Path | None = None, compiler: str | None = None) -> Path:
    """The compiled library's path, compiling it first if this source + compiler have no cached
    build. NativeUnavailable when there is no compiler or it fails."""
    cc = compiler or os.environ.get("CC") or "cc"
    exe = shutil.which(cc)
    if exe is None:
        raise NativeUnavailable(f"no C compiler ('{cc}' not found; set CC)")
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"C compiler '{exe}' does not run: {exc}") from exc
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + repr((version, _FLAGS, os.uname().machine)).encode())
    directory = directory or cache_dir()
    lib = directory / f"kestrel_native_tick_{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=directory)
        os.close(fd)
        done = subprocess.run([exe, *_FLAGS, "-o", tmp, str(SOURCE), "-lm", "-ldl"],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            os.unlink(tmp)
            raise NativeUnavailable(f"'{exe}' failed on {SOURCE.name}: "
                                    f"{(done.stderr or done.stdout).strip()[:400]}")
        os.replace(tmp, lib)  # atomic: another process may have built the same file meanwhile
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"could not build {SOURCE.name} in {directory}: {exc}") from exc
    return lib


def load(directory: Path | None = None, release_gil: bool = False) -> ctypes.CDLL:
    """The library with its four functions typed. release_gil: a CDLL (tests that serve the
    mailbox from a Python thread), else a PyDLL (the loop: the GIL stays held)."""
    path = build_library(directory)
    lib = (ctypes.CDLL if release_gil else ctypes.PyDLL)(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, args in (("kt_prepare", [p, p, i64]), ("kt_infer", [p, p]),
                       ("kt_finish", [p, p, i64]), ("kt_tick", [p, p, i64]),
                       ("kt_init_cuda", [p])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _f32_rows(name: str, a: Any) -> tuple[int, int]:
    """(address, row stride in elements) of a float32 [B, k] array with contiguous rows."""
    if not (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 2
            and a.strides[1] == 4):
        raise NativeUnavailable(f"the backend's {name} is not a float32 [B, k] array with "
                                "contiguous rows")
    return _ptr(a), a.strides[0] // 4


class NativeTick:
    """The C tick bound to one PolicyRunner and its loop process's shared memory.

    runner: a PolicyRunner built on the segment's buffers (loop_child), views: its ShmViews,
    event_fd: the node's eventfd (-1: none). NativeUnavailable if anything is not as the C side
    expects."""

    def __init__(self, runner: Any, views: Any, event_fd: int = -1,
                 directory: Path | None = None, release_gil: bool = False) -> None:
        from kestrel_control.core.shm_control import (AUX_COMPUTE_LATENCY, CTRL_COMMANDS,
                                                      SharedLatestValue, SharedLoopStats)

        if getattr(runner.io, "uses_ee", False):
            raise NativeUnavailable("the observation layout's ee_* terms need the arm's "
                                    "forward kinematics (Pinocchio), which runs in Python")
        if not isinstance(runner.counters, SharedLoopStats):
            raise NativeUnavailable("the safety counters are not in shared memory (the C tick "
                                    "serves the loop process only)")
        robots = runner.robots
        for r, robot in enumerate(robots):
            if not (isinstance(robot.joint_states, SharedLatestValue)
                    and isinstance(robot.target, SharedLatestValue)):
                raise NativeUnavailable(f"robot {r}'s input buffers are not shared-memory ones")
        backend = runner.backend
        n, a_dim = runner.num_joints, runner.num_actions
        ints = np.zeros(I_GLOBAL + R_SIZE * len(robots), dtype=np.int64)
        dbls = np.zeros(D_SIZE, dtype=np.float64)
        ints[I_ROBOTS], ints[I_JOINTS], ints[I_ACTIONS] = len(robots), n, a_dim
        ints[I_OBS], ints[I_OBS_STRIDE] = _f32_rows("obs_np", backend.obs_np)
        ints[I_ACT], ints[I_ACT_STRIDE] = _f32_rows("act_np", backend.act_np)
        post = runner._post
        if post is not None:
            ints[I_POST], ints[I_POST_STRIDE] = _f32_rows("post_np", post)
        ints[I_LAT] = _ptr(runner._lat)
        ints[I_COMPENSATE] = int(runner._compensate)
        stats_ints = runner.counters._ints
        ints[I_CLAMP_CTR] = _ptr(stats_ints) + 8 * type(runner.counters).COUNTERS.index(
            "clamped_actions")
        ints[I_CMD_CTR] = _ptr(views.control) + 8 * CTRL_COMMANDS
        ints[I_AUX_LAT] = _ptr(views.aux) + 8 * AUX_COMPUTE_LATENCY
        ints[I_EFD] = int(event_fd)
        lib = load(directory, release_gil=release_gil)
        step = "the step in Python"
        mailbox = getattr(backend, "mailbox", None)
        graph = getattr(backend, "graph_handles", None)
        if mailbox is not None:
            ctrl, state = mailbox()
            ints[I_MB_CTRL], ints[I_MB_STATE] = _ptr(ctrl), _ptr(state)
            self._mailbox = (ctrl, state)
            step = "the resident kernel's mailbox in C"
        elif graph is not None and graph() is not None:
            ints[I_GRAPH_EXEC], ints[I_STREAM] = graph()
            if lib.kt_init_cuda(_ptr(ints)):
                step = "graph launch + stream poll in C (CUDA driver API)"
            else:
                ints[I_GRAPH_EXEC] = 0
                step = "the step in Python (no CUDA driver entry points or context)"
        ints[I_COMMANDS] = _ptr(runner.commands)
        safety = robots[0].safety
        self._limits = (np.ascontiguousarray(safety.lower, np.float64),
                        np.ascontiguousarray(safety.upper, np.float64))
        ints[I_LOWER], ints[I_UPPER] = (_ptr(x) for x in self._limits)
        # plausible [pos | vel] (safety.py): |x - center| <= half, [2n] each; 0 = no check
        if safety._plaus_on:
            self._plaus = (np.ascontiguousarray(safety.plaus_center, np.float64),
                           np.ascontiguousarray(safety.plaus_half, np.float64))
            ints[I_PLAUS_C], ints[I_PLAUS_H] = (_ptr(x) for x in self._plaus)
        ints[I_READ_NS], ints[I_SPIN_NS] = READ_NS, SPIN_NS
        dbls[D_MAX_AGE] = safety.max_obs_age_s
        # the observation layout and action mapping (policy_io.py): the term table
        # [T, 4] = (source, column, length, relative), per-term scales, default_q [n] rad
        io = runner.io
        self._terms = np.array([(t.source, t.col, t.length, int(t.relative)) for t in io.terms],
                               dtype=np.int64).reshape(-1, 4)
        self._term_scale = np.array([t.scale for t in io.terms], dtype=np.float64)
        self._default_q = np.ascontiguousarray(io.default_q, dtype=np.float64)
        ints[I_TERMS], ints[I_NTERMS] = _ptr(self._terms), len(io.terms)
        ints[I_TERM_SCALE], ints[I_DEFAULT_Q] = _ptr(self._term_scale), _ptr(self._default_q)
        ints[I_ACT_MODE], ints[I_PREV_COL] = io.mode, io.last_action_col
        self._scales = np.ascontiguousarray(io.scales, dtype=np.float64)  # [n] per joint
        ints[I_SCALES] = _ptr(self._scales)
        dbls[D_CLIP] = io.action_clip
        for r, robot in enumerate(robots):
            base = I_GLOBAL + r * R_SIZE
            for k_h, buf in ((R_JS_H, robot.joint_states), (R_TG_H, robot.target),
                             (R_CMD_H, views.commands[r])):
                ints[base + k_h], ints[base + k_h + 1] = self._shared(buf)
            for name, arr, dtype in (("inputs", robot.inputs, np.float64),
                                     ("commands", runner.commands, np.float64),
                                     ("last safe command", robot.safety._last_safe, np.float64)):
                if not (arr.dtype == dtype and arr.flags.c_contiguous):
                    raise NativeUnavailable(f"robot {r}'s {name} is not a contiguous "
                                            f"{np.dtype(dtype).name} array")
            ints[base + R_INPUTS] = _ptr(robot.inputs)
            ints[base + R_TVER] = _ptr(runner._tver) + 8 * r
            ints[base + R_LAST_SAFE] = _ptr(robot.safety._last_safe)
            ints[base + R_HAS_SAFE] = _ptr(robot.safety._has)
            for k_good, buf in ((R_JS_GOOD, robot.joint_states), (R_TG_GOOD, robot.target)):
                ints[base + k_good], ints[base + k_good + 1] = (_ptr(buf._good),
                                                                _ptr(buf._good_vs))
        self.ints, self.dbls = ints, dbls
        self._keep = (runner, views)  # every address above stays valid while this lives
        self.lib = lib
        pi, pd = _ptr(ints), _ptr(dbls)
        tick, prep, fin, inf = lib.kt_tick, lib.kt_prepare, lib.kt_finish, lib.kt_infer
        self.tick = lambda now_ns: tick(pi, pd, now_ns)  # -> KT_* code
        self.prepare = lambda now_ns: prep(pi, pd, now_ns)  # -> 1 (every robot OK) / 0
        self.finish = lambda now_ns: fin(pi, pd, now_ns)  # -> 1 (done) / 0
        self.infer = lambda: inf(pi, pd)  # -> KT_DONE / KT_PY_INFER / KT_PY_LATE
        self.status = (f"on ({step}, {'in-graph' if post is not None else 'host'} command; "
                       f"{lib._name})")

    @staticmethod
    def _shared(buf: Any) -> tuple[int, int]:
        """(header address, slots address) of a SharedLatestValue with float64 slots."""
        s0, s1 = buf._slots
        if not (s0.dtype == np.float64 and s0.flags.c_contiguous
                and _ptr(s1) == _ptr(s0) + s0.nbytes and buf._h.dtype == np.int64
                and buf._good.dtype == np.float64 and buf._good.flags.c_contiguous):
            raise NativeUnavailable("a shared-memory buffer's layout is not the expected one")
        return _ptr(buf._h), _ptr(s0)
