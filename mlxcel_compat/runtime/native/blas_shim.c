/* cblas_sgemm for matrix-vector shapes at memory-streaming speed.
 *
 * MLX's CPU backend computes every float32 matmul with one cblas_sgemm call (row-major). For a
 * decode step that is (1, K) @ (K, N) with the weight transposed, and OpenBLAS (0.3.21) runs such
 * M = 1 or small-M products through its full GEMM machinery: it packs (copies) the whole weight
 * before multiplying, so the weight is streamed about twice and the product runs at a third of
 * the speed of a matrix-vector kernel. This library is loaded with RTLD_GLOBAL *before* OpenBLAS,
 * so MLX's cblas_sgemm resolves here (mlxcel_compat/runtime/native/blas_shim.py builds and loads it) and:
 *
 *   - row-major C = alpha * A @ B^T + beta * C with M <= small_m_max (a linear layer with a few
 *     rows: decode, batched decode, short prefill chunks; attention scores while decoding) runs
 *     the kernel below: every weight row is read once and multiplied with all M rows of A while
 *     it is in registers, on all cores; A @ B with M <= small_m_max (attention's probabilities
 *     @ values) likewise, streaming the rows of B;
 *   - other M == 1 or N == 1 products go to OpenBLAS's cblas_sgemv;
 *   - everything else goes to OpenBLAS's cblas_sgemm unchanged.
 *
 * The kernel computes each output element as the same sequence of operations whatever M is and
 * whichever thread runs it (vector partial sums over k in order, a fixed reduction tree, then the
 * scalar tail), so a row of a batched product is bit-identical to the same row computed alone.
 *
 * The library also carries the kernels of the CPU decode runtime (mlxcel_compat/runtime/cpu_decode.py,
 * at the end of this file): RMS norms (Gemma's on a residual branch too), RoPE, SiLU and GELU-tanh
 * gating and a decode step's attention (over a growing cache or a sliding window's ring), which
 * run decode steps (one sequence or a batch) between calls to the kernel above, on the same thread
 * pool.
 *
 * No dependency but libc and pthreads; compiled for the machine it runs on (-march=native).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "blas_shim.h"

/* CBLAS enum values (cblas.h). */
enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112, ConjTrans = 113 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);

/* Vector width and block shape per instruction set: the block's accumulators, weight rows and one
 * input vector must fit the register file (AVX-512: 32 registers; AVX2: 16; NEON: 32). */
#if defined(__AVX512F__)
#define VL 16
#define MB_MAX 4
#elif defined(__AVX2__) || defined(__AVX__)
#define VL 8
#define MB_MAX 2
#else
#define VL 4
#define MB_MAX 4
#endif
#define NB_MAX 4

typedef float vf __attribute__((vector_size(VL * sizeof(float)), aligned(sizeof(float))));

/* Keeps a loaded vector in a register for the loop that reuses it: GCC otherwise folds the load
 * into each use (a memory operand per multiply-add), reading it once per row. The constraint
 * names the vector registers of the target ("v": x86's xmm/ymm/zmm, "w": AArch64's). */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

/* Routes, as mlxcel_shim_configure takes them. */
enum { ROUTE_SGEMM = 0, ROUTE_GEMV = 1, ROUTE_KERNEL = 2 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int route = ROUTE_KERNEL;
static int small_m_max = 16;
static int n_threads = 1;
static atomic_long calls[3]; /* by route actually taken: sgemm, sgemv, kernel */

/* ------------------------------------------------------------------------------------ kernel */

static inline vf loadv(const float *p) { return *(const vf *)p; }

/* a in every lane. Written as a scalar minus a vector of zeros (GCC and Clang broadcast the
 * scalar: one instruction; x - 0 is x for every x, signed zeros included); a loop over the lanes
 * compiled (GCC 12, AVX-512) to one masked broadcast per lane, which made every kernel that
 * broadcasts in its inner loop (rows_nn: probabilities @ values) ~3x slower. */
static inline vf splat(float a) { return a - (vf){0}; }

/* Sum of the lanes by halving: one fixed order. */
static inline float hsum(vf v) {
    float t[VL];
    memcpy(t, &v, sizeof t);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
}

/* The sums of four vectors, each added in exactly hsum's order (so a block's results do not
 * depend on how many outputs it reduces together), with a quarter of the shuffles. */
#if VL == 16 && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_HSUM4 1
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
static inline void hsum4(vf a, vf b, vf c, vf d, float out[4]) {
    vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    v8 h = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
    v4 r = __builtin_shufflevector(h, h, 0, 2, 4, 6) + __builtin_shufflevector(h, h, 1, 3, 5, 7);
    memcpy(out, &r, sizeof r);
}
#endif
#endif

static inline void store(float *c, float alpha, float beta, float s) {
    *c = beta == 0.0f ? alpha * s : alpha * s + beta * *c;
}

/* c[i, j] = alpha * dot(x[i, :], w[j, :]) (+ beta * c[i, j]) for i < MB, j < NB. MB and NB are
 * constants at every call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block(const int MB, const int NB, int K, const float *x,
                                                        size_t ldx, const float *w, size_t ldw, float *c,
                                                        size_t ldc, float alpha, float beta) {
    vf acc[MB_MAX][NB_MAX];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = (vf){0};
    int k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[NB_MAX];
        for (int j = 0; j < NB; j++) {
            wv[j] = loadv(w + j * ldw + k);
            KEEP_IN_REGISTER(wv[j]); /* read once for every row */
        }
        for (int i = 0; i < MB; i++) {
            vf xv = loadv(x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MB; i++) {
        float sums[NB_MAX];
#ifdef HAVE_HSUM4
        if (NB == 4) hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums);
        else
#endif
            for (int j = 0; j < NB; j++) sums[j] = hsum(acc[i][j]);
        for (int j = 0; j < NB; j++) {
            float s = sums[j];
            for (int kk = k; kk < K; kk++) s += x[i * ldx + kk] * w[j * ldw + kk];
            store(c + i * ldc + j, alpha, beta, s);
        }
    }
}

