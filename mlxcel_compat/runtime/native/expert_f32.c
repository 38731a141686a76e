/* The grouped expert product over float32 stacks (mlx-lm's SwitchLinear weights, (n_expert, rows,
 * k), a directory's or a float GGUF's experts; runtime/decode_moe.py widens 16-bit stacks to
 * float32 once at load): what mlxcel_expert_matmul_shared does for stacks in ggml's blocks, with
 * the shim's float32 product (mlxcel_sgemm: the small-M kernel for a decode step's few rows, the
 * BLAS's GEMM for a prompt chunk's many). Each chosen expert's rows are read once for every pair
 * that chose it, and no other expert's. The small-M kernel computes a row the same way whatever
 * else shares its group, so a row's output is the same alone or batched. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blas_shim.h"
#include "decode_pass.h"
#include "thread_pool.h"

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };

/* Per-thread scratch: a group's source rows gathered contiguous. */
static __thread struct mlxcel_scratch gathered;

int mlxcel_expert_matmul_f32(int count, const float *const *ws, int n_expert, int rows, int k, int groups,
                             const int32_t *expert, const int32_t *start, const int32_t *source, const float *x,
                             long ldx, float *const *cs, long ldc) {
    for (int g = 0; g < groups; g++)
        if (expert[g] < 0 || expert[g] >= n_expert) return -1;
    for (int g = 0; g < groups; g++) {
        int m = start[g + 1] - start[g];
        if (m <= 0) continue;
        const float *a = x + (size_t)start[g] * ldx;
        long lda = ldx;
        if (source && m == 1) { /* one pair (a decode step's usual group): its row of x in place */
            a = x + (size_t)source[start[g]] * ldx;
        } else if (source) { /* the group's rows of x, in its pairs' order */
            float *buf = mlxcel_scratch(&gathered, sizeof(float) * (size_t)m * (size_t)k);
            for (int i = 0; i < m; i++)
                memcpy(buf + (size_t)i * k, x + (size_t)source[start[g] + i] * ldx, sizeof(float) * (size_t)k);
            a = buf, lda = k;
        }
        for (int t = 0; t < count; t++)
            mlxcel_sgemm(RowMajor, NoTrans, Trans, m, rows, k, 1.0f, a, (int)lda,
                         ws[t] + (size_t)expert[g] * rows * k, k, 0.0f, cs[t] + (size_t)start[g] * ldc, (int)ldc);
    }
    return 0;
}
