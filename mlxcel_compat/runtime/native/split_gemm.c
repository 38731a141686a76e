/* Prompt chunks (GEMM) of Q4_1, Q5_0 and Q5_1 weights whose rows were split at load (split_rows.c
 * describes the layout), with 8-bit activations: what llama-server does for these types, in
 * place of float32 tiles and the BLAS. block_matmul.c takes it from mlxcel_split_gemm_kernel for a
 * split type (SPLIT_TYPE) on a CPU with AVX-512 VNNI and VL.
 *
 * The activation rows arrive quantized by ggml's from_float to the type's vec_dot_type: Q8_0 (d)
 * for Q5_0, Q8_1 (d, and s = d x the sum of the values) for the types with a minimum. Each call
 * first copies them into arrays (values, d, s), then takes PANEL_ROWS weight rows at a time: their
 * blocks unpacked once into a panel (per pair of blocks the 64 values as u8, the two factors as
 * one vector, and the minimums), which then meets every activation row, two at a time, with 16
 * sums in registers. Per pair of blocks and (weight row, activation row): one vpdpbusd (u8 weight
 * values x s8 activations), one conversion and one fused multiply-add by d_w d_a.
 *
 * A Q5_0 value is q - 16: the pair's integer sum starts at -16 times the activations' sums (one
 * vpdpbusd of 16 with -a, as q8_0_gemm.c does with 128), so it ends at the exact sum of
 * (q - 16) a, as ggml's integer dot product has it. A minimum m_w adds m_w s_a per block, summed
 * in a vector of its own. Every (weight row, activation row) takes the same operations in the
 * same order whatever panel, band or chunk it falls in, so a row's result does not depend on how
 * many rows share the call (the prompt-chunk property block_layers.py relies on).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
#define PANEL_ROWS 8
#define SPLIT_GROUP 16 /* blocks a group of a split row (block_weight.SPLIT_GROUP) */

struct gemm_form {
    int five_bits; /* a fifth bit a value (qh) */
    int minimum;   /* a minimum a block (else values are offset by 16) */
};

static const struct gemm_form Q4_1_FORM = {0, 1}, Q5_0_FORM = {1, 0}, Q5_1_FORM = {1, 1};

static __thread struct mlxcel_scratch panel_scratch, act_scratch;

/* The sums of v[0] .. v[7]'s lanes, in order (the same reduction as q8_0_gemm.c's). */
static inline __m256 sums_of_eight(const __m512 v[PANEL_ROWS]) {
    __m512 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    __m512 p = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    p = _mm512_add_ps(p, _mm512_shuffle_ps(p, p, 0x4e));
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), p));
}

/* One split row's blocks into the panel's column j: per pair p the values (u8) at wu[p * PANEL_ROWS + j]
 * and the factors at ws[...]; the minimums (or nothing) at mw[b]. A missing row (row NULL): zeros. */
static void unpack_row(const uint8_t *row, int nb, int j, __m512i *wu, __m512 *ws, float *mw, struct gemm_form form) {
    const __m512i shift = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0, 0x0004000400040004LL,
                                           0x0004000400040004LL, 0, 0); /* high nibbles in 128-bit lanes 1 and 3 */
    const __m512i low = _mm512_set1_epi8(0x0f), twice = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    const __m512i fifth = _mm512_set1_epi8(0x10);
    const int block_bytes = 18 + 2 * form.minimum + 4 * form.five_bits;
    for (int b0 = 0; b0 < nb; b0 += SPLIT_GROUP) {
        const int count = nb - b0 < SPLIT_GROUP ? nb - b0 : SPLIT_GROUP;
        const uint8_t *part = row ? row + (size_t)b0 * block_bytes : NULL;
        const size_t at_qh = (size_t)count * (2 + 2 * form.minimum), at_nibbles = at_qh + (size_t)count * 4 * form.five_bits;
        for (int q = 0; q < count; q += 2) {
            const int b = b0 + q, pair = q + 1 < count, p = b / 2;
            __m512i v = _mm512_setzero_si512();
            __m512 f = _mm512_setzero_ps();
            if (part) {
                const uint16_t *factors = (const uint16_t *)part;
                const uint8_t *nibbles = part + at_nibbles + (size_t)q * 16;
                __m512i raw = pair ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)nibbles))
                                   : _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)nibbles));
                v = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi64(twice, raw), shift), low);
                if (form.five_bits) { /* bit i of the two blocks' qh is value i's fifth bit: byte i of v */
                    uint64_t word;
                    uint32_t one;
                    if (pair) memcpy(&word, part + at_qh + (size_t)q * 4, 8);
                    else memcpy(&one, part + at_qh + (size_t)q * 4, 4), word = one;
                    v = _mm512_mask_add_epi8(v, _cvtu64_mask64(word), v, fifth);
                }
                if (!pair) v = _mm512_maskz_mov_epi32(0x00ff, v);
                f = two_factors(half_to_float(factors[q]), pair ? half_to_float(factors[q + 1]) : 0.0f);
                if (form.minimum) {
                    mw[b] = half_to_float(factors[count + q]);
                    if (pair) mw[b + 1] = half_to_float(factors[count + q + 1]);
                }
            } else if (form.minimum) {
                mw[b] = 0.0f;
                if (pair) mw[b + 1] = 0.0f;
            }
            _mm512_storeu_si512(wu + (size_t)p * PANEL_ROWS + j, v);
            _mm512_storeu_ps((float *)(ws + (size_t)p * PANEL_ROWS + j), f);
        }
    }
}

