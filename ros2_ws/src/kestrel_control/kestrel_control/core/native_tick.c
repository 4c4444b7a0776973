/* The loop process's control tick in C: the common case of one tick without a Python call
 * per step (see native_tick.py for why, the build and the binding).
 *
 * Everything lives in buffers the Python side owns (numpy arrays, the shared-memory segment,
 * the persistent kernel's pinned mailbox); `ints` / `dbls` hold their addresses and sizes at the
 * offsets native_tick.py defines (I_* / D_* below, kept in step by a test). A function either
 * completes its part of the tick or returns a code that tells Python which part to run itself
 * (policy_runner.py, loop_child.py): every unusual case (no input yet, a stale, non-finite
 * or implausible observation, a non-finite action, a retired kernel, a late answer, a seqlock
 * read that kept colliding with the writer) takes the Python path, which counts and handles it. So the C part
 * never counts a safety event and never holds; it only does what the Python OK path does, in
 * the same order, with the same float32/float64 conversions.
 *
 * Memory ordering: the seqlocks and the mailbox use C11 atomics (acquire loads, release stores
 * and fences): plain moves on x86-64, real barriers on weakly ordered CPUs.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- offsets into ints[] (int64) and dbls[] (float64); native_tick.py mirrors them ---- */
enum {
    I_ROBOTS, I_JOINTS, I_ACTIONS, I_OBS, I_OBS_STRIDE, I_ACT, I_ACT_STRIDE, I_POST,
    I_POST_STRIDE, I_LAT, I_COMPENSATE, I_CLAMP_CTR, I_CMD_CTR, I_AUX_LAT, I_EFD, I_MB_CTRL,
    I_MB_STATE, I_COMMANDS, I_LOWER, I_UPPER, I_READ_NS, I_SPIN_NS, I_LATE_T0, I_GRAPH_EXEC,
    I_STREAM, I_CU_CTX, I_PLAUS_C, I_PLAUS_H, I_TERMS, I_NTERMS, I_TERM_SCALE, I_DEFAULT_Q,
    I_ACT_MODE, I_PREV_COL, I_SCALES, I_GLOBAL
};
enum { /* per robot, at I_GLOBAL + r * R_SIZE; *_GOOD / *_GVS: the reader's fallback copy */
    R_JS_H, R_JS_S, R_TG_H, R_TG_S, R_CMD_H, R_CMD_S, R_INPUTS, R_TVER, R_LAST_SAFE,
    R_HAS_SAFE, R_JS_GOOD, R_JS_GVS, R_TG_GOOD, R_TG_GVS, R_SIZE
};
enum { D_MAX_AGE, D_CLIP, D_SIZE };
/* policy_io.py: observation term table int64 [T, 4] = (source, column, length, relative) and
 * the action modes */
enum { SRC_POS = 0, SRC_VEL = 1, SRC_TARGET = 2 };
enum { MODE_DELTA_TANH = 0, MODE_DELTA = 1, MODE_OFFSET = 2 };

/* SharedLatestValue header (int64), shm_control.py */
enum { H_PUB = 0, H_VER = 1, H_SEQ = 2, H_STAMP = 4, H_SLOTVER = 6, H_RETRIES = 8 };
/* persistent_step.py: int32 mailbox slots; host state int64 [next seq, reset pending, failed,
 * seq of a late request] */
enum { MB_REQ = 0, MB_DONE = 16, MB_RETIRED = 32 };
enum { S_NEXT = 0, S_RESET = 1, S_FAILED = 2, S_LATE = 3 };
#define SEQ_MAX 2147483647LL

/* return codes (native_tick.py) */
enum { KT_DONE = 0, KT_PY_ALL = 1, KT_PY_INFER = 2, KT_PY_LATE = 3, KT_PY_FINISH = 4 };

#define P(T, i) ((T *)(intptr_t)ints[(i)])
#define PTR(T, ri, k) ((T *)(intptr_t)(ri)[(k)]) /* a per-robot table entry */

