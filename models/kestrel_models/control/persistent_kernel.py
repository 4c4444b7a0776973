"""The resident Triton kernel of `cuda_persistent` (persistent_step.py has the protocol, the
mailbox layout in ctrl and the backend that launches it): device-side flag loads and stores
with acquire/release semantics, the grid barrier, and the policy step's phases (encoder layers,
LSTM cell, head and command post-processing), all in one kernel that loops on requests.
Defined only where triton imports (triton_step's `triton` is None otherwise)."""

from __future__ import annotations

from kestrel_models.control.triton_step import libdevice, tl, triton

if triton is not None:
    from kestrel_models.control.triton_step import _head_row, _ln_elu

    @triton.jit
    def _ld_acquire_sys(ptr):
        """int32 load with acquire semantics at system scope (host memory polled over PCIe)."""
        return tl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [ptr],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _ld_acquire_gpu(ptr):
        """int64 load with acquire semantics at GPU scope (the barrier counter)."""
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptr],
                                         dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _st_release_sys(ptr, val):
        """int32 store with release semantics at system scope: every write this thread made or
        observed (bar.sync before it) is visible to the host first."""
        return tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2;\n\tmov.u32 $0, 0;",
                                         "=r,l,r", [ptr, val], dtype=tl.int32, is_pure=False,
                                         pack=1)

    @triton.jit
    def _globaltimer():
        """GPU global timer, ns."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _arrive(bar_ptr):
        """Thread 0 of this program adds 1 to the barrier counter, with release at GPU scope."""
        return tl.inline_asm_elementwise(
            "{\n\t.reg .pred %p;\n\t.reg .u32 %t;\n\tmov.u32 %t, %tid.x;\n\t"
            "setp.eq.u32 %p, %t, 0;\n\t@%p red.release.gpu.global.add.u64 [$1], 1;\n\t"
            "mov.u32 $0, 0;\n\t}", "=r,l", [bar_ptr], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _nanosleep(ASM: tl.constexpr):
        return tl.inline_asm_elementwise(ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _grid_sync(bar_ptr, target, SLEEP_ASM: tl.constexpr):
        """All programs: wait until the counter reaches `target` (= generation x P). With a
        SLEEP_ASM (a nanosleep; "" = none) after each poll: fewer issue slots and L2 requests
        taken from kernels sharing the SM, at up to that much extra wake-up latency."""
        tl.debug_barrier()  # this program's writes are done (CTA scope) before thread 0 releases
        _arrive(bar_ptr)
        seen = _ld_acquire_gpu(bar_ptr)
        while seen < target:
            if SLEEP_ASM != "":
                _nanosleep(SLEEP_ASM)
            seen = _ld_acquire_gpu(bar_ptr)
        tl.debug_barrier()

    @triton.jit
    def _tile(w_ptr, pid, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              K_P: tl.constexpr):
        """Rows pid*R .. pid*R+R-1 of W [N, K] as a [R, K_P] register tile (zeros outside)."""
        rows = pid * R + tl.arange(0, R)
        ks = tl.arange(0, K_P)
        return tl.load(w_ptr + rows[:, None] * K + ks[None, :],
                       mask=(rows[:, None] < N) & (ks[None, :] < K), other=0.0)

    @triton.jit
    def _rows(v_ptr, pid, R: tl.constexpr, N: tl.constexpr):
        rows = pid * R + tl.arange(0, R)
        return tl.load(v_ptr + rows, mask=rows < N, other=0.0)

    @triton.jit
    def _dense(x_ptr, g_ptr, beta_ptr, eps, w, bias, y_ptr, pid, B: tl.constexpr,
               R: tl.constexpr, N: tl.constexpr, K: tl.constexpr, K_P: tl.constexpr,
               NORM: tl.constexpr):
        """y[b, rows] = w . f(x[b]) + bias for every row b; f = LayerNorm+ELU (NORM) else id.
        x is another program's output: loaded with .cg (L2, not this SM's L1)."""
        rows = pid * R + tl.arange(0, R)
        ks = tl.arange(0, K_P)
        kmask = ks < K
        for b in tl.static_range(B):
            x = tl.load(x_ptr + b * K + ks, mask=kmask, other=0.0, cache_modifier=".cg")
            if NORM:
                x = _ln_elu(x, ks, kmask, g_ptr, beta_ptr, K, eps)
            y = tl.sum(w * x[None, :], 1) + bias
            tl.store(y_ptr + b * N + rows, y, mask=rows < N)

    @triton.jit(do_not_specialize=["seq0", "idle_ns"])  # a relaunch must not recompile
    def _persistent_kernel(
            ctrl_ptr, reset_ptr, obs_host_ptr, out_host_ptr,  # pinned host memory
            bar_ptr, cmd_ptr, obs_ptr,  # device scratch: int64 [1], int32 [1], f32 [B, D]
            w1, b1, g1, be1, y1, w2, b2, g2, be2, y2, w3, b3, g3, be3, y3,  # encoder layers
            wih, whh, bias4, h_ptr, c_ptr, hnew_ptr,  # LSTM [4H, K], [4H, H], [4H]; [B, H]
            wp, bp, lo_ptr, hi_ptr,  # head [A, H], [A]; command limits [NJ] rad
            eps1, eps2, eps3, scale, seq0, idle_ns,
            B: tl.constexpr, P: tl.constexpr, NL: tl.constexpr,
            D: tl.constexpr, D_P: tl.constexpr, N1: tl.constexpr, N1_P: tl.constexpr,
            N2: tl.constexpr, N2_P: tl.constexpr, N3: tl.constexpr, N3_P: tl.constexpr,
            R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
            K: tl.constexpr, K_P: tl.constexpr, H: tl.constexpr, H_P: tl.constexpr,
            RH: tl.constexpr, A: tl.constexpr, A_P: tl.constexpr, NJ: tl.constexpr,
            OUT_W: tl.constexpr, POST: tl.constexpr, SLEEP_ASM: tl.constexpr):
        """See the module docstring. K = N_NL (the LSTM input), eps_k: LayerNorm k's eps."""
        pid = tl.program_id(0)
        # ---- this program's weights, once: registers for the lifetime of the kernel ----
        w1t = _tile(w1, pid, R1, N1, D, D_P)
        b1t = _rows(b1, pid, R1, N1)
        if NL >= 2:
            w2t = _tile(w2, pid, R2, N2, N1, N1_P)
            b2t = _rows(b2, pid, R2, N2)
        if NL >= 3:
            w3t = _tile(w3, pid, R3, N3, N2, N2_P)
            b3t = _rows(b3, pid, R3, N3)
        units = pid * RH + tl.arange(0, RH)
        umask = units < H
        wxi = _tile(wih, pid, RH, H, K, K_P)
        wxf = _tile(wih + H * K, pid, RH, H, K, K_P)
        wxg = _tile(wih + 2 * H * K, pid, RH, H, K, K_P)
        wxo = _tile(wih + 3 * H * K, pid, RH, H, K, K_P)
        whi = _tile(whh, pid, RH, H, H, H_P)
        whf = _tile(whh + H * H, pid, RH, H, H, H_P)
        whg = _tile(whh + 2 * H * H, pid, RH, H, H, H_P)
        who = _tile(whh + 3 * H * H, pid, RH, H, H, H_P)
        bi = _rows(bias4, pid, RH, H)
        bf = _rows(bias4 + H, pid, RH, H)
        bg = _rows(bias4 + 2 * H, pid, RH, H)
        bo = _rows(bias4 + 3 * H, pid, RH, H)
        hs = tl.arange(0, H_P)
        hmask = hs < H
        ks = tl.arange(0, K_P)
        kmask = ks < K
        acts = tl.arange(0, A_P)
        amask = acts < A
        jmask = acts < NJ
        is0 = pid == 0
        wpt = tl.load(wp + acts[:, None] * H + hs[None, :],
                      mask=is0 & amask[:, None] & hmask[None, :], other=0.0)  # [A_P, H_P]
        bpt = tl.load(bp + acts, mask=is0 & amask, other=0.0)
        lo = tl.load(lo_ptr + acts, mask=is0 & jmask, other=0.0)
        hi = tl.load(hi_ptr + acts, mask=is0 & jmask, other=0.0)
        ds = tl.arange(0, D_P)
        dmask = ds < D
        if NL == 1:
            gl, bel, epsl, yl = g1, be1, eps1, y1
        elif NL == 2:
            gl, bel, epsl, yl = g2, be2, eps2, y2
        else:
            gl, bel, epsl, yl = g3, be3, eps3, y3

        seq = seq0
        gen = tl.program_id(0).to(tl.int64) * 0  # barrier generations passed
        running = 1
        while running != 0:
            # ---- program 0: wait for the host's request, stage the observation ----
            if pid == 0:
                t0 = _globaltimer()
                req = _ld_acquire_sys(ctrl_ptr)
                idle = t0 * 0
                while (req != seq) & (req != -1) & (idle < idle_ns):
                    req = _ld_acquire_sys(ctrl_ptr)
                    idle = _globaltimer() - t0
                go = tl.where(req == seq, seq, -1)  # -1: stop (close) or idle retirement
                if go > 0:
                    for b in tl.static_range(B):
                        x = tl.load(obs_host_ptr + b * D + ds, mask=dmask, other=0.0,
                                    volatile=True)
                        tl.store(obs_ptr + b * D + ds, x, mask=dmask)
                        keep = tl.load(reset_ptr + b, volatile=True) == 0
                        hrow = tl.load(h_ptr + b * H + hs, mask=hmask, other=0.0)
                        crow = tl.load(c_ptr + b * H + hs, mask=hmask, other=0.0)
                        tl.store(h_ptr + b * H + hs, tl.where(keep, hrow, 0.0), mask=hmask)
                        tl.store(c_ptr + b * H + hs, tl.where(keep, crow, 0.0), mask=hmask)
                tl.store(cmd_ptr, go)
            gen += 1
            _grid_sync(bar_ptr, gen * P, SLEEP_ASM)
            cmd = tl.load(cmd_ptr, volatile=True)
            if cmd <= 0:
                running = 0
            else:
                # ---- encoder: one phase per layer ----
                _dense(obs_ptr, g1, be1, 0.0, w1t, b1t, y1, pid, B, R1, N1, D, D_P, False)
                gen += 1
                _grid_sync(bar_ptr, gen * P, SLEEP_ASM)
                if NL >= 2:
                    _dense(y1, g1, be1, eps1, w2t, b2t, y2, pid, B, R2, N2, N1, N1_P, True)
                    gen += 1
                    _grid_sync(bar_ptr, gen * P, SLEEP_ASM)
                if NL >= 3:
                    _dense(y2, g2, be2, eps2, w3t, b3t, y3, pid, B, R3, N3, N2, N2_P, True)
                    gen += 1
                    _grid_sync(bar_ptr, gen * P, SLEEP_ASM)
                # ---- LSTM cell: this program's hidden units ----
                for b in tl.static_range(B):
                    x = tl.load(yl + b * K + ks, mask=kmask, other=0.0, cache_modifier=".cg")
                    x = _ln_elu(x, ks, kmask, gl, bel, K, epsl)[None, :]
                    h = tl.load(h_ptr + b * H + hs, mask=hmask, other=0.0,
                                cache_modifier=".cg")[None, :]
                    gi = tl.sum(wxi * x, 1) + tl.sum(whi * h, 1) + bi
                    gf = tl.sum(wxf * x, 1) + tl.sum(whf * h, 1) + bf
                    gg = tl.sum(wxg * x, 1) + tl.sum(whg * h, 1) + bg
                    go_ = tl.sum(wxo * x, 1) + tl.sum(who * h, 1) + bo
                    c = tl.load(c_ptr + b * H + units, mask=umask, other=0.0,
                                cache_modifier=".cg")
                    c2 = tl.sigmoid(gf) * c + tl.sigmoid(gi) * libdevice.tanh(gg)
                    h2 = tl.sigmoid(go_) * libdevice.tanh(c2)
                    tl.store(c_ptr + b * H + units, c2, mask=umask)
                    tl.store(hnew_ptr + b * H + units, h2, mask=umask)
                gen += 1
                _grid_sync(bar_ptr, gen * P, SLEEP_ASM)
                # ---- program 0: head + post-processing -> host, then DONE ----
                if pid == 0:
                    for b in tl.static_range(B):
                        _head_row(hnew_ptr, h_ptr, wpt, bpt, obs_ptr, lo, hi, out_host_ptr, b,
                                  hs, hmask, acts, amask, jmask, H, A, NJ, D, OUT_W, scale,
                                  POST, ".cg")
                    tl.debug_barrier()
                    _st_release_sys(ctrl_ptr + 16, seq)  # ctrl[DONE]
                seq = tl.where(seq >= 2147483647, 1, seq + 1)
        if pid == 0:
            tl.debug_barrier()
            _st_release_sys(ctrl_ptr + 32, 1)  # ctrl[RETIRED]