#define BLOCK(mb, nb)                                                                                      \
    block(mb, nb, K, x + (size_t)m * ldx, ldx, w + (size_t)n * ldw, ldw, c + (size_t)m * ldc + n, ldc, alpha, \
          beta)

/* The last M % MB_MAX rows as one block, so the weight rows are read once for them too. */
#if MB_MAX == 4
#define REMAINING_ROWS(KIND, nb)                    \
    switch (M - m) {                                \
    case 3: KIND(3, nb); break;                     \
    case 2: KIND(2, nb); break;                     \
    case 1: KIND(1, nb); break;                     \
    }
#else
#define REMAINING_ROWS(KIND, nb) \
    for (; m < M; m++) KIND(1, nb);
#endif

/* All M rows of x against weight rows [n0, n1). */
static void rows_nt(int M, int n0, int n1, int K, const float *x, size_t ldx, const float *w, size_t ldw,
                    float *c, size_t ldc, float alpha, float beta) {
    int n = n0;
    for (; n + NB_MAX <= n1; n += NB_MAX) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) BLOCK(MB_MAX, NB_MAX);
        REMAINING_ROWS(BLOCK, NB_MAX);
    }
    for (; n < n1; n++) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) BLOCK(MB_MAX, 1);
        REMAINING_ROWS(BLOCK, 1);
    }
}

/* c[i, j] = alpha * sum_k x[i, k] * w[k, j] (+ beta * c[i, j]) for i < MB and the NV * VL columns
 * from w, w being K x N (not transposed: attention's probabilities @ values). Each element is
 * summed over k in order, whatever M: no horizontal sums. Rows k >= K1 of w are read from w2
 * (row k - K1) instead: a cache whose last keys are held apart sums exactly as one table. */
static inline __attribute__((always_inline)) void block_nn(const int MB, const int NV, int K, const float *x,
                                                           size_t ldx, const float *w, size_t ldw, float *c,
                                                           size_t ldc, float alpha, float beta, const float *w2,
                                                           int K1) {
    vf acc[MB_MAX][NB_MAX];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};
    for (int k = 0; k < K; k++) {
        const float *row = k < K1 ? w + k * ldw : w2 + (k - K1) * ldw;
        vf wv[NB_MAX];
        for (int j = 0; j < NV; j++) {
            wv[j] = loadv(row + j * VL);
            KEEP_IN_REGISTER(wv[j]); /* folded into each row's multiply-add, attention's P @ V was load-bound at half the FMA rate */
        }
        for (int i = 0; i < MB; i++) {
            vf xs = splat(x[i * ldx + k]);
            for (int j = 0; j < NV; j++) acc[i][j] += xs * wv[j];
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NV; j++) {
            if (beta == 0.0f) { /* store's alpha * s, a vector at a time */
                vf r = acc[i][j] * splat(alpha);
                memcpy(c + i * ldc + j * VL, &r, sizeof r);
            } else {
                for (int l = 0; l < VL; l++) store(c + i * ldc + j * VL + l, alpha, beta, acc[i][j][l]);
            }
        }
}

#define BLOCK_NN(mb, nv) \
    block_nn(mb, nv, K, x + (size_t)m * ldx, ldx, w + n, ldw, c + (size_t)m * ldc + n, ldc, alpha, beta, w2 + n, K1)

/* All M rows of x against columns [n0, n1) of w, its rows from K1 on read from w2 (see block_nn;
 * K1 = K: all from w). */
static void rows_nn_split(int M, int n0, int n1, int K, const float *x, size_t ldx, const float *w, size_t ldw,
                          float *c, size_t ldc, float alpha, float beta, const float *w2, int K1) {
    int n = n0;
    for (; n + NB_MAX * VL <= n1; n += NB_MAX * VL) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) BLOCK_NN(MB_MAX, NB_MAX);
        REMAINING_ROWS(BLOCK_NN, NB_MAX);
    }
    for (; n + VL <= n1; n += VL) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) BLOCK_NN(MB_MAX, 1);
        REMAINING_ROWS(BLOCK_NN, 1);
    }
    for (; n < n1; n++) /* the last columns, one at a time, in the same order */
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++)
                s += x[(size_t)m * ldx + k] * (k < K1 ? w[(size_t)k * ldw + n] : w2[(size_t)(k - K1) * ldw + n]);
            store(c + (size_t)m * ldc + n, alpha, beta, s);
        }
}

static void rows_nn(int M, int n0, int n1, int K, const float *x, size_t ldx, const float *w, size_t ldw,
                    float *c, size_t ldc, float alpha, float beta) {
    rows_nn_split(M, n0, n1, K, x, ldx, w, ldw, c, ldc, alpha, beta, w, K);
}

