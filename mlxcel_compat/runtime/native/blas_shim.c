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
 *     the small-M kernel (small_m_kernel.h): every weight row is read once and multiplied with all
 *     M rows of A while it is in registers, on all cores (thread_pool.c); A @ B with
 *     M <= small_m_max (attention's probabilities @ values) likewise, streaming the rows of B;
 *   - other M == 1 or N == 1 products go to OpenBLAS's cblas_sgemv;
 *   - everything else goes to OpenBLAS's cblas_sgemm unchanged.
 *
 * This file holds that routing and the library's control functions (ctypes). The library also
 * carries the kernels of the CPU decode runtime (mlxcel_compat/runtime/cpu_decode.py): RMS norms
 * (Gemma's on a residual branch too), RoPE, SiLU and GELU-tanh gating (elementwise.c) and a decode
 * step's attention (over a growing cache or a sliding window's ring) and a prompt chunk's
 * (attention.c), which run decode steps (one sequence or a batch) between calls to the small-M
 * kernel, on the same thread pool.
 *
 * No dependency but libc and pthreads; compiled for the machine it runs on (-march=native).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "blas_shim.h"
#include "thread_pool.h"
#include "vector_math.h"

/* CBLAS enum values (cblas.h). */
enum { RowMajor = 101, ColMajor = 102, NoTrans = 111, Trans = 112, ConjTrans = 113 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *,
                         int);

/* Routes, as mlxcel_shim_configure takes them. */
enum { ROUTE_SGEMM = 0, ROUTE_GEMV = 1, ROUTE_KERNEL = 2 };

static sgemm_fn real_sgemm;
static sgemv_fn real_sgemv;
static int route = ROUTE_KERNEL;
static int small_m_max = 16;
static atomic_long calls[3]; /* by route actually taken: sgemm, sgemv, kernel */

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
            mlxcel_small_m(tb == NoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
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
    route = new_route;
    small_m_max = new_small_m_max;
    mlxcel_set_threads(threads);
    return VL;
}

/* Calls so far by route taken: [sgemm, sgemv, kernel]. */
void mlxcel_shim_calls(long out[3]) {
    for (int i = 0; i < 3; i++) out[i] = atomic_load(&calls[i]);
}
