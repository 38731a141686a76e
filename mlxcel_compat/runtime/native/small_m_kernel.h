/* The shim's few-row matrix kernel: C = alpha * A @ B^T (rows_nt: a linear layer's weight rows)
 * or alpha * A @ B (rows_nn: attention's probabilities @ values) for up to a few rows of A, every
 * row of B read once for all of them while it is in registers. The thread pool runs it in parts
 * for the interposed cblas_sgemm (thread_pool.c), the decode runtime's attention on its own
 * (attention.c, chunk_attention.c). Defined here, static, so that each source compiles its own copy and
 * inlines (or specializes) it where the one file they came from did.
 *
 * The kernel computes each output element as the same sequence of operations whatever M is and
 * whichever thread runs it (vector partial sums over k in order, a fixed reduction tree, then the
 * scalar tail), so a row of a batched product is bit-identical to the same row computed alone. */
#ifndef MLXCEL_SMALL_M_KERNEL_H
#define MLXCEL_SMALL_M_KERNEL_H

#include <stddef.h>
#include <string.h>

#include "vector_math.h"

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

#endif