/* ------------------------------------------------------------------------------- thread pool
 * A product is cut into parts (bands of weight rows); the calling thread and the workers claim
 * parts until none is left, so a worker that the OS has not scheduled (a busy machine) costs
 * nothing but its share of the speed-up: the caller does its parts. Claiming compares the job's
 * number too, so a late worker can never take a part of the next job. Idle workers wait for the
 * next job by yielding the core (the matmuls of one forward pass come microseconds apart, and any
 * other runnable thread gets the core meanwhile), then sleep on a futex. */

#define MAX_THREADS 64
#define PARTS_PER_THREAD 4
#define SPIN_PAUSES 64           /* busy polls before yielding */
#define IDLE_NS (500 * 1000)     /* then yield for up to 0.5 ms before sleeping */

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

struct job {
    mlxcel_task_fn task; /* a task of another source file (mlxcel_parallel), or a product: */
    const void *task_ctx;
    int nn; /* w is K x N (rows_nn), else N x K (rows_nt) */
    int M, N, K;
    const float *x, *w;
    size_t ldx, ldw, ldc;
    float *c;
    float alpha, beta;
    int parts;
};

static struct job job;
static _Atomic unsigned long long ticket; /* job number << 32 | next unclaimed part */
static atomic_int parts_done;
static atomic_uint job_number; /* futex word: bumped once per job */
static atomic_int sleepers;
static int n_workers; /* started */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Outputs per unit of work: NB_MAX weight rows, or NB_MAX vectors of columns. */
static int unit(int nn) { return nn ? NB_MAX * VL : NB_MAX; }

/* Part p of the N outputs, in whole units. */
static void run_part(const struct job *j, int p) {
    if (j->task) {
        j->task(j->task_ctx, p);
        return;
    }
    int u = unit(j->nn);
    int per = ((j->N + j->parts - 1) / j->parts + u - 1) / u * u;
    int n0 = p * per < j->N ? p * per : j->N;
    int n1 = n0 + per < j->N ? n0 + per : j->N;
    if (n0 >= n1) return;
    if (j->nn) rows_nn(j->M, n0, n1, j->K, j->x, j->ldx, j->w, j->ldw, j->c, j->ldc, j->alpha, j->beta);
    else rows_nt(j->M, n0, n1, j->K, j->x, j->ldx, j->w, j->ldw, j->c, j->ldc, j->alpha, j->beta);
}

/* Claim and run parts of job number `number` until none is left. */
static void work_on(unsigned number) {
    for (;;) {
        unsigned long long t = atomic_load_explicit(&ticket, memory_order_acquire);
        if ((unsigned)(t >> 32) != number || (int)(unsigned)t >= job.parts) return;
        if (!atomic_compare_exchange_weak_explicit(&ticket, &t, t + 1, memory_order_acq_rel, memory_order_relaxed))
            continue;
        run_part(&job, (int)(unsigned)t); /* the job cannot change before this part is done */
        atomic_fetch_add_explicit(&parts_done, 1, memory_order_release);
    }
}

static void *worker(void *arg) {
    unsigned seen = (unsigned)(size_t)arg; /* the job number when it was started */
    for (;;) {
        unsigned number;
        int spins = 0;
        long long idle_since = 0;
        while ((number = atomic_load_explicit(&job_number, memory_order_acquire)) == seen) {
            if (++spins < SPIN_PAUSES) {
                cpu_relax();
            } else if (idle_since == 0 || now_ns() - idle_since < IDLE_NS) {
                if (idle_since == 0) idle_since = now_ns();
                sched_yield();
            } else {
                atomic_fetch_add(&sleepers, 1);
                syscall(SYS_futex, &job_number, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
                atomic_fetch_sub(&sleepers, 1);
                spins = 0;
                idle_since = 0;
            }
        }
        seen = number;
        work_on(number);
    }
    return NULL;
}

static void after_fork_in_child(void) {
    n_workers = 0; /* the workers did not survive the fork: start them again when needed */
    atomic_store(&sleepers, 0);
    pthread_mutex_init(&pool_lock, NULL);
}

static void start_workers(void) {
    static int atfork_registered;
    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        atfork_registered = 1;
    }
    while (n_workers < n_threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        size_t number = atomic_load(&job_number);
        int ok = pthread_create(&t, &attr, worker, (void *)number) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        n_workers++;
    }
}

/* Below this many multiply-adds a product runs on the calling thread: waking a worker costs more. */
#define PARALLEL_MIN_MACS (1 << 16)

/* Runs `parts` parts of `j` on the calling thread and the workers; 0 if the pool is busy or
 * single-threaded (the caller then runs the parts itself). */
static int run_parallel(struct job j) {
    if (n_threads <= 1 || j.parts <= 1 || pthread_mutex_trylock(&pool_lock) != 0) return 0;
    start_workers();
    int threads = n_threads < n_workers + 1 ? n_threads : n_workers + 1;
    if (threads <= 1) {
        pthread_mutex_unlock(&pool_lock);
        return 0;
    }
    job = j;
    atomic_store_explicit(&parts_done, 0, memory_order_relaxed);
    unsigned number = atomic_load_explicit(&job_number, memory_order_relaxed) + 1;
    atomic_store_explicit(&ticket, (unsigned long long)number << 32, memory_order_release);
    atomic_store_explicit(&job_number, number, memory_order_release);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &job_number, FUTEX_WAKE_PRIVATE, MAX_THREADS, NULL, NULL, 0);
    work_on(number);
    for (int spins = 0; atomic_load_explicit(&parts_done, memory_order_acquire) < j.parts; spins++) {
        if (spins < SPIN_PAUSES) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&pool_lock);
    return 1;
}

