/* What the kernels of weights in ggml's blocks share (quant_rows.c: the decode rows and which
 * kernel serves which type; split_rows.c; k_quant_rows.c; dequantize.c): the signatures block_matmul.c
 * calls them by, ggml's type numbers, the block layouts and the vector helpers more than one of
 * them uses (static inline: each source inlines them as the single file they came from did), and
 * the kernels that quant_rows.c's look-ups hand out from the other files. */
#ifndef MLXCEL_QUANT_BLOCKS_H
#define MLXCEL_QUANT_BLOCKS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*mlxcel_rows_fn)(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                               float *out, size_t ldo);

typedef void (*mlxcel_quantize_fn)(const float *x, void *y, int64_t k);

typedef void (*mlxcel_dequantize_fn)(const void *x, float *y, int64_t k);

enum { SPLIT_TYPE_BASE = 1000 }; /* + a ggml type: that type with its rows split (rows_q4_1_split) */
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q6_K = 14,
       TYPE_Q8_K = 15, TYPE_MXFP4 = 39 }; /* enum ggml_type */
#define SPLIT_TYPE(type) (SPLIT_TYPE_BASE + (type))
/* + a ggml type (Q4_K, Q6_K, Q8_0, Q4_1, Q5_0, Q5_1, MXFP4): that type with its rows grouped
 * (rows_q4_K_grouped): whole groups of 16 rows stored block by block, each block's whole dwords as
 * the 16 rows' side by side (a vector lane each), its other bytes (Q6_K's d after the dwords, Q8_0's
 * and Q5_0's d and MXFP4's exponent ahead of them in the block) as the 16 rows' in turn; rows past the last whole group
 * as stored. A group takes the bytes of its 16 rows. */
enum { GROUPED_TYPE_BASE = 2000 };
#define GROUPED_TYPE(type) (GROUPED_TYPE_BASE + (type))
#define IS_GROUPED_TYPE(code) ((code) >= GROUPED_TYPE_BASE)
/* In a grouped weight (64-byte aligned), whether the 16 rows' bytes past their whole dwords go
 * ahead of the dwords for a block at `at`: where it starts mid-line (Q6_K's 16 x 210 bytes, Q8_0's
 * 16 x 34, Q5_0's 16 x 22: every other one), so that the dwords start a line and no vector straddles two. The layout
 * (row_layouts.c) and the kernels (k_quant_rows.c, quant_rows.c, split_rows.c) follow it;
 * block_weight._tails_ahead too. */
#define GROUP_TAILS_AHEAD(at) (((uintptr_t)(at) & 63) != 0)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* The block's 16 bytes of nibbles as two vectors of 16 int32 values: the low nibbles (values
 * 0-15) and the high ones (values 16-31), each with its fifth bit from qh where there is one
 * (dequantize.c, split_rows.c). */
static inline void nibble_halves(const uint8_t *qs, uint32_t qh, int five_bits, __m512i *first, __m512i *second) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
    *first = _mm512_and_si512(q, _mm512_set1_epi32(0x0f));
    *second = _mm512_srli_epi32(q, 4);
    if (five_bits) {
        const __m512i bit = _mm512_set1_epi32(0x10);
        *first = _mm512_mask_or_epi32(*first, (__mmask16)qh, *first, bit);
        *second = _mm512_mask_or_epi32(*second, (__mmask16)(qh >> 16), *second, bit);
    }
}

/* 32 values: (q - offset) * d, or q * d + m (with_min). */
static inline void store_block(float *y, __m512i first, __m512i second, int offset, float d, int with_min, float m) {
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    const __m512i off = _mm512_set1_epi32(offset);
    __m512 a = _mm512_cvtepi32_ps(_mm512_sub_epi32(first, off)), b = _mm512_cvtepi32_ps(_mm512_sub_epi32(second, off));
    _mm512_storeu_ps(y, with_min ? _mm512_fmadd_ps(a, vd, vm) : _mm512_mul_ps(a, vd));
    _mm512_storeu_ps(y + 16, with_min ? _mm512_fmadd_ps(b, vd, vm) : _mm512_mul_ps(b, vd));
}

/* 16 bytes at offset `at` of each of the 16 rows rowp[0..15], transposed so that v[t]'s dword r
 * holds row r's bytes 4t .. 4t + 3: a 4 x 4 transpose of dwords within 128-bit lanes, the rows
 * loaded so that lane j of z[a] is row 4j + a. The lane kernels' weight read (quant_rows.c's Q8_0,
 * split_rows.c's Q4_1): one vector lane per weight row. */
static inline __attribute__((always_inline)) void rows16_dwords(const uint8_t *const rowp[16], size_t at, __m512i v[4]) {
    __m512i z[4];
    for (int a = 0; a < 4; a++) {
        __m512i x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rowp[a] + at)));
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(rowp[4 + a] + at)), 1);
        x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(rowp[8 + a] + at)), 2);
        z[a] = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(rowp[12 + a] + at)), 3);
    }
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

#if defined(__AVX512VNNI__)
/* A Q8_0 block: 32 int8 values and a float16 factor (quant_rows.c's decode rows). */
struct q8_0_block {
    uint16_t d;
    int8_t qs[32];
};

static inline __m512i two_blocks_q8_0(const struct q8_0_block *x, int pair) {
    __m256i lo = _mm256_loadu_si256((const __m256i *)x[0].qs);
    __m256i hi = pair ? _mm256_loadu_si256((const __m256i *)x[1].qs) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* a in lanes 0-7, b in lanes 8-15. */
static inline __m512 two_factors(float a, float b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}
#endif /* AVX512VNNI */

/* The kernels quant_rows.c's look-ups hand out from the other files (not exported). */
#pragma GCC visibility push(hidden)
void mlxcel_quantize_q8_K(const float *x, void *out, int64_t k); /* k_quant_rows.c */
#if defined(__AVX512VNNI__)
void rows_q4_K(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m, float *out,
               size_t ldo); /* k_quant_rows.c */
void rows_q4_K_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                       float *out, size_t ldo);
void rows_q6_K_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                       float *out, size_t ldo);
void rows_q6_K(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m, float *out,
               size_t ldo);
#endif
void dequantize_q4_0(const void *x, float *y, int64_t k);
void dequantize_q4_1(const void *x, float *y, int64_t k);
void dequantize_q5_0(const void *x, float *y, int64_t k);
void dequantize_q5_1(const void *x, float *y, int64_t k);
#if defined(__AVX512VNNI__)
void rows_mxfp4_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                      float *out, size_t ldo); /* mxfp4_rows.c */
void rows_mxfp4_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                        float *out, size_t ldo); /* mxfp4_rows.c */
void dequantize_mxfp4_split(const void *x, float *y, int64_t k);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
void rows_q4_1_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                     float *out, size_t ldo);
void rows_q5_0_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                     float *out, size_t ldo);
void rows_q5_1_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                     float *out, size_t ldo);
void rows_q4_1_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                       float *out, size_t ldo);
void rows_q5_0_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                       float *out, size_t ldo);
void rows_q5_1_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                       float *out, size_t ldo);
void dequantize_q4_1_split(const void *x, float *y, int64_t k);
void dequantize_q5_0_split(const void *x, float *y, int64_t k);
void dequantize_q5_1_split(const void *x, float *y, int64_t k);
#endif
#pragma GCC visibility pop

#endif /* AVX512F, AVX512BW, F16C */

#endif
