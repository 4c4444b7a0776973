"""`cuda_persistent`: the reference policy step in ONE resident Triton kernel, served through a
mailbox in pinned host memory: no kernel launch, no graph replay and no stream sync per tick.

Why: a cuda_graph_triton tick is a little GPU work inside a larger share of graph launch,
completion and polling, and the launch/completion path is where the 1 kHz loop's tail lives
(docs/benchmarks/control_h200.md). Here the kernel is launched once and stays resident:

  host, step():  obs_host [B, D] float32 is written by the caller (pinned; the GPU reads it
                 through its mapping of host memory), then ctrl[REQ] = seq (a plain store; x86
                 keeps store order, so the observation is visible first), then the host spins on
                 ctrl[DONE] == seq (a numpy read of pinned memory per poll).
  GPU, one tick: program 0 polls ctrl[REQ] (ld.acquire.sys over PCIe), copies obs into device
                 memory, zeroes the state rows the host flagged in reset_host [B], and opens the
                 tick; then all P programs run, with a grid barrier between phases:
                   encoder layer k: rows of W_k . elu(LN_{k-1}(y_{k-1})) + b_k    (one per layer)
                   LSTM cell: each program owns hidden units (4 gate rows each) -> c, h'
                   program 0: head a = W_p h' + b_p, h <- h', the command post-processing exactly
                   as cuda_graph_triton (PostSpec) -> out_host (pinned) and finally
                   ctrl[DONE] = seq with st.release.sys (the results are visible first).
Grid barrier: an int64 counter in device memory, one red.release.gpu add per program (thread 0
after bar.sync) and ld.acquire.gpu polls until it reaches generation x P. Each program loads
its weight slice once, before the loop, and keeps it in registers.

Idle retirement: when no request comes for `idle_retire_s`, program 0 ends the kernel (GPU
global timer) and sets ctrl[RETIRED]; the next step() relaunches it (counted in `relaunches`,
one slower tick). So a deactivated node holds no SM. While resident the kernel holds P SMs
(default 64) and busy-polls: a device-wide synchronisation in the same
process (torch.cuda.synchronize, empty_cache) waits until the kernel retires or `close()` —
the backend is meant for the control node's own loop process (process mode).

Dims come from the policy: 1 to 3 encoder layers (Linear/LayerNorm/ELU), a 1-layer LSTM and a
linear head (the kestrel ActorCritic step, lowered by triton_step._lower); fp32 weights and plain
fp32 FMA reductions, so actions agree with fp32 eager within the cuda_graph tolerance (1e-4).
Needs triton and CUDA, else BackendUnavailable with the reason. The kernel itself is in
persistent_kernel.py; this module is its protocol, layout and host side.
"""

from __future__ import annotations

import time
import weakref

import numpy as np
import torch

from kestrel_models.control.runtimes import (BackendUnavailable, PolicyBackend, PostSpec,
                                             StepPolicy)
from kestrel_models.control.triton_step import _lower, _pow2, check_triton, triton

NAME = "cuda_persistent"
REQ, DONE, RETIRED = 0, 16, 32  # int32 slots of ctrl, 64 bytes apart (own cache lines)
STOP = -1  # ctrl[REQ] value that ends the kernel (close())
# host state (int64 [4], `_mb`), shared with the loop process's C tick (native_tick.c): the next
# request number, a state reset pending, the backend failed, the number of a late request
S_NEXT, S_RESET, S_FAILED, S_LATE = 0, 1, 2, 3
SEQ_MAX = 2**31 - 1  # request numbers run 1 .. SEQ_MAX, then wrap to 1
MAX_LAYERS = 3


def check_persistent() -> None:
    """Configure-time check: BackendUnavailable naming the parameter when it cannot run here."""
    check_triton(NAME)


def _next_seq(seq: int) -> int:
    return 1 if seq >= SEQ_MAX else seq + 1