static void small_m(int nn, int M, int N, int K, float alpha, const float *x, size_t ldx, const float *w,
                    size_t ldw, float beta, float *c, size_t ldc) {
    int units = (N + unit(nn) - 1) / unit(nn);
    if ((long)M * N * K >= PARALLEL_MIN_MACS) {
        int parts = n_threads * PARTS_PER_THREAD < units ? n_threads * PARTS_PER_THREAD : units;
        if (run_parallel((struct job){NULL, NULL, nn, M, N, K, x, w, ldx, ldw, ldc, c, alpha, beta, parts})) return;
    }
    if (nn) rows_nn(M, 0, N, K, x, ldx, w, ldw, c, ldc, alpha, beta);
    else rows_nt(M, 0, N, K, x, ldx, w, ldw, c, ldc, alpha, beta);
}

void mlxcel_parallel(int parts, mlxcel_task_fn fn, const void *ctx) {
    struct job j = {0};
    j.task = fn;
    j.task_ctx = ctx;
    j.parts = parts;
    if (!run_parallel(j))
        for (int p = 0; p < parts; p++) fn(ctx, p);
}

int mlxcel_threads(void) { return n_threads; }

void *mlxcel_scratch(struct mlxcel_scratch *s, size_t size) {
    if (s->size < size) {
        free(s->p);
        s->p = malloc(size);
        if (!s->p) abort();
        s->size = size;
    }
    return s->p;
}

/* ------------------------------------------------------------------------------------ routing */

static void resolve_fallback(void) {
    /* Only reached if MLX called before mlxcel_shim_init: take the next definitions in the
     * process (the BLAS loaded after this library). */
    if (!real_sgemm) real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (!real_sgemv) real_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    if (!real_sgemm) {
        fprintf(stderr, "mlxcel blas_shim: no cblas_sgemm to forward to\n");
        abort();
    }
}

/* Row-major C (M x N) = alpha * op(A) @ op(B) + beta * C as one matrix-vector product, or 0. */
static int as_gemv(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                   int ldb, float beta, float *C, int ldc) {
    if (!real_sgemv || (M != 1 && N != 1)) return 0;
    if (M == 1) { /* c (N) = op(B)^T a: a is row 0 of op(A) */
        int inc_a = ta == NoTrans ? 1 : lda;
        if (tb == NoTrans) real_sgemv(RowMajor, Trans, K, N, alpha, B, ldb, A, inc_a, beta, C, 1);
        else real_sgemv(RowMajor, NoTrans, N, K, alpha, B, ldb, A, inc_a, beta, C, 1);
    } else { /* N == 1: c (M, stride ldc) = op(A) b: b is column 0 of op(B) */
        int inc_b = tb == NoTrans ? ldb : 1;
        if (ta == NoTrans) real_sgemv(RowMajor, NoTrans, M, K, alpha, A, lda, B, inc_b, beta, C, ldc);
        else real_sgemv(RowMajor, Trans, K, M, alpha, A, lda, B, inc_b, beta, C, ldc);
    }
    return 1;
}