/* `count` (1 or 2) activation rows from i0 times the panel's `rows` weight rows, into out[i * ldo + j]. */
static inline __attribute__((always_inline)) void panel_times(int nb, const __m512i *wu, const __m512 *ws,
                                                              const float *mw, size_t mw_stride, const int8_t *q,
                                                              const float *d, const float *s, int i0, int count,
                                                              int rows, float *out, size_t ldo, float beta,
                                                              struct gemm_form form) {
    const __m512i sixteen = _mm512_set1_epi8(16);
    __m512 acc[2][PANEL_ROWS];
    for (int c = 0; c < count; c++)
        for (int j = 0; j < PANEL_ROWS; j++) acc[c][j] = _mm512_setzero_ps();
    for (int b = 0, p = 0; b < nb; b += 2, p++) {
        const int pair = b + 1 < nb;
        __m512i a[2], start[2];
        __m512 e[2];
        for (int c = 0; c < count; c++) {
            const int8_t *y = q + (size_t)(i0 + c) * nb * 32 + (size_t)b * 32;
            const float *dy = d + (size_t)(i0 + c) * nb + b;
            a[c] = pair ? _mm512_loadu_si512(y) : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y));
            if (!pair) a[c] = _mm512_maskz_mov_epi32(0x00ff, a[c]);
            /* Q5_0: 16 x (-a), so the sum ends at (q - 16) a; a is within -127 .. 127 (ggml's Q8_0) */
            start[c] = form.minimum ? _mm512_setzero_si512()
                                    : _mm512_dpbusd_epi32(_mm512_setzero_si512(), sixteen,
                                                          _mm512_sub_epi8(_mm512_setzero_si512(), a[c]));
            e[c] = two_factors(dy[0], pair ? dy[1] : 0.0f);
        }
        for (int j = 0; j < PANEL_ROWS; j++) {
            __m512i w = _mm512_loadu_si512(wu + (size_t)p * PANEL_ROWS + j);
            __m512 f = _mm512_loadu_ps((const float *)(ws + (size_t)p * PANEL_ROWS + j));
            for (int c = 0; c < count; c++) {
                __m512i sum = _mm512_dpbusd_epi32(start[c], w, a[c]);
                acc[c][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(f, e[c]), acc[c][j]);
            }
        }
    }
    const __mmask8 keep = (__mmask8)((1u << rows) - 1);
    for (int c = 0; c < count; c++) {
        __m256 v = sums_of_eight(acc[c]);
        if (form.minimum) { /* + m_w s_a over the blocks, 16 at a time */
            __m512 mins[PANEL_ROWS];
            const float *sy = s + (size_t)(i0 + c) * nb;
            for (int j = 0; j < PANEL_ROWS; j++) mins[j] = _mm512_setzero_ps();
            for (int b0 = 0; b0 < nb; b0 += 16) {
                const __mmask16 in = (__mmask16)(nb - b0 < 16 ? (1u << (nb - b0)) - 1 : 0xffff);
                __m512 sv = _mm512_maskz_loadu_ps(in, sy + b0);
                for (int j = 0; j < PANEL_ROWS; j++)
                    mins[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(in, mw + j * mw_stride + b0), sv, mins[j]);
            }
            v = _mm256_add_ps(v, sums_of_eight(mins));
        }
        float *o = out + (size_t)(i0 + c) * ldo;
        if (beta != 0.0f) v = _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_maskz_loadu_ps(keep, o), v);
        _mm256_mask_storeu_ps(o, keep, v);
    }
}