def plan_programs(dims: list[int], hidden: int, programs: int) -> dict:
    """Rows per program for each encoder layer and hidden units per program for the LSTM, so
    that `programs` programs cover every layer; and num_warps so that the weight slice held in
    registers stays near 64 floats per thread. dims: [obs_dim, N_1, .., N_L]."""
    rows = [_pow2(-(-n // programs)) for n in dims[1:]]
    units = _pow2(-(-hidden // programs))
    floats = sum(r * _pow2(k) for r, k in zip(rows, dims[:-1], strict=True))
    floats += 4 * units * (_pow2(dims[-1]) + _pow2(hidden))
    warps = 4
    while warps < 16 and floats > warps * 32 * 64:
        warps *= 2
    return {"rows": rows, "units": units, "num_warps": warps}


if triton is not None:
    from kestrel_models.control.persistent_kernel import _persistent_kernel


def _stop(ctrl: np.ndarray, stream: torch.cuda.Stream, timeout_s: float = 2.0) -> None:
    """Ask a resident kernel to end and wait (bounded) for it: close() and the finalizer."""
    if ctrl[RETIRED]:
        return
    ctrl[REQ] = STOP
    end = time.monotonic() + timeout_s
    while not stream.query() and time.monotonic() < end:
        time.sleep(1e-4)


class PersistentTritonBackend(PolicyBackend):
    """The policy step as one resident kernel served through pinned-memory flags (see module
    docstring). `post_np` [B, n + 2] float32 (with a PostSpec) else None; `relaunches` counts
    kernel launches after the first (idle retirements)."""

    name = NAME
    device = torch.device("cuda")

    def __init__(self, policy: StepPolicy, batch: int, post: PostSpec | None = None,
                 programs: int = 64, idle_retire_s: float = 1.0, timeout_s: float = 1.0,
                 backoff_ns: int = 0) -> None:
        check_persistent()
        super().__init__(policy, batch)
        enc, (self.wih, self.whh, self.bias4), (self.wp, self.bp) = _lower(policy, NAME)
        if len(enc) > MAX_LAYERS:
            raise BackendUnavailable(f"parameter 'backend' = {NAME!r}: at most {MAX_LAYERS} "
                                     f"encoder layers (this policy has {len(enc)})")
        B, A, D = self.batch, policy.num_actions, policy.obs_dim
        H = self.whh.shape[1]
        if enc[0][0].shape[1] != D or self.wp.shape[0] != A:
            raise BackendUnavailable(f"parameter 'backend' = {NAME!r}: module dims do not match "
                                     f"obs_dim {D} / num_actions {A}")
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if not 1 <= programs <= sms:
            raise ValueError(f"parameter 'programs' = {programs}: must be in [1, {sms}] (the "
                             "GPU's SM count: every program must be resident at once)")
        if not 0.0 < idle_retire_s <= 60.0 or not 0.0 < timeout_s <= 60.0:
            raise ValueError(f"parameters 'idle_retire_s' = {idle_retire_s}, 'timeout_s' = "
                             f"{timeout_s}: must be in (0, 60] s")
        n = 0
        if post is not None:
            n = post.num_joints
            if not 1 <= n <= min(A, D):
                raise ValueError(f"parameter 'num_joints' = {n}: must be in [1, {min(A, D)}]")
        self.post, self._n, self._out_w = post, n, A + (n + 2 if post is not None else 0)
        self.programs, self.timeout_s = int(programs), float(timeout_s)
        dev, zeros = "cuda", torch.zeros
        # pinned host memory the kernel reads/writes through its mapping (UVA)
        self._ctrl_t = zeros(64, dtype=torch.int32, pin_memory=True)  # REQ, DONE, RETIRED
        self._reset_t = zeros(B, dtype=torch.int32, pin_memory=True)  # 1: zero this row's state
        self.out_host = zeros(B, self._out_w, pin_memory=True)  # actions | command | flags
        self._ctrl, self._reset_np = self._ctrl_t.numpy(), self._reset_t.numpy()
        self.out_np = self.out_host.numpy()
        self.act_host = self.out_host[:, :A]
        self.act_np = self.out_np[:, :A]  # [B, A] view
        self.post_np = self.out_np[:, A:] if post is not None else None  # [B, n + 2] view
        self._mb = np.zeros(4, dtype=np.int64)  # S_* (host state, see mailbox())
        # device scratch: barrier counter, tick command, staged obs, layer outputs, h, c, h'
        self._bar = zeros(1, dtype=torch.int64, device=dev)
        self._cmd = zeros(1, dtype=torch.int32, device=dev)
        self.obs_dev = zeros(B, D, device=dev)
        self._ys = [zeros(B, w.shape[0], device=dev) for w, *_ in enc]
        self.h, self.c, self._hnew = (zeros(B, H, device=dev) for _ in range(3))
        self.states = [self.h, self.c]
        lo = _f32(post.lower if post else [0.0])  # [n] rad
        hi = _f32(post.upper if post else [0.0])
        dims = [D] + [w.shape[0] for w, *_ in enc]
        plan = plan_programs(dims, H, self.programs)
        layers = enc + [enc[-1]] * (MAX_LAYERS - len(enc))  # unused slots: any valid tensors
        ys = self._ys + [self._ys[-1]] * (MAX_LAYERS - len(enc))
        rows = plan["rows"] + [1] * (MAX_LAYERS - len(enc))
        dims3 = dims + [dims[-1]] * (MAX_LAYERS - len(enc))
        lay_args, eps = [], []
        for (w, b, g, beta, e), y in zip(layers, ys, strict=True):
            lay_args += [w, b, g, beta, y]
            eps.append(e)
        self._args = [self._ctrl_t, self._reset_t, self.obs_host, self.out_host, self._bar,
                      self._cmd, self.obs_dev, *lay_args, self.wih, self.whh, self.bias4,
                      self.h, self.c, self._hnew, self.wp, self.bp, lo, hi, *eps,
                      float(post.action_scale) if post else 0.0]
        self._idle_ns = int(idle_retire_s * 1e9)
        self._meta = dict(
            B=B, P=self.programs, NL=len(enc), D=D, D_P=_pow2(D),
            N1=dims3[1], N1_P=_pow2(dims3[1]), N2=dims3[2], N2_P=_pow2(dims3[2]),
            N3=dims3[3], N3_P=_pow2(dims3[3]), R1=rows[0], R2=rows[1], R3=rows[2],
            K=dims[-1], K_P=_pow2(dims[-1]), H=H, H_P=_pow2(H), RH=plan["units"], A=A,
            A_P=max(2, _pow2(A)), NJ=max(n, 1), OUT_W=self._out_w, POST=post is not None,
            SLEEP_ASM=f"nanosleep.u32 {int(backoff_ns)};\n\tmov.u32 $0, 0;" if backoff_ns > 0
            else "", num_warps=plan["num_warps"])
        self._stream = torch.cuda.Stream()  # torch's pool streams are non-blocking: the
        # legacy default stream does not wait for the resident kernel
        self._next = 1
        self._error = ""  # set when the GPU stopped answering: every later step fails fast
        self.relaunches = -1
        self._ctrl[RETIRED] = 1  # not running yet
        self._finalizer = weakref.finalize(self, _stop, self._ctrl, self._stream)
        self._launch()

    def _launch(self) -> None:
        """Start the kernel (the previous one has ended); it serves request self._next first."""
        end = time.monotonic() + self.timeout_s
        while not self._stream.query():
            if time.monotonic() > end:
                raise RuntimeError(f"{NAME}: the previous kernel did not end within "
                                   f"{self.timeout_s} s")
        self._ctrl[RETIRED] = 0
        self._ctrl[REQ] = 0
        with torch.cuda.stream(self._stream):
            self._bar.zero_()
            _persistent_kernel[(self.programs,)](*self._args, self._next, self._idle_ns,
                                                 **self._meta)
        self.relaunches += 1

    # request numbering and the reset flag live in `_mb`, which the C tick also reads/writes
    @property
    def _next(self) -> int:
        return int(self._mb[S_NEXT])

    @_next.setter
    def _next(self, seq: int) -> None:
        self._mb[S_NEXT] = seq

    @property
    def _reset_pending(self) -> bool:
        return bool(self._mb[S_RESET])

    @_reset_pending.setter
    def _reset_pending(self, pending: bool) -> None:
        self._mb[S_RESET] = int(pending)

    def mailbox(self) -> tuple[np.ndarray, np.ndarray]:
        """(ctrl int32 [64] in pinned memory: REQ/DONE/RETIRED, host state int64 [4]: S_*) for
        the loop process's C tick (native_tick.c), which posts a request and waits for its
        answer itself when the kernel is resident, no reset is pending and the backend has not
        failed; else it leaves the step to step(). A request it gave up on (no answer within
        its spin limit) is finished by `finish_late()`."""
        return self._ctrl, self._mb

    def step(self) -> None:
        if self._error:
            raise RuntimeError(self._error)
        ctrl, mb = self._ctrl, self._mb
        if ctrl[RETIRED]:
            self._launch()
        seq = int(mb[S_NEXT])
        mb[S_NEXT] = _next_seq(seq)
        ctrl[REQ] = seq  # after the caller's obs_host writes (x86: stores stay in order)
        spins = 0
        while ctrl[DONE] != seq:
            spins += 1
            if spins & 1023 == 0:
                self._slow_wait(seq)
                break
        if mb[S_RESET]:
            self._reset_np[:] = 0
            mb[S_RESET] = 0

    def finish_late(self) -> None:
        """Finish the step whose request the C tick posted and gave up waiting for (its number
        in `_mb[S_LATE]`): wait, relaunch or fail as step() does."""
        seq = int(self._mb[S_LATE])
        if self._ctrl[DONE] != seq:
            self._slow_wait(seq)

    def _slow_wait(self, seq: int) -> None:
        """The answer is late (> ~1024 polls): relaunch a kernel that retired before seeing the
        request, or give up after timeout_s."""
        ctrl, end = self._ctrl, time.monotonic() + self.timeout_s
        while ctrl[DONE] != seq:
            if ctrl[RETIRED] and ctrl[DONE] != seq:  # re-read: DONE is written before RETIRED
                self._next = seq
                self._launch()
                self._next = _next_seq(seq)
                ctrl[REQ] = seq
            if time.monotonic() > end:
                self._error = (f"{NAME}: no answer from the GPU within {self.timeout_s} s; the "
                               "backend stays failed (reconfigure the node)")
                self._mb[S_FAILED] = 1
                raise RuntimeError(self._error)

    def reset_state(self, index: int | None = None) -> None:
        """Zero row `index`'s (None: every row's) h and c at the start of the next step. A full
        reset (the node's activation) also relaunches a retired kernel now, so that the first
        tick after it does not pay the launch."""
        if index is None:
            self._reset_np[:] = 1
            if self._ctrl[RETIRED]:
                self._launch()
        else:
            self._reset_np[index] = 1
        self._reset_pending = True

    def close(self) -> None:
        """End the resident kernel (bounded wait); a later step() launches it again."""
        _stop(self._ctrl, self._stream)
        self._ctrl[RETIRED] = 1


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device="cuda")


def create_persistent_backend(policy: StepPolicy, batch: int, *, post: PostSpec | None = None,
                              programs: int = 64, **_: object) -> PersistentTritonBackend:
    """The registry's factory (registry.py)."""
    return PersistentTritonBackend(policy, batch, post=post, programs=programs)