static void route_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                        const float *B, int ldb, float beta, float *C, int ldc) {
    if (order == ColMajor) { /* C^T = op(B)^T op(A)^T in row-major terms */
        route_sgemm(RowMajor, tb, ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
        return;
    }
    int plain = order == RowMajor && (ta == NoTrans || ta == Trans) && (tb == NoTrans || tb == Trans);
    if (plain && route != ROUTE_SGEMM && M > 0 && N > 0 && K > 0) {
        if (route == ROUTE_KERNEL && ta == NoTrans && M <= small_m_max) {
            atomic_fetch_add_explicit(&calls[2], 1, memory_order_relaxed);
            small_m(tb == NoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
            return;
        }
        if (as_gemv(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) {
            atomic_fetch_add_explicit(&calls[1], 1, memory_order_relaxed);
            return;
        }
    }
    atomic_fetch_add_explicit(&calls[0], 1, memory_order_relaxed);
    real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void mlxcel_blas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc) {
    if (!real_sgemm) resolve_fallback();
    real_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void mlxcel_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc) {
    if (!real_sgemm) resolve_fallback();
    route_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* The interposed symbol: MLX's calls land here. */
void cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                 const float *B, int ldb, float beta, float *C, int ldc) {
    if (!real_sgemm) resolve_fallback();
    route_sgemm(order, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* ------------------------------------------------------------------------------ control (ctypes) */

/* The BLAS to forward to; call once, right after loading it and before MLX runs anything. */
void mlxcel_shim_init(void *sgemm, void *sgemv) {
    real_sgemm = (sgemm_fn)sgemm;
    real_sgemv = (sgemv_fn)sgemv;
}

/* route: 0 = everything to sgemm, 1 = M/N == 1 to sgemv, 2 = small-M kernel too. threads <= 0
 * keeps the current count. Returns the vector width the kernel was compiled for. */
int mlxcel_shim_configure(int new_route, int new_small_m_max, int threads) {
    pthread_mutex_lock(&pool_lock);
    route = new_route;
    small_m_max = new_small_m_max;
    if (threads > 0) n_threads = threads < MAX_THREADS ? threads : MAX_THREADS;
    pthread_mutex_unlock(&pool_lock);
    return VL;
}

/* Calls so far by route taken: [sgemm, sgemv, kernel]. */
void mlxcel_shim_calls(long out[3]) {
    for (int i = 0; i < 3; i++) out[i] = atomic_load(&calls[i]);
}

/* ------------------------------------------------------------------------- decode-step kernels
 * The element-wise parts and the attention of a decode step, for the CPU decode
 * runtime (mlxcel_compat/runtime/cpu_decode.py), which calls them through ctypes between the
 * matrix-vector products above. Each is one call per layer where MLX runs a chain of small
 * operations, and each uses vectors where MLX's CPU loops are scalar (its exponential). */

typedef int vi __attribute__((vector_size(VL * sizeof(int)), aligned(sizeof(int))));

/* a where mask, else b (GCC's C vector extensions have no vector ?:). */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* 2 ** x for x in [-126, 126] (clamped), within 1e-7 relative: 2 ** floor(x) from the exponent
 * bits times a degree-6 polynomial of the fraction (a least-squares fit of 2 ** f on [0, 1)). */
static inline vf exp2v(vf x) {
    x = vselect(x < splat(-126.0f), splat(-126.0f), x);
    x = vselect(x > splat(126.0f), splat(126.0f), x);
    vi t = __builtin_convertvector(x, vi); /* toward zero */
    vf tf = __builtin_convertvector(t, vf);
    t += (vi)(tf > x); /* -1 where truncation went up: floor */
    vf f = x - __builtin_convertvector(t, vf);
    vf p = splat(2.18712622881867e-4f);
    p = p * f + splat(1.238241558894515e-3f);
    p = p * f + splat(9.686185978353024e-3f);
    p = p * f + splat(5.5478911846876144e-2f);
    p = p * f + splat(2.4023109674453735e-1f);
    p = p * f + splat(6.93146824836731e-1f);
    p = p * f + splat(1.0f);
    return (vf)((vi)p + (t << 23));
}

static inline float exp2s(float x) {
    vf v = splat(x);
    return exp2v(v)[0];
}

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :] ** 2) + eps) * w for `rows` rows of n (RMSNorm; per head
 * for a model's query and key norms). out may be x. */
static inline float rms_scale(const float *x, int n, float eps) {
    vf acc = {0};
    int i = 0;
    for (; i + VL <= n; i += VL) acc += loadv(x + i) * loadv(x + i);
    float ss = hsum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    return 1.0f / __builtin_sqrtf(ss / (float)n + eps);
}

void mlxcel_rms_norm(const float *x, const float *w, float *out, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++, x += n, out += n) {
        float scale = rms_scale(x, n, eps);
        for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
    }
}

/* x[r, :] += RMSNorm(b[r, :]) * w for `rows` rows of n: Gemma's norm of a branch's output (the
 * attention's, the MLP's) before it joins the residual stream, in one pass instead of a norm into
 * a buffer and a sum. */
void mlxcel_rms_norm_add(const float *b, const float *w, float *x, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++, b += n, x += n) {
        float scale = rms_scale(b, n, eps);
        for (int i = 0; i < n; i++) x[i] += b[i] * scale * w[i];
    }
}

/* RoPE of `heads` rows of d in place, with the angles' cosines and sines (d / 2 each) of one
 * position: rotating halves (x[i], x[i + d/2]), or neighbours (x[2i], x[2i + 1]) if
 * `traditional`, as mx.fast.rope computes them. */
void mlxcel_rope(float *x, int heads, int d, const float *cos, const float *sin, int traditional) {
    int half = d / 2;
    for (int h = 0; h < heads; h++, x += d)
        for (int i = 0; i < half; i++) {
            int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
            float x1 = x[a], x2 = x[b];
            x[a] = x1 * cos[i] - x2 * sin[i];
            x[b] = x1 * sin[i] + x2 * cos[i];
        }
}

/* gate = silu(gate) * up = gate * up / (1 + 2 ** (-gate log2 e)), in place: the same formula as
 * the MLX lever (runtime/cpu_fusion.py). */
void mlxcel_swiglu(float *gate, const float *up, int n) {
    const float m = -1.4426950408889634f;
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf g = loadv(gate + i);
        vf r = g * loadv(up + i) / (splat(1.0f) + exp2v(g * splat(m)));
        memcpy(gate + i, &r, sizeof r);
    }
    for (; i < n; i++) gate[i] = gate[i] * up[i] / (1.0f + exp2s(gate[i] * m));
}

/* gate = gelu_tanh(gate) * up in place, gelu_tanh(x) = 0.5 x (1 + tanh(u)) with
 * u = sqrt(2 / pi) (x + 0.044715 x^3) (mlx's nn.gelu_approx, Gemma's "gelu_pytorch_tanh"),
 * computed as x / (1 + e^(-2u)), the same value (0.5 (1 + tanh u) = 1 / (1 + e^(-2u))), with the
 * power of 2 of the gating kernel above: no tanh, and no cancellation in 1 + tanh(u) where tanh is
 * near -1 (mlx's form rounds there to a multiple of 2^-24, which this one does not). */