/* c[i * ldc + r] = (weight row r) . (activation row i) (+ beta c[i * ldc + r]) for r0 <= r < r1,
 * i < m; weight row r is stored row rows[r] (NULL: r), row_bytes apart from data. */
static inline __attribute__((always_inline)) void split_gemm(int k, const unsigned char *data, size_t row_bytes,
                                                             const int32_t *rows, int r0, int r1, const void *act,
                                                             size_t act_bytes, int m, float *c, size_t ldc,
                                                             float beta, struct gemm_form form) {
    const int nb = k / 32, pairs = (nb + 1) / 2;
    const size_t mw_stride = (size_t)nb;
    __m512i *wu = mlxcel_scratch(&panel_scratch, (size_t)pairs * PANEL_ROWS * (sizeof(__m512i) + sizeof(__m512)) +
                                                     (size_t)PANEL_ROWS * mw_stride * sizeof(float));
    __m512 *ws = (__m512 *)(wu + (size_t)pairs * PANEL_ROWS);
    float *mw = (float *)(ws + (size_t)pairs * PANEL_ROWS);
    /* the activation rows' values, d and s (Q8_0: 2 bytes of d, 32 values; Q8_1: d, s, 32 values) */
    float *d = mlxcel_scratch(&act_scratch, (size_t)m * nb * (32 + 2 * sizeof(float))), *s = d + (size_t)m * nb;
    int8_t *q = (int8_t *)(s + (size_t)m * nb);
    const size_t head = form.minimum ? 4 : 2;
    for (int i = 0; i < m; i++) {
        const uint8_t *y = (const uint8_t *)act + (size_t)i * act_bytes;
        for (int b = 0; b < nb; b++, y += head + 32) {
            uint16_t h[2];
            memcpy(h, y, head);
            d[(size_t)i * nb + b] = half_to_float(h[0]);
            if (form.minimum) s[(size_t)i * nb + b] = half_to_float(h[1]);
            memcpy(q + ((size_t)i * nb + b) * 32, y + head, 32);
        }
    }
    for (int p0 = r0; p0 < r1; p0 += PANEL_ROWS) {
        const int count = r1 - p0 < PANEL_ROWS ? r1 - p0 : PANEL_ROWS;
        for (int j = 0; j < PANEL_ROWS; j++)
            unpack_row(j < count ? data + (size_t)(rows ? rows[p0 + j] : p0 + j) * row_bytes : NULL, nb, j, wu, ws,
                       mw + j * mw_stride, form);
        int i = 0;
        for (; i + 2 <= m; i += 2) panel_times(nb, wu, ws, mw, mw_stride, q, d, s, i, 2, count, c + p0, ldc, beta, form);
        if (i < m) panel_times(nb, wu, ws, mw, mw_stride, q, d, s, i, 1, count, c + p0, ldc, beta, form);
    }
}

#define SPLIT_GEMM(NAME, FORM)                                                                                    \
    static void gemm_##NAME##_split(int k, const unsigned char *data, size_t row_bytes, const int32_t *rows,      \
                                    int r0, int r1, const void *act, size_t act_bytes, int m, float *c,          \
                                    size_t ldc, float beta) {                                                     \
        split_gemm(k, data, row_bytes, rows, r0, r1, act, act_bytes, m, c, ldc, beta, FORM);                      \
    }

SPLIT_GEMM(q4_1, Q4_1_FORM)
SPLIT_GEMM(q5_0, Q5_0_FORM)
SPLIT_GEMM(q5_1, Q5_1_FORM)
#endif

/* This library's 8-bit-activation product of a prompt chunk with split weights of the type
 * (SPLIT_TYPE(ggml type)), or NULL (float32 tiles). */
mlxcel_gemm_fn mlxcel_split_gemm_kernel(int split_type) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)
    switch (split_type) {
    case SPLIT_TYPE(TYPE_Q4_1): return gemm_q4_1_split;
    case SPLIT_TYPE(TYPE_Q5_0): return gemm_q5_0_split;
    case SPLIT_TYPE(TYPE_Q5_1): return gemm_q5_1_split;
    default: break;
    }
#endif
    (void)split_type;
    return NULL;
}
