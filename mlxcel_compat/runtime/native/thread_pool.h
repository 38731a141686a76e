/* The shim's thread pool (thread_pool.c), which every source of the library runs its parallel work
 * on (block products, the decode runtime's kernels, ggml_repack.c's graphs), and the per-thread
 * scratch buffers they compute in. */
#ifndef MLXCEL_THREAD_POOL_H
#define MLXCEL_THREAD_POOL_H

#include <stddef.h>

/* One part of a task: parts are numbered 0 .. parts - 1 and may run on any thread, in any order. */
typedef void (*mlxcel_task_fn)(const void *ctx, int part);

/* Runs every part of a task on the shim's threads (the calling thread included) and returns when
 * all are done; on the calling thread alone if the pool is busy or has one thread. */
void mlxcel_parallel(int parts, mlxcel_task_fn fn, const void *ctx);

/* How many threads the pool runs tasks on. */
int mlxcel_threads(void);

/* How many threads a prompt chunk's ggml graph runs on (--threads-batch; the pool's count unless set). */
int mlxcel_batch_threads(void);

/* Sets that count (threads <= 0: back to the pool's). Read when a graph starts, so set it before serving. */
void mlxcel_set_batch_threads(int threads);

/* A buffer kept per thread (declare it __thread) and grown as needed, for the products' scratch. */
struct mlxcel_scratch {
    void *p;
    size_t size;
};

/* At least `size` bytes of `s` (its contents are not kept when it grows); aborts when out of memory. */
void *mlxcel_scratch(struct mlxcel_scratch *s, size_t size);

/* For the interposer (blas_shim.c) only, not exported from the library: */
#pragma GCC visibility push(hidden)

/* c (M x N, row stride ldc) = alpha * x @ w^T (w: N x K) + beta * c, or x @ w (nn: w is K x N),
 * by the small-M kernel (small_m_kernel.h), its outputs in parts over the pool when the product is
 * big enough to pay for waking it. */
void mlxcel_small_m(int nn, int M, int N, int K, float alpha, const float *x, size_t ldx, const float *w,
                    size_t ldw, float beta, float *c, size_t ldc);

/* Sets how many threads the pool runs on (at most MAX_THREADS; threads <= 0 keeps the count),
 * waiting for a job in progress to end first. */
void mlxcel_set_threads(int threads);

#pragma GCC visibility pop

#endif
