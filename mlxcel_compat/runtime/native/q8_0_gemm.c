/* Q8_0 prompt chunks (GEMM): the product quant_rows.c's mlxcel_gemm_kernel hands out for Q8_0
 * weights on a CPU with AVX-512 VNNI and VL, which block_matmul.c runs for a prompt chunk instead of
 * float32 tiles.
 *
 * A prompt chunk (many activation rows, quantized to Q8_0 by ggml's from_float as llama.cpp's
 * prompts are) times weight rows [r0, r1). GEMM_ROWS weight rows at a time are copied into a
 * panel, per pair of blocks the values as u8 (w + 128: vpdpbusd takes u8 x s8) and the two
 * factors as one vector; the panel then meets every activation row, two at a time, with 16 sums
 * in registers. (w + 128) a = w a + 128 a: each pair's integer sum starts at -128 times the
 * activations' sums (per 4 values: their own vpdpbusd), so it ends at the plain w a. Per pair of
 * blocks and (weight row, activation row): one vpdpbusd, one conversion, the two factors' product
 * and one fused multiply-add, where the decode kernel (quant_rows.c) spends four more on the signs and
 * the factors (llamafile's GEMM, which ggml runs for a Q8_0 prompt on x86, takes 256 bits at a
 * time). A pair's sum and its final reduction take the same steps whatever rows, band or panel it
 * falls in, so a row's result does not depend on the others.
 */
#include <stddef.h>
#include <stdint.h>

#include "quant_blocks.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define GEMM_ROWS 8

static __thread struct mlxcel_scratch panel_scratch;

/* The sums of v[0] .. v[7]'s lanes, in order. */
static inline __m256 sums_of_eight(const __m512 v[GEMM_ROWS]) {
    __m512 t[4], u[2];
    for (int i = 0; i < 4; i++) /* v[2i]'s 256-bit halves added, then v[2i + 1]'s */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++) /* four partial sums for each of four rows, a 128-bit lane each */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    __m512 p = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    p = _mm512_add_ps(p, _mm512_shuffle_ps(p, p, 0x4e)); /* lane 4L: row L, lane 4L + 1: row L + 4 */
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), p));
}

/* `count` (1 or 2) activation rows from i0 times the panel's `rows` weight rows, into out[i * ldo + j]. */
static inline __attribute__((always_inline)) void q8_0_panel_times(int nb, const __m512i *wu, const __m512 *ws,
                                                                     const char *act, size_t act_bytes, int i0,
                                                                     int count, int rows, float *out, size_t ldo,
                                                                     float beta) {
    const __m512i k128 = _mm512_set1_epi8((char)0x80);
    __m512 acc[2][GEMM_ROWS];
    for (int c = 0; c < count; c++)
        for (int j = 0; j < GEMM_ROWS; j++) acc[c][j] = _mm512_setzero_ps();
    for (int b = 0, p = 0; b < nb; b += 2, p++) {
        int pair = b + 1 < nb;
        __m512i a[2], start[2];
        __m512 e[2];
        for (int c = 0; c < count; c++) {
            const struct q8_0_block *y = (const struct q8_0_block *)(act + (size_t)(i0 + c) * act_bytes) + b;
            a[c] = two_blocks_q8_0(y, pair);
            /* 128 x (-a): a is within -127 .. 127 (ggml's Q8_0), so -a is an int8 too */
            start[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k128, _mm512_sub_epi8(_mm512_setzero_si512(), a[c]));
            e[c] = two_factors(half_to_float(y[0].d), pair ? half_to_float(y[1].d) : 0.0f);
        }
        for (int j = 0; j < GEMM_ROWS; j++) {
            __m512i w = _mm512_loadu_si512(wu + (size_t)p * GEMM_ROWS + j);
            __m512 d = _mm512_loadu_ps((const float *)(ws + (size_t)p * GEMM_ROWS + j));
            for (int c = 0; c < count; c++) {
                __m512i q = _mm512_dpbusd_epi32(start[c], w, a[c]);
                acc[c][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_mul_ps(d, e[c]), acc[c][j]);
            }
        }
    }
    const __mmask8 keep = (__mmask8)((1u << rows) - 1);
    for (int c = 0; c < count; c++) {
        float *o = out + (size_t)(i0 + c) * ldo;
        __m256 v = sums_of_eight(acc[c]);
        if (beta != 0.0f) v = _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_maskz_loadu_ps(keep, o), v);
        _mm256_mask_storeu_ps(o, keep, v);
    }
}

/* c[i * ldc + r] = (weight row r) . (activation row i) (+ beta c[i * ldc + r]) for r0 <= r < r1,
 * i < m; weight row r is stored row rows[r] (NULL: r), row_bytes apart from data. */
void gemm_q8_0(int k, const unsigned char *data, size_t row_bytes, const int32_t *rows, int r0, int r1,
               const void *act, size_t act_bytes, int m, float *c, size_t ldc, float beta) {
    const int nb = k / 32, pairs = (nb + 1) / 2;
    __m512i *wu = mlxcel_scratch(&panel_scratch, (size_t)pairs * GEMM_ROWS * (sizeof(__m512i) + sizeof(__m512)));
    __m512 *ws = (__m512 *)(wu + (size_t)pairs * GEMM_ROWS);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int p0 = r0; p0 < r1; p0 += GEMM_ROWS) {
        int count = r1 - p0 < GEMM_ROWS ? r1 - p0 : GEMM_ROWS;
        for (int j = 0; j < GEMM_ROWS; j++) {
            const struct q8_0_block *x =
                j < count ? (const struct q8_0_block *)(data + (size_t)(rows ? rows[p0 + j] : p0 + j) * row_bytes) : NULL;
            for (int b = 0, p = 0; b < nb; b += 2, p++) {
                int pair = b + 1 < nb;
                __m512i *u = wu + (size_t)p * GEMM_ROWS + j; /* a missing row: w = 0, factors 0 */
                _mm512_storeu_si512(u, x ? _mm512_xor_si512(two_blocks_q8_0(x + b, pair), flip) : flip);
                _mm512_storeu_ps((float *)(ws + (size_t)p * GEMM_ROWS + j),
                                 x ? two_factors(half_to_float(x[b].d), pair ? half_to_float(x[b + 1].d) : 0.0f)
                                   : _mm512_setzero_ps());
            }
        }
        int i = 0;
        for (; i + 2 <= m; i += 2) q8_0_panel_times(nb, wu, ws, act, act_bytes, i, 2, count, c + p0, ldc, beta);
        if (i < m) q8_0_panel_times(nb, wu, ws, act, act_bytes, i, 1, count, c + p0, ldc, beta);
    }
}
#endif
