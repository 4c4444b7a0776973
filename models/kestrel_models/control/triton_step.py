"""`cuda_graph_triton`: the reference policy step as a few fused Triton kernels in one CUDA graph.

The graph of one tick (batch B, the reference sizes obs 256 -> 512 -> 256, LSTM 256, 12 actions):
  H2D copy   obs_host [B, D] (pinned) -> obs_dev
  kernel 1   y1 = W1 obs + b1                                      [B, 512], pre-LayerNorm
  kernel 2   y2 = W2 elu(LN1(y1)) + b2                             [B, 256]
             (the previous layer's LayerNorm + ELU is recomputed in each program's prologue:
             the input vector is <= 512 floats, cheaper than another launch)
  kernel 3   LSTM cell on x = elu(LN2(y2)): each program owns a block of hidden units and
             computes their 4 gate rows (W_ih x + W_hh h + b_ih + b_hh, order i, f, g, o) and
             the cell update; c is updated in place (only its owner reads it), h' goes to a
             scratch buffer (every program reads all of h)
  kernel 4   policy head a = W_p h' + b_p [B, A], h <- h' (the state copy-back, free here), and
             with a PostSpec the command post-processing:
             command = clamp(obs[:, :n] + action_scale * tanh(a[:, :n]), lower, upper) and per
             row flags (every action finite, any joint clamped)
  D2H copy   out_dev [B, A (+ n + 2)] -> one pinned host buffer; `act_np` [B, A] and `post_np`
             [B, n + 2] (command rad | all-finite flag | clamped flag) are views of it
Dims come from the policy (any number of encoder layers: one kernel each). Weights stay fp32;
the dot products are plain fp32 FMA reductions (no TF32), so actions agree with fp32 eager
within the cuda_graph backend's stated 1e-4 (different summation order only).

Triton is optional: without it (or without CUDA) `check_triton()` raises BackendUnavailable with
the reason. Only the kestrel ActorCritic step (Linear/LayerNorm/ELU encoder + LSTM + linear
head, `StepModule`) can be lowered; other policies are refused with a message naming the backend.
"""

from __future__ import annotations

import torch

from kestrel_models.control.runtimes import (BackendUnavailable, PolicyBackend, PostSpec,
                                             StepPolicy, graph_handles)

NAME = "cuda_graph_triton"

try:  # optional: the CI machine has neither triton nor a GPU
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    _TRITON_ERROR = ""
except Exception as exc:  # ImportError, or a broken install
    triton = tl = libdevice = None
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"


