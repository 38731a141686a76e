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

/* cblas_sgemm as the shim routes it (its small-M kernel for few rows, the BLAS's own otherwise). */
void mlxcel_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc);

/* The decode runtime's kernels (blas_shim.c), for decode_pass.c's layer loop. */
void mlxcel_rms_norm(const float *x, const float *w, float *out, int rows, int n, float eps);
void mlxcel_rms_norm_add(const float *b, const float *w, float *x, int rows, int n, float eps);
void mlxcel_rope(float *x, int heads, int d, const float *cos, const float *sin, int traditional);
void mlxcel_rope_rows(float *x, int rows, int heads, int d, const float *cos, const float *sin, int traditional);
void mlxcel_swiglu(float *gate, const float *up, int n);
void mlxcel_gelu_tanh_gate(float *gate, const float *up, int n);
int mlxcel_decode_attention_at(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                               float *out, int kv_heads, int group, int d, int write, int n, long capacity,
                               float scale);
int mlxcel_decode_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                  const float *values, float *out, float *k_out, float *v_out, int kv_heads,
                                  int group, int d, int n_base, long capacity, float scale);
int mlxcel_chunk_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                           float *out, int rows, int kv_heads, int group, int d, int pos, long capacity, float scale);
int mlxcel_chunk_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                 const float *values, float *out, float *k_out, float *v_out, int rows,
                                 int kv_heads, int group, int d, int pos, long capacity, float scale);

#endif