void mlxcel_gelu_tanh_gate(float *gate, const float *up, int n) {
    const float c = 0.7978845608028654f * -2.0f * 1.4426950408889634f; /* -2 sqrt(2 / pi) log2 e */
    const float cubic = 0.044715f;
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf x = loadv(gate + i);
        vf r = x * loadv(up + i) / (splat(1.0f) + exp2v((x + splat(cubic) * x * x * x) * splat(c)));
        memcpy(gate + i, &r, sizeof r);
    }
    for (; i < n; i++) {
        float x = gate[i];
        gate[i] = x * up[i] / (1.0f + exp2s((x + cubic * x * x * x) * c));
    }
}

/* Weights below 2 ** NEGLIGIBLE of the largest (which is 1) are set to zero: the sum is at least
 * 1, so they are far below float32's resolution of it, and multiplying the values by them could
 * produce denormal numbers, which x86 cores handle in microcode, many times slower. (Not seen on
 * the generated models, whose random weights give flat attention; trained models' is peaky.) */
#define NEGLIGIBLE -64.0f

/* s[t] = 2 ** (s[t] - max s) for t < n, in place (weights below 2 ** NEGLIGIBLE set to zero);
 * returns their sum. The caller normalises (the weights, or the output they give). */
static float exp2_shifted_row(float *s, int n) {
    float top = s[0];
    int t0 = 0;
    if (n >= VL) { /* the maximum a vector at a time (the scalar loop was a fifth of a chunk's attention) */
        vf m = loadv(s);
        for (t0 = VL; t0 + VL <= n; t0 += VL) {
            vf v = loadv(s + t0);
            m = vselect(v > m, v, m);
        }
        float lanes[VL];
        memcpy(lanes, &m, sizeof m);
        for (int l = 0; l < VL; l++) top = lanes[l] > top ? lanes[l] : top;
    }
    for (int t = t0; t < n; t++) top = s[t] > top ? s[t] : top;
    vf acc = {0};
    int t = 0;
    for (; t + VL <= n; t += VL) {
        vf x = loadv(s + t) - splat(top);
        vf e = vselect(x < splat(NEGLIGIBLE), splat(0.0f), exp2v(x));
        memcpy(s + t, &e, sizeof e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; t < n; t++) sum += s[t] = s[t] - top < NEGLIGIBLE ? 0.0f : exp2s(s[t] - top);
    return sum;
}

struct attention_job {
    const float *q;  /* (Hq, d) queries of one position */
    const float *k_new, *v_new; /* (Hk, d) its key and value, written at slot `write` first */
    float *keys, *values; /* the layer's cache, (Hk, capacity, d) */
    float *k_out, *v_out; /* NULL, or (Hk, d): the new key and value go here, not into the cache
                           * (then read only), and are attended as slot n - 1 */
    float *out;           /* (Hq, d) */
    int group, d;         /* query heads per KV head, head size */
    int write, n;         /* the slot the new key and value go to; keys seen are slots [0, n) */
    size_t head_stride;   /* capacity * d */
    float scale;          /* the softmax scale times log2 e (the exponential is a power of 2) */
};

/* KV head h of a decode step: write the new key and value, then for its `group` query heads
 * softmax(q K^T scale) V over slots [0, n). The scores go in one pass over the keys (all the
 * group's queries per key row), the products by the values in one pass over the values. */
static void attend_head(const void *ctx, int h) {
    const struct attention_job *a = ctx;
    int g = a->group, d = a->d, n = a->n;
    float *keys = a->keys + h * a->head_stride, *values = a->values + h * a->head_stride;
    const float *k_new = a->k_new + (size_t)h * d, *v_new = a->v_new + (size_t)h * d;
    int apart = a->k_out != NULL;
    if (apart) {
        memcpy(a->k_out + (size_t)h * d, k_new, d * sizeof(float));
        memcpy(a->v_out + (size_t)h * d, v_new, d * sizeof(float));
    } else {
        memcpy(keys + (size_t)a->write * d, k_new, d * sizeof(float));
        memcpy(values + (size_t)a->write * d, v_new, d * sizeof(float));
    }
    float *q = malloc(((size_t)g * d + (size_t)g * n) * sizeof(float));
    if (!q) abort();
    float *scores = q + (size_t)g * d;
    for (int i = 0; i < g * d; i++) q[i] = a->q[(size_t)h * g * d + i] * a->scale;
    if (apart) { /* each score is its own dot product (hsum4 adds as hsum): the same numbers */
        rows_nt(g, 0, n - 1, d, q, d, keys, d, scores, n, 1.0f, 0.0f);
        rows_nt(g, 0, 1, d, q, d, k_new, d, scores + (n - 1), n, 1.0f, 0.0f);
    } else {
        rows_nt(g, 0, n, d, q, d, keys, d, scores, n, 1.0f, 0.0f);
    }
    float *out = a->out + (size_t)h * g * d;
    for (int i = 0; i < g; i++) {
        float *s = scores + (size_t)i * n;
        float inv = 1.0f / exp2_shifted_row(s, n);
        for (int t = 0; t < n; t++) s[t] *= inv;
    }
    rows_nn_split(g, 0, d, n, scores, n, values, d, out, d, 1.0f, 0.0f, apart ? v_new : values, apart ? n - 1 : n);
    free(q);
}

/* A decode step's attention for every KV head of one layer, the heads spread over the pool: the
 * new key and value written at slot `write`, the queries attending slots [0, n) of the cache's
 * `capacity`. A growing cache writes at its position and sees everything before it (write = pos,
 * n = pos + 1); a sliding window's ring (mlx-lm's RotatingKVCache) writes over its oldest slot
 * once full and sees every slot, in the ring's order (the softmax does not depend on it).
 * Returns 0, or -1 (and touches nothing) if the slot or the length does not fit the capacity. */
int mlxcel_decode_attention_at(const float *q, const float *k_new, const float *v_new, float *keys,
                               float *values, float *out, int kv_heads, int group, int d, int write, int n,
                               long capacity, float scale) {
    if (write < 0 || write >= capacity || n < 1 || n > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, keys, values, NULL, NULL, out, group, d, write, n, (size_t)capacity * d, scale};
    mlxcel_parallel(kv_heads, attend_head, &a);
    return 0;
}

/* A decode step's attention over a cache it may not write (a prompt-cache entry another sequence
 * shares): slots [0, n_base) of the cache, then the new key and value, which go to k_out and
 * v_out ((Hk, d) each) instead. The same numbers as mlxcel_decode_attention at pos = n_base on a
 * cache holding the same slots. Returns 0, or -1 (touching nothing) if n_base is not in
 * [1, capacity]. */
int mlxcel_decode_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                  const float *values, float *out, float *k_out, float *v_out, int kv_heads,
                                  int group, int d, int n_base, long capacity, float scale) {
    if (n_base < 1 || n_base > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, (float *)keys, (float *)values, k_out, v_out, out, group, d,
                              n_base, n_base + 1, (size_t)capacity * d, scale};
    mlxcel_parallel(kv_heads, attend_head, &a);
    return 0;
}