def check_triton(name: str = NAME) -> None:
    """Configure-time check: BackendUnavailable naming the parameter (backend `name`, a Triton
    backend) when it cannot run here."""
    if triton is None:
        raise BackendUnavailable(f"parameter 'backend' = {name!r}: the triton package is not "
                                 f"usable here ({_TRITON_ERROR}); use 'cuda_graph'")
    if not torch.cuda.is_available():
        raise BackendUnavailable(f"parameter 'backend' = {name!r}: CUDA is not available")


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _rows_per_program(rows: int, width_p: int, gates: int = 1) -> int:
    """Rows per program: enough programs to spread the weight reads over the SMs (~128),
    a tile of at most 8192 floats."""
    block = max(1, _pow2(-(-rows // 128)))
    while block > 1 and block * width_p * gates > 8192:
        block //= 2
    return block


if triton is not None:

    @triton.jit
    def _ln_elu(x, ks, kmask, g_ptr, beta_ptr, K, eps):
        """LayerNorm (biased variance, affine) then ELU(alpha=1) of one row x [K_P] (masked)."""
        g = tl.load(g_ptr + ks, mask=kmask, other=0.0)
        beta = tl.load(beta_ptr + ks, mask=kmask, other=0.0)
        mean = tl.sum(x, 0) / K
        d = tl.where(kmask, x - mean, 0.0)
        var = tl.sum(d * d, 0) / K
        xn = d * (1.0 / tl.sqrt(var + eps)) * g + beta
        xn = tl.where(xn > 0.0, xn, libdevice.expm1(xn))
        return tl.where(kmask, xn, 0.0)

    @triton.jit
    def _linear_kernel(x_ptr, g_ptr, beta_ptr, w_ptr, bias_ptr, y_ptr, K, N, eps,
                       B: tl.constexpr, K_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       NORM: tl.constexpr):
        """y[b, rows] = W[rows] . f(x[b]) + bias[rows]; f = LN+ELU (NORM) or identity.
        x: [B, K], W: [N, K], y: [B, N], all fp32 contiguous."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rmask = rows < N
        ks = tl.arange(0, K_P)
        kmask = ks < K
        w = tl.load(w_ptr + rows[:, None] * K + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_N, K_P]
        bias = tl.load(bias_ptr + rows, mask=rmask, other=0.0)
        for b in tl.static_range(B):
            x = tl.load(x_ptr + b * K + ks, mask=kmask, other=0.0)  # [K_P]
            if NORM:
                x = _ln_elu(x, ks, kmask, g_ptr, beta_ptr, K, eps)
            y = tl.sum(w * x[None, :], 1) + bias
            tl.store(y_ptr + b * N + rows, y, mask=rmask)

    @triton.jit
    def _lstm_kernel(x_ptr, g_ptr, beta_ptr, wih_ptr, whh_ptr, bias_ptr, h_ptr, c_ptr,
                     hout_ptr, K, H, eps, B: tl.constexpr, K_P: tl.constexpr,
                     H_P: tl.constexpr, BLOCK_H: tl.constexpr):
        """One LSTM cell step for hidden units `units` of every row: x = elu(LN(y_prev[b])),
        gates = W_ih x + W_hh h + bias (bias = b_ih + b_hh, [4H], order i, f, g, o);
        c[b, units] updated in place, h'[b, units] -> hout."""
        units = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        umask = units < H
        ks = tl.arange(0, K_P)
        kmask = ks < K
        hs = tl.arange(0, H_P)
        hmask = hs < H
        mk = umask[:, None] & kmask[None, :]
        mh = umask[:, None] & hmask[None, :]
        ri = units[:, None]
        wxi = tl.load(wih_ptr + ri * K + ks[None, :], mask=mk, other=0.0)
        wxf = tl.load(wih_ptr + (ri + H) * K + ks[None, :], mask=mk, other=0.0)
        wxg = tl.load(wih_ptr + (ri + 2 * H) * K + ks[None, :], mask=mk, other=0.0)
        wxo = tl.load(wih_ptr + (ri + 3 * H) * K + ks[None, :], mask=mk, other=0.0)
        whi = tl.load(whh_ptr + ri * H + hs[None, :], mask=mh, other=0.0)
        whf = tl.load(whh_ptr + (ri + H) * H + hs[None, :], mask=mh, other=0.0)
        whg = tl.load(whh_ptr + (ri + 2 * H) * H + hs[None, :], mask=mh, other=0.0)
        who = tl.load(whh_ptr + (ri + 3 * H) * H + hs[None, :], mask=mh, other=0.0)
        bi = tl.load(bias_ptr + units, mask=umask, other=0.0)
        bf = tl.load(bias_ptr + H + units, mask=umask, other=0.0)
        bg = tl.load(bias_ptr + 2 * H + units, mask=umask, other=0.0)
        bo = tl.load(bias_ptr + 3 * H + units, mask=umask, other=0.0)
        for b in tl.static_range(B):
            x = _ln_elu(tl.load(x_ptr + b * K + ks, mask=kmask, other=0.0), ks, kmask, g_ptr,
                        beta_ptr, K, eps)[None, :]
            h = tl.load(h_ptr + b * H + hs, mask=hmask, other=0.0)[None, :]
            gi = tl.sum(wxi * x, 1) + tl.sum(whi * h, 1) + bi
            gf = tl.sum(wxf * x, 1) + tl.sum(whf * h, 1) + bf
            gg = tl.sum(wxg * x, 1) + tl.sum(whg * h, 1) + bg
            go = tl.sum(wxo * x, 1) + tl.sum(who * h, 1) + bo
            c = tl.load(c_ptr + b * H + units, mask=umask, other=0.0)
            c2 = tl.sigmoid(gf) * c + tl.sigmoid(gi) * libdevice.tanh(gg)
            h2 = tl.sigmoid(go) * libdevice.tanh(c2)
            tl.store(c_ptr + b * H + units, c2, mask=umask)
            tl.store(hout_ptr + b * H + units, h2, mask=umask)

    @triton.jit
    def _head_row(hnew_ptr, h_ptr, w, bias, obs_ptr, lo, hi, out_ptr, b, hs, hmask, acts,
                  amask, jmask, H, A, NJ, D, OUT_W, scale, POST: tl.constexpr,
                  CACHE: tl.constexpr):
        """Row b of the head: h' = hnew[b] (loaded with cache modifier CACHE) is copied back
        to h[b]; a = w h' + bias -> out[b, :A]; with POST out[b, A:A+NJ] = clamp(obs[b, :NJ] +
        scale * tanh(a[:NJ]), lo, hi), out[b, A+NJ] = every action finite (1/0),
        out[b, A+NJ+1] = some joint clamped (1/0). w [A_P, H_P], bias/lo/hi [A_P] in registers.
        Shared by _head_post_kernel and the persistent kernel (persistent_kernel.py)."""
        h = tl.load(hnew_ptr + b * H + hs, mask=hmask, other=0.0, cache_modifier=CACHE)
        tl.store(h_ptr + b * H + hs, h, mask=hmask)  # the state copy-back
        a = tl.sum(w * h[None, :], 1) + bias  # [A_P]
        tl.store(out_ptr + b * OUT_W + acts, a, mask=amask)
        if POST:
            # a - a is 0 for finite a, NaN for NaN/inf (no fast-math in Triton)
            bad = tl.sum(tl.where(amask & ((a - a) != 0.0), 1, 0), 0)
            pos = tl.load(obs_ptr + b * D + acts, mask=jmask, other=0.0)
            raw = pos + scale * libdevice.tanh(a)
            # where-based clamp: NaN stays NaN, as torch.maximum/minimum propagate it
            cmd = tl.where(raw < lo, lo, tl.where(raw > hi, hi, raw))
            clamped = tl.sum(tl.where(jmask & (cmd != raw), 1, 0), 0)
            tl.store(out_ptr + b * OUT_W + A + acts, cmd, mask=jmask)
            tl.store(out_ptr + b * OUT_W + A + NJ, tl.where(bad == 0, 1.0, 0.0))
            tl.store(out_ptr + b * OUT_W + A + NJ + 1, tl.where(clamped > 0, 1.0, 0.0))

    @triton.jit
    def _head_post_kernel(hnew_ptr, h_ptr, w_ptr, bias_ptr, obs_ptr, lo_ptr, hi_ptr, out_ptr,
                          H, A, NJ, D, OUT_W, scale, B: tl.constexpr, H_P: tl.constexpr,
                          A_P: tl.constexpr, POST: tl.constexpr):
        """One program: actions a = W h' + bias -> out[b, :A]; h <- h'; with POST
        out[b, A:A+NJ] = clamp(obs[b, :NJ] + scale * tanh(a[:NJ]), lo, hi), out[b, A+NJ] =
        every action finite (1/0), out[b, A+NJ+1] = some joint clamped (1/0)."""
        hs = tl.arange(0, H_P)
        hmask = hs < H
        acts = tl.arange(0, A_P)
        amask = acts < A
        w = tl.load(w_ptr + acts[:, None] * H + hs[None, :],
                    mask=amask[:, None] & hmask[None, :], other=0.0)  # [A_P, H_P]
        bias = tl.load(bias_ptr + acts, mask=amask, other=0.0)
        jmask = acts < NJ
        lo = tl.load(lo_ptr + acts, mask=jmask, other=0.0)
        hi = tl.load(hi_ptr + acts, mask=jmask, other=0.0)
        for b in tl.static_range(B):
            _head_row(hnew_ptr, h_ptr, w, bias, obs_ptr, lo, hi, out_ptr, b, hs, hmask, acts,
                      amask, jmask, H, A, NJ, D, OUT_W, scale, POST, "")


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cuda", dtype=torch.float32).contiguous()


def _lower(policy: StepPolicy, name: str = NAME) -> tuple[list[tuple], tuple, tuple]:
    """Weights of the kestrel step module as fp32 CUDA tensors: encoder layers
    [(W [N, K], b [N], gamma [N], beta [N], eps)], LSTM (W_ih [4H, K], W_hh [4H, H],
    b_ih + b_hh [4H]), head (W [A, H], b [A]). BackendUnavailable for anything else."""
    from torch import nn

    mod = policy.fused_module if policy.fused_module is not None else policy.module
    why = f"parameter 'backend' = {name!r}: needs the kestrel ActorCritic step ({policy.source})"
    for attr in ("encoder", "lstm", "policy_head"):
        if not isinstance(getattr(mod, attr, None), nn.Module):
            raise BackendUnavailable(why)
    layers = list(mod.encoder)
    if not layers or len(layers) % 3:
        raise BackendUnavailable(why + ": encoder is not Linear/LayerNorm/ELU triples")
    enc = []
    for lin, norm, act in zip(layers[0::3], layers[1::3], layers[2::3], strict=True):
        if not (isinstance(lin, nn.Linear) and lin.bias is not None
                and isinstance(norm, nn.LayerNorm) and norm.elementwise_affine
                and norm.bias is not None and len(norm.normalized_shape) == 1
                and isinstance(act, nn.ELU) and act.alpha == 1.0):
            raise BackendUnavailable(why + ": encoder is not Linear/LayerNorm/ELU triples")
        enc.append((_f32(lin.weight), _f32(lin.bias), _f32(norm.weight), _f32(norm.bias),
                    float(norm.eps)))
    lstm, head = mod.lstm, mod.policy_head
    if not (isinstance(lstm, nn.LSTM) and lstm.num_layers == 1 and lstm.bias
            and not lstm.bidirectional and getattr(lstm, "proj_size", 0) == 0
            and isinstance(head, nn.Linear) and head.bias is not None):
        raise BackendUnavailable(why + ": needs a 1-layer LSTM with biases and a linear head")
    cell = (_f32(lstm.weight_ih_l0), _f32(lstm.weight_hh_l0),
            _f32(lstm.bias_ih_l0.detach() + lstm.bias_hh_l0.detach()))
    return enc, cell, (_f32(head.weight), _f32(head.bias))


class TritonGraphBackend(PolicyBackend):
    """H2D copy -> one Triton kernel per encoder layer, one LSTM kernel, one head (+ post)
    kernel -> one D2H copy, captured in one CUDA graph; a tick = replay + poll (see module
    docstring). `post_np` [B, n + 2] float32 (with a PostSpec) else None."""

    name = NAME
    device = torch.device("cuda")

    def __init__(self, policy: StepPolicy, batch: int, post: PostSpec | None = None) -> None:
        check_triton()
        super().__init__(policy, batch)
        self.enc, (self.wih, self.whh, self.bias4), (self.wp, self.bp) = _lower(policy)
        B, A, D = self.batch, policy.num_actions, policy.obs_dim
        H = self.whh.shape[1]
        if self.enc[0][0].shape[1] != D or self.wp.shape[0] != A:
            raise BackendUnavailable(f"parameter 'backend' = {NAME!r}: module dims do not match "
                                     f"obs_dim {D} / num_actions {A}")
        self.post = post
        n = 0
        if post is not None:
            n = post.num_joints
            if not 1 <= n <= min(A, D):
                raise ValueError(f"parameter 'num_joints' = {n}: must be in [1, {min(A, D)}]")
        self._n, self._out_w = n, A + (n + 2 if post is not None else 0)
        dev = "cuda"
        zeros = torch.zeros
        # static device buffers: obs [B, D]; per layer output [B, N]; h, c, h' [B, H]; out
        self.obs_dev = zeros(B, D, device=dev)
        self._ys = [zeros(B, w.shape[0], device=dev) for w, *_ in self.enc]
        self.h, self.c, self._hnew = (zeros(B, H, device=dev) for _ in range(3))
        self.states = [self.h, self.c]
        self._out_dev = zeros(B, self._out_w, device=dev)
        self._lo = _f32(torch.tensor(post.lower if post else [0.0]))  # [n] rad
        self._hi = _f32(torch.tensor(post.upper if post else [0.0]))  # [n] rad
        self._scale = float(post.action_scale) if post else 0.0
        # one pinned host buffer for everything read back: actions | command | flags
        self.out_host = zeros(B, self._out_w, pin_memory=True)
        self.out_np = self.out_host.numpy()
        self.act_host = self.out_host[:, :A]
        self.act_np = self.out_np[:, :A]  # [B, A] view
        self.post_np = self.out_np[:, A:] if post is not None else None  # [B, n + 2] view
        self._launches = self._plan(H)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # compile + warm up outside the capture
                self._tick_ops()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._tick_ops()
        self._stream = torch.cuda.current_stream()
        self.reset_state()
        torch.cuda.synchronize()

    def _plan(self, H: int) -> list:
        """(kernel, grid, args, meta) per launch, fixed at construction."""
        B, plan = self.batch, []
        x, norm = self.obs_dev, None
        for (w, b, g, beta, eps), y in zip(self.enc, self._ys, strict=True):
            N, K = w.shape
            k_p = _pow2(K)
            block = _rows_per_program(N, k_p)
            gp, bp, e = (norm[0], norm[1], norm[2]) if norm else (b, b, 0.0)
            plan.append((_linear_kernel, (triton.cdiv(N, block),),
                         (x, gp, bp, w, b, y, K, N, e),
                         dict(B=B, K_P=k_p, BLOCK_N=block, NORM=norm is not None,
                              num_warps=4 if block * k_p >= 1024 else 2)))
            x, norm = y, (g, beta, eps)
        K = x.shape[1]
        k_p, h_p = _pow2(K), _pow2(H)
        block = _rows_per_program(H, max(k_p, h_p), gates=8)
        plan.append((_lstm_kernel, (triton.cdiv(H, block),),
                     (x, norm[0], norm[1], self.wih, self.whh, self.bias4, self.h, self.c,
                      self._hnew, K, H, norm[2]),
                     dict(B=B, K_P=k_p, H_P=h_p, BLOCK_H=block, num_warps=4)))
        A = self.wp.shape[0]
        plan.append((_head_post_kernel, (1,),
                     (self._hnew, self.h, self.wp, self.bp, self.obs_dev, self._lo, self._hi,
                      self._out_dev, H, A, max(self._n, 1), self.obs_dev.shape[1],
                      self._out_w, self._scale),
                     dict(B=B, H_P=h_p, A_P=max(2, _pow2(A)), POST=self.post is not None,
                          num_warps=4)))
        return plan

    def _tick_ops(self) -> None:
        self.obs_dev.copy_(self.obs_host, non_blocking=True)  # pinned -> device
        for kernel, grid, args, meta in self._launches:
            kernel[grid](*args, **meta)
        self.out_host.copy_(self._out_dev, non_blocking=True)  # device -> pinned

    def step(self) -> None:
        self.graph.replay()
        query = self._stream.query
        while not query():
            pass

    def graph_handles(self) -> tuple[int, int] | None:
        """(cudaGraphExec_t, cudaStream_t) for the loop process's C tick (runtimes.graph_handles),
        which launches the graph and polls the stream itself (native_tick.c) as step() does."""
        return graph_handles(self.graph, self._stream)

    def finish_late(self) -> None:
        """The C tick launched the graph and stopped polling: poll until it is done (raises
        the CUDA error if the graph failed)."""
        query = self._stream.query
        while not query():
            pass

    def reset_state(self, index: int | None = None) -> None:
        for state in (self.h, self.c):
            if index is None:
                state.zero_()
            else:
                state[index].zero_()


def create_triton_backend(policy: StepPolicy, batch: int, *, post: PostSpec | None = None,
                          **_: object) -> TritonGraphBackend:
    """The registry's factory (registry.py)."""
    return TritonGraphBackend(policy, batch, post=post)
