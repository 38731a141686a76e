/* What the interposer (blas_shim.c) gives the library's other sources: the BLAS's own cblas_sgemm
 * and cblas_sgemm as the shim routes it. */
#ifndef MLXCEL_BLAS_SHIM_H
#define MLXCEL_BLAS_SHIM_H

/* The BLAS's own cblas_sgemm (the one the shim forwards to), row-major or column-major. */
void mlxcel_blas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                       const float *B, int ldb, float beta, float *C, int ldc);

/* cblas_sgemm as the shim routes it (its small-M kernel for few rows, the BLAS's own otherwise). */
void mlxcel_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                  int ldb, float beta, float *C, int ldc);

#endif