/* The growing cache's case of the above: write at `pos`, attend [0, pos] (the caller keeps
 * pos < capacity). */
void mlxcel_decode_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                             float *out, int kv_heads, int group, int d, int pos, long capacity, float scale) {
    mlxcel_decode_attention_at(q, k_new, v_new, keys, values, out, kv_heads, group, d, pos, pos + 1, capacity, scale);
}

/* ------------------------------------------------------------------------- prompt-chunk attention
 * A short prompt chunk fed through the CPU decode runtime (a cache hit's rest, CpuDecoder.prefill):
 * `rows` consecutive positions of one sequence, from `pos` on. Row by row the decode kernel above
 * would read every key and value once per row; here each KV head's keys are read once per block of
 * CHUNK_QUERY_BLOCK queries, both products vectorized over their output columns (the keys
 * transposed once per head), and the parts (KV head, query block) spread over the pool. */

#define CHUNK_QUERY_BLOCK 16

struct chunk_attention_job {
    const float *q;        /* (rows, Hq * d), RoPE applied */
    const float *k_new, *v_new; /* (rows, Hk * d) */
    float *keys, *values;  /* the layer's cache, (Hk, capacity, d) */
    float *keys_t;         /* scratch: (Hk, d, ldk), each head's keys transposed, zeros after pos + rows */
    int ldk;               /* pos + rows rounded up to whole vectors, off multiples of 4 KiB */
    float *out;            /* (rows, Hq * d) */
    float *k_out, *v_out;  /* NULL, or (Hk, rows, d): the rows' keys and values go here, not into
                            * the cache (then read only, slots [0, pos) valid) */
    int rows, kv_heads, group, d, pos, blocks;
    size_t head_stride;    /* capacity * d */
    float scale;           /* the softmax scale times log2 e */
};

/* KV head h: write the chunk's keys and values into the cache (or apart), then transpose the
 * head's keys. */
static void chunk_write_head(const void *ctx, int h) {
    const struct chunk_attention_job *a = ctx;
    int d = a->d, hk = a->kv_heads, n = a->pos + a->rows;
    float *keys = a->keys + h * a->head_stride, *values = a->values + h * a->head_stride;
    float *k_rows = a->k_out ? a->k_out + (size_t)h * a->rows * d : keys + (size_t)a->pos * d;
    float *v_rows = a->v_out ? a->v_out + (size_t)h * a->rows * d : values + (size_t)a->pos * d;
    for (int r = 0; r < a->rows; r++) {
        memcpy(k_rows + (size_t)r * d, a->k_new + ((size_t)r * hk + h) * d, d * sizeof(float));
        memcpy(v_rows + (size_t)r * d, a->v_new + ((size_t)r * hk + h) * d, d * sizeof(float));
    }
    int ldk = a->ldk;
    float *kt = a->keys_t + (size_t)h * d * ldk;
    for (int t = 0; t < n; t++) {
        const float *key = t < a->pos ? keys + (size_t)t * d : k_rows + (size_t)(t - a->pos) * d;
        for (int i = 0; i < d; i++) kt[(size_t)i * ldk + t] = key[i];
    }
    for (int i = 0; i < d; i++) memset(kt + (size_t)i * ldk + n, 0, (size_t)(ldk - n) * sizeof(float));
}

/* Part p = (KV head, query block): the block's queries of the head's group against the keys up to
 * the block's last position, causally masked, softmax (shifted by the row's maximum), times the
 * values; the output normalised by each row's sum. */