static inline int64_t ld64(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st64(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
static inline int32_t ld32(const int32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void st32(int32_t *p, int32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* SharedLatestValue.read_into: the newest complete value into out[count] and into the reader's
 * fallback copy good[count] / gvs [version, stamp] (as Python keeps them); 1 on success, 0 when
 * the writer kept its slot busy for budget_ns (Python then reads, falling back to `good`). A
 * Python writer holds a slot about a microsecond, so the budget is in time, not tries; a read that had to
 * retry counts once in the header's retries (Python counts each try). */
static int sl_read(int64_t *h, const double *slots, int64_t count, double *out,
                   double *good, int64_t *gvs, int64_t *version, int64_t *stamp,
                   int64_t budget_ns) {
    int64_t end = 0;
    for (uint32_t t = 0;; t++) {
        int64_t idx = ld64(&h[H_PUB]);
        if (idx != 0 && idx != 1) return 0;
        int64_t s1 = ld64(&h[H_SEQ + idx]);
        if (!(s1 & 1)) {
            memcpy(out, slots + idx * count, (size_t)count * sizeof(double));
            int64_t v = ld64(&h[H_SLOTVER + idx]);
            int64_t s = ld64(&h[H_STAMP + idx]);
            __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy completes before the check */
            if (ld64(&h[H_SEQ + idx]) == s1) {
                memcpy(good, out, (size_t)count * sizeof(double));
                gvs[0] = *version = v;
                gvs[1] = *stamp = s;
                return 1;
            }
        }
        if (t == 0) {
            h[H_RETRIES] += 1;
            end = mono_ns() + budget_ns;
        } else if ((t & 15) == 0 && mono_ns() > end) {
            return 0;
        }
        cpu_relax();
    }
}

/* SharedLatestValue.write (one writer thread: the loop's) */
static void sl_write(int64_t *h, double *slots, int64_t count, const double *value,
                     int64_t stamp) {
    int64_t idx = 1 - h[H_PUB];
    int64_t seq = h[H_SEQ + idx];
    st64(&h[H_SEQ + idx], seq + 1); /* odd: being written */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy(slots + idx * count, value, (size_t)count * sizeof(double));
    int64_t version = h[H_VER] + 1;
    st64(&h[H_STAMP + idx], stamp);
    st64(&h[H_SLOTVER + idx], version);
    st64(&h[H_SEQ + idx], seq + 2); /* even: complete */
    st64(&h[H_PUB], idx);
    st64(&h[H_VER], version);
}

#define MAX_ROBOTS 1024 /* RunnerConfig's bound */

/* RowIO.write_obs: obs[col + j] = (float)((x[j] - offset[j]) * scale) for the terms read from
 * inputs [3, n] (pos, vel, target); offset default_q for the relative terms, else 0. */
static void write_terms(const int64_t *ints, const double *inputs, float *obs) {
    const int64_t n = ints[I_JOINTS];
    const int64_t *terms = P(const int64_t, I_TERMS);
    const double *scales = P(const double, I_TERM_SCALE), *dq = P(const double, I_DEFAULT_Q);
    for (int64_t t = 0; t < ints[I_NTERMS]; t++) {
        const int64_t src = terms[4 * t], col = terms[4 * t + 1], rel = terms[4 * t + 3];
        if (src != SRC_POS && src != SRC_VEL && src != SRC_TARGET) continue;
        const double *x = inputs + src * n;
        const double s = scales[t];
        for (int64_t j = 0; j < n; j++)
            obs[col + j] = (float)((x[j] - (rel ? dq[j] : 0.0)) * s);
    }
}

/* RowIO's raw action: float32 -> float64, clamped to [-clip, clip] (inf: unchanged) */
static inline double action_in(float a, double clip) {
    double v = (double)a;
    v = v < -clip ? -clip : v; /* np.clip: maximum then minimum */
    return v > clip ? clip : v;
}

/* RowIO.propose for joint j: the unclamped command, rad */
static inline double propose(int mode, double a, double scale, double pos, double dq) {
    if (mode == MODE_DELTA_TANH) return tanh(a) * scale + pos;
    return a * scale + (mode == MODE_OFFSET ? dq : pos);
}

/* PolicyRunner._prepare for every robot, OK path only: 1 when every robot has a fresh, finite
 * observation (then, and only then, the rows are compensated and written), else 0 with no obs
 * row touched (Python prepares them all again, holds and counts). */
int kt_prepare(int64_t *ints, double *dbls, int64_t now_ns) {
    const int64_t R = ints[I_ROBOTS], n = ints[I_JOINTS];
    const double max_age = dbls[D_MAX_AGE];
    const double lat = P(double, I_LAT)[0];
    double ages[MAX_ROBOTS];
    if (R > MAX_ROBOTS) return 0;
    for (int64_t r = 0; r < R; r++) {
        int64_t *ri = ints + I_GLOBAL + r * R_SIZE;
        double *inputs = PTR(double, ri, R_INPUTS); /* [3, n]: pos, vel, target */
        int64_t version, stamp;
        if (!sl_read(PTR(int64_t, ri, R_JS_H), PTR(double, ri, R_JS_S), 2 * n, inputs,
                     PTR(double, ri, R_JS_GOOD), PTR(int64_t, ri, R_JS_GVS), &version, &stamp,
                     ints[I_READ_NS]) || version == 0)
            return 0;
        int64_t *h_tg = PTR(int64_t, ri, R_TG_H);
        int64_t *tver = PTR(int64_t, ri, R_TVER);
        if (ld64(&h_tg[H_VER]) != *tver) { /* targets change rarely: copy only then */
            int64_t tv, ts;
            if (!sl_read(h_tg, PTR(double, ri, R_TG_S), n, inputs + 2 * n,
                         PTR(double, ri, R_TG_GOOD), PTR(int64_t, ri, R_TG_GVS), &tv, &ts,
                         ints[I_READ_NS]))
                return 0;
            *tver = tv;
        }
        double age = (double)(now_ns - stamp) * 1e-9;
        if (!(-max_age <= age && age <= max_age)) return 0;
        double acc = 0.0;
        for (int64_t j = 0; j < 3 * n; j++) acc += inputs[j] * 0.0; /* NaN iff one is */
        if (acc != 0.0) return 0;
        if (ints[I_PLAUS_C]) { /* [pos | vel] out of range: Python holds and counts it */
            const double *pc = P(double, I_PLAUS_C), *ph = P(double, I_PLAUS_H);
            for (int64_t j = 0; j < 2 * n; j++)
                if (fabs(inputs[j] - pc[j]) - ph[j] > 0.0) return 0;
        }
        ages[r] = age;
    }
    for (int64_t r = 0; r < R; r++) {
        double *inputs = PTR(double, ints + I_GLOBAL + r * R_SIZE, R_INPUTS);
        if (ints[I_COMPENSATE]) {
            double ahead = (ages[r] > 0.0 ? ages[r] : 0.0) + lat;
            if (ahead > max_age) ahead = max_age;
            for (int64_t j = 0; j < n; j++) inputs[j] += inputs[n + j] * ahead;
        }
        write_terms(ints, inputs, P(float, I_OBS) + r * ints[I_OBS_STRIDE]);
    }
    return 1;
}

/* The step time since t0 into [EMA, last] s, as PolicyRunner._record_step does. */
static void record_step(int64_t *ints, int64_t t0) {
    double dt = (double)(mono_ns() - t0) * 1e-9;
    double *lat = P(double, I_LAT);
    lat[1] = dt;
    lat[0] += 0.05 * (dt - lat[0]);
}

/* A captured CUDA graph's step (cuda_graph / cuda_graph_triton: step() = replay + poll)
 * through the CUDA driver API, loaded at run time (no link-time CUDA dependency): the graph's
 * executable and stream handles are torch's (CUDAGraph.raw_cuda_graph_exec, the stream it is
 * replayed on), the context the one current where the tick was built. */
typedef int (*cu_graph_launch_t)(void *exec, void *stream);
typedef int (*cu_stream_query_t)(void *stream);
typedef int (*cu_ctx_t)(void **ctx);
typedef int (*cu_ctx_set_t)(void *ctx);
static cu_graph_launch_t cu_graph_launch;
static cu_stream_query_t cu_stream_query;
static cu_ctx_set_t cu_ctx_set;
static __thread void *thread_ctx; /* the context made current on this (the loop's) thread */
#define CUDA_ERROR_NOT_READY 600

/* Load libcuda's four entry points and store the calling thread's current context in ints;
 * 1 on success, 0 when there is no driver or no current context (then Python replays). */
int kt_init_cuda(int64_t *ints) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return 0;
    cu_graph_launch_t launch = (cu_graph_launch_t)dlsym(lib, "cuGraphLaunch");
    cu_stream_query_t query = (cu_stream_query_t)dlsym(lib, "cuStreamQuery");
    cu_ctx_t get = (cu_ctx_t)dlsym(lib, "cuCtxGetCurrent");
    cu_ctx_set_t set = (cu_ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
    void *ctx = NULL;
    if (!launch || !query || !get || !set || get(&ctx) != 0 || ctx == NULL) return 0;
    cu_graph_launch = launch;
    cu_stream_query = query;
    cu_ctx_set = set;
    ints[I_CU_CTX] = (int64_t)(intptr_t)ctx;
    return 1;
}

static int graph_step(int64_t *ints) {
    void *ctx = (void *)(intptr_t)ints[I_CU_CTX];
    if (cu_graph_launch == NULL || ctx == NULL) return KT_PY_INFER;
    if (thread_ctx != ctx) {
        if (cu_ctx_set(ctx) != 0) return KT_PY_INFER;
        thread_ctx = ctx;
    }
    void *stream = (void *)(intptr_t)ints[I_STREAM];
    int64_t t0 = mono_ns();
    ints[I_LATE_T0] = t0;
    if (cu_graph_launch((void *)(intptr_t)ints[I_GRAPH_EXEC], stream) != 0)
        return KT_PY_INFER; /* nothing launched: Python replays (and raises the error) */
    const int64_t limit = t0 + ints[I_SPIN_NS];
    for (uint32_t k = 1;; k++) {
        int r = cu_stream_query(stream);
        if (r == 0) break;
        if (r != CUDA_ERROR_NOT_READY) return KT_PY_LATE; /* Python's poll raises it */
        if ((k & 15) == 0 && mono_ns() > limit) return KT_PY_LATE;
    }
    record_step(ints, t0);
    return KT_DONE;
}

/* cuda_persistent's step (PersistentTritonBackend.step) through its mailbox, or a CUDA graph's
 * (graph_step): KT_DONE, or KT_PY_INFER (neither, kernel retired, a state reset pending,
 * backend failed: Python steps), or KT_PY_LATE (the request or graph is out and unanswered
 * after spin_ns: Python waits). */
int kt_infer(int64_t *ints, double *dbls) {
    (void)dbls;
    int32_t *mb = P(int32_t, I_MB_CTRL);
    int64_t *st = P(int64_t, I_MB_STATE);
    if (mb == NULL) return ints[I_GRAPH_EXEC] ? graph_step(ints) : KT_PY_INFER;
    if (ld32(&mb[MB_RETIRED]) || st[S_RESET] || st[S_FAILED]) return KT_PY_INFER;
    int64_t t0 = mono_ns();
    ints[I_LATE_T0] = t0; /* a late answer's step time is taken by Python from here */
    int64_t seq = st[S_NEXT];
    st[S_NEXT] = seq >= SEQ_MAX ? 1 : seq + 1;
    st32(&mb[MB_REQ], (int32_t)seq); /* release: the observation rows are visible first */
    const int64_t limit = t0 + ints[I_SPIN_NS];
    for (uint32_t k = 1;; k++) {
        if (ld32(&mb[MB_DONE]) == (int32_t)seq) break;
        cpu_relax();
        if ((k & 255) == 0 && mono_ns() > limit) {
            st[S_LATE] = seq;
            return KT_PY_LATE;
        }
    }
    record_step(ints, t0);
    return KT_DONE;
}

/* PolicyRunner._finish (OK path) for every robot, then the loop process's command writes and
 * its eventfd: 1 when done, 0 when some robot's action is not finite (nothing written: Python
 * finishes them all). */
int kt_finish(int64_t *ints, double *dbls, int64_t now_ns) {
    const int64_t R = ints[I_ROBOTS], n = ints[I_JOINTS], A = ints[I_ACTIONS];
    const double clip = dbls[D_CLIP], *scale = P(const double, I_SCALES); /* [n] */
    const int mode = (int)ints[I_ACT_MODE];
    const double *lo = P(double, I_LOWER), *hi = P(double, I_UPPER);
    const double *dq = P(double, I_DEFAULT_Q);
    float *post = P(float, I_POST);
    double *commands = P(double, I_COMMANDS); /* [R, n] rad */
    /* checks first, so that nothing is written unless every robot is OK */
    for (int64_t r = 0; r < R; r++) {
        if (post != NULL) {
            if (post[r * ints[I_POST_STRIDE] + n] == 0.0f) return 0; /* finite flag */
        } else {
            const float *act = P(float, I_ACT) + r * ints[I_ACT_STRIDE];
            const double *pos = PTR(double, ints + I_GLOBAL + r * R_SIZE, R_INPUTS);
            float acc = 0.0f;
            for (int64_t j = 0; j < A; j++) acc += act[j] * 0.0f;
            if (acc != 0.0f) return 0;
            for (int64_t j = 0; j < n; j++)
                if (!isfinite(propose(mode, action_in(act[j], clip), scale[j], pos[j], dq[j])))
                    return 0;
        }
    }
    for (int64_t r = 0; r < R; r++) {
        int64_t *ri = ints + I_GLOBAL + r * R_SIZE;
        const double *pos = PTR(double, ri, R_INPUTS);
        const float *act = P(float, I_ACT) + r * ints[I_ACT_STRIDE];
        double *cmd = commands + r * n;
        int clamped = 0;
        if (post != NULL) { /* command, clamp and finite flag from the graph / kernel */
            const float *row = post + r * ints[I_POST_STRIDE];
            for (int64_t j = 0; j < n; j++) {
                double c = (double)row[j];
                c = c < lo[j] ? lo[j] : c; /* np.maximum then np.minimum, as SafetyFilter */
                cmd[j] = c > hi[j] ? hi[j] : c;
            }
            clamped = row[n + 1] != 0.0f;
        } else { /* the host path (action_mode), in float64 */
            for (int64_t j = 0; j < n; j++) {
                double p = propose(mode, action_in(act[j], clip), scale[j], pos[j], dq[j]);
                double c = p < lo[j] ? lo[j] : p;
                c = c > hi[j] ? hi[j] : c;
                clamped |= c != p;
                cmd[j] = c;
            }
        }
        if (clamped) P(int64_t, I_CLAMP_CTR)[0] += 1;
        memcpy(PTR(double, ri, R_LAST_SAFE), cmd, (size_t)n * sizeof(double));
        PTR(int64_t, ri, R_HAS_SAFE)[0] = 1;
        const int64_t prev = ints[I_PREV_COL]; /* RowIO.store_prev: the last_action term */
        if (prev >= 0) {
            float *obs = P(float, I_OBS) + r * ints[I_OBS_STRIDE] + prev;
            if (isinf(clip)) memcpy(obs, act, (size_t)A * sizeof(float));
            else for (int64_t j = 0; j < A; j++) obs[j] = (float)action_in(act[j], clip);
        }
        sl_write(PTR(int64_t, ri, R_CMD_H), PTR(double, ri, R_CMD_S), n, cmd,
                 now_ns);
    }
    int64_t *ctr = P(int64_t, I_CMD_CTR);
    if (ctr != NULL) ctr[0] += 1;
    double *aux = P(double, I_AUX_LAT);
    if (aux != NULL) aux[0] = P(double, I_LAT)[0];
    if (ints[I_EFD] >= 0) {
        uint64_t one = 1;
        ssize_t w = write((int)ints[I_EFD], &one, sizeof one);
        (void)w; /* the node's publisher thread wakes; a full counter (2^64 - 1) cannot happen */
    }
    return 1;
}

/* The whole tick: prepare, the mailbox step, finish. KT_DONE, or where Python takes over. */
int kt_tick(int64_t *ints, double *dbls, int64_t now_ns) {
    if (!kt_prepare(ints, dbls, now_ns)) return KT_PY_ALL;
    int code = kt_infer(ints, dbls);
    if (code != KT_DONE) return code;
    return kt_finish(ints, dbls, now_ns) ? KT_DONE : KT_PY_FINISH;
}
