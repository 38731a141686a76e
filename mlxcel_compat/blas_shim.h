/* What blas_shim.c shares with the library's other sources (block_matmul.c): its thread pool and
 * the BLAS it forwards to. */
#ifndef MLXCEL_BLAS_SHIM_H
#define MLXCEL_BLAS_SHIM_H

#include <stddef.h>

/* One part of a task: parts are numbered 0 .. parts - 1 and may run on any thread, in any order. */
typedef void (*mlxcel_task_fn)(const void *ctx, int part);

/* Runs every part of a task on the shim's threads (the calling thread included) and returns when
 * all are done; on the calling thread alone if the pool is busy or has one thread. */
void mlxcel_parallel(int parts, mlxcel_task_fn fn, const void *ctx);

/* How many threads the pool runs tasks on. */
int mlxcel_threads(void);

/* A buffer kept per thread (declare it __thread) and grown as needed, for the products' scratch. */
struct mlxcel_scratch {
    void *p;
    size_t size;
};

/* At least `size` bytes of `s` (its contents are not kept when it grows); aborts when out of memory. */
void *mlxcel_scratch(struct mlxcel_scratch *s, size_t size);

/* The BLAS's own cblas_sgemm (the one the shim forwards to), row-major or column-major. */
void mlxcel_blas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc);

#endif