static void chunk_attend_part(const void *ctx, int p) {
    static __thread struct mlxcel_scratch scratch;
    const struct chunk_attention_job *a = ctx;
    int h = p / a->blocks, j0 = (p % a->blocks) * CHUNK_QUERY_BLOCK;
    int nb = a->rows - j0 < CHUNK_QUERY_BLOCK ? a->rows - j0 : CHUNK_QUERY_BLOCK;
    int g = a->group, d = a->d, hq = a->kv_heads * g, seen = a->pos + j0 + nb;
    int ls = (seen + VL - 1) / VL * VL; /* scores a row: whole vectors (the keys' zero padding) */
    int m = g * nb; /* block rows, query head major: row gi * nb + jj */
    float *qb = mlxcel_scratch(&scratch, ((size_t)m * d * 2 + (size_t)m * ls + m) * sizeof(float));
    float *tmp = qb + (size_t)m * d, *s = tmp + (size_t)m * d, *inv = s + (size_t)m * ls;
    for (int gi = 0; gi < g; gi++)
        for (int jj = 0; jj < nb; jj++) {
            const float *src = a->q + (size_t)(j0 + jj) * hq * d + (size_t)(h * g + gi) * d;
            float *dst = qb + (size_t)(gi * nb + jj) * d;
            for (int i = 0; i < d; i++) dst[i] = src[i] * a->scale;
        }
    rows_nn(m, 0, ls, d, qb, d, a->keys_t + (size_t)h * d * a->ldk, a->ldk, s, ls, 1.0f, 0.0f);
    for (int r = 0; r < m; r++) {
        float *row = s + (size_t)r * ls;
        int visible = a->pos + j0 + r % nb + 1; /* keys [0, visible): causal */
        inv[r] = 1.0f / exp2_shifted_row(row, visible);
        memset(row + visible, 0, (size_t)(seen - visible) * sizeof(float));
    }
    const float *values = a->values + h * a->head_stride; /* slots from pos on: the rows, apart or not */
    const float *v_rows = a->v_out ? a->v_out + (size_t)h * a->rows * d : values + (size_t)a->pos * d;
    rows_nn_split(m, 0, d, seen, s, ls, values, d, tmp, d, 1.0f, 0.0f, v_rows, a->pos);
    for (int gi = 0; gi < g; gi++)
        for (int jj = 0; jj < nb; jj++) {
            int r = gi * nb + jj;
            float *dst = a->out + (size_t)(j0 + jj) * hq * d + (size_t)(h * g + gi) * d;
            for (int i = 0; i < d; i++) dst[i] = tmp[(size_t)r * d + i] * inv[r];
        }
}

static void chunk_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                            float *out, float *k_out, float *v_out, int rows, int kv_heads, int group, int d,
                            int pos, long capacity, float scale) {
    static __thread struct mlxcel_scratch keys_t;
    int blocks = (rows + CHUNK_QUERY_BLOCK - 1) / CHUNK_QUERY_BLOCK;
    int ldk = (pos + rows + VL - 1) / VL * VL;
    if (ldk % 1024 == 0) ldk += VL; /* rows 4 KiB apart share cache sets */
    float *kt = mlxcel_scratch(&keys_t, (size_t)kv_heads * d * ldk * sizeof(float));
    struct chunk_attention_job a = {q, k_new, v_new, keys, values, kt, ldk, out, k_out, v_out, rows, kv_heads,
                                    group, d, pos, blocks, (size_t)capacity * d, scale};
    mlxcel_parallel(kv_heads, chunk_write_head, &a);
    mlxcel_parallel(kv_heads * blocks, chunk_attend_part, &a);
}

/* Causal attention of `rows` consecutive positions from `pos` on: their keys and values written at
 * slots [pos, pos + rows) of the cache first, row r attending slots [0, pos + r]. Returns 0, or -1
 * (touching nothing) if the rows do not fit the capacity. */
int mlxcel_chunk_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                           float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                           float scale) {
    if (rows < 1 || pos < 0 || pos + rows > capacity) return -1;
    chunk_attention(q, k_new, v_new, keys, values, out, NULL, NULL, rows, kv_heads, group, d, pos, capacity, scale);
    return 0;
}

/* The same over a cache it may not write (a prompt-cache entry another sequence shares): slots
 * [0, pos) of the cache, then the rows, whose keys and values go to k_out and v_out ((Hk, rows, d)
 * each) instead. The same numbers as mlxcel_chunk_attention on a cache holding the same slots.
 * Returns 0, or -1 (touching nothing) if pos is not in [1, capacity]. */
int mlxcel_chunk_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                 const float *values, float *out, float *k_out, float *v_out, int rows,
                                 int kv_heads, int group, int d, int pos, long capacity, float scale) {
    if (rows < 1 || pos < 1 || pos > capacity) return -1;
    chunk_attention(q, k_new, v_new, (float *)keys, (float *)values, out, k_out, v_out, rows, kv_heads, group, d,
                    pos, capacity, scale);
    return 0;
}

/* RoPE of `rows` rows of `heads` heads of d (rows contiguous), row r with the angles at cos and sin
 * + r * d / 2 (consecutive positions). */
void mlxcel_rope_rows(float *x, int rows, int heads, int d, const float *cos, const float *sin, int traditional) {
    for (int r = 0; r < rows; r++)
        mlxcel_rope(x + (size_t)r * heads * d, heads, d, cos + (size_t)r * (d / 2), sin + (size_t)r * (d / 2),
                    traditional);
}
