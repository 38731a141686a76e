/* One weight row in ggml's blocks times up to MAX_ROWS activation rows quantized by ggml, with
 * AVX-512 VNNI: what block_matmul.c's decode products run instead of ggml's vec_dot where this
 * file has a kernel for the weight's type (mlxcel_rows_kernel).
 *
 * Why: ggml's x86 vec_dot for these types is written for AVX2 (one 32-byte vector at a time,
 * maddubs then madd), and computes one weight row with one activation row per call: a batch of
 * m decode rows unpacks every weight block m times, and a row as short as a small model's (768
 * values: 3 Q4_K super-blocks) pays the call's set-up and final reduction on few blocks. Here a
 * weight row's block is unpacked once for all the activation rows, the products are vpdpbusd
 * (u8 x s8 sums of four, one instruction per 64 values), and each activation row's sums stay
 * in vector registers until the row is done.
 *
 * The arithmetic is ggml's: the same integer products of the same quantized values (the
 * activations are what ggml's from_float made), scaled by the same float16 block factors; only
 * the order in which the float products are added differs (a few units of float32 rounding of
 * the sum). Each activation row's result is computed by the same operations whatever m is, so a
 * row of a batch is bit-identical to the row alone.
 *
 * Types: Q4_K x Q8_K. Without AVX-512 BW and VNNI, mlxcel_rows_kernel returns NULL and ggml's
 * vec_dot serves every type.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef void (*mlxcel_rows_fn)(int k, const void *w, const void *act, size_t act_bytes, int m, float *out);

enum { TYPE_Q4_K = 12 }; /* enum ggml_type */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#include <immintrin.h>

#define QK_K 256
#define MAX_ROWS 4 /* activation rows per pass over a weight row (their sums stay in registers) */

struct q4_K_block { /* block_q4_K */
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
};

struct q8_K_block { /* block_q8_K */
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
};

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

/* The eight 6-bit scales and mins of a Q4_K block, as bytes (ggml's get_scale_min_k4). */
static inline void q4_K_scales(const uint8_t *s, uint64_t *scales, uint64_t *mins) {
    uint32_t u0, u1, u2;
    memcpy(&u0, s, 4);
    memcpy(&u1, s + 4, 4);
    memcpy(&u2, s + 8, 4);
    uint32_t sc_lo = u0 & 0x3f3f3f3fu, m_lo = u1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4);
    *scales = (uint64_t)sc_lo | (uint64_t)sc_hi << 32;
    *mins = (uint64_t)m_lo | (uint64_t)m_hi << 32;
}

/* Rows of Q4_K x Q8_K. A block's 128 bytes hold its 256 values as 4 chunks of 64: the low
 * nibbles of 32 bytes are values 0-31 of a chunk, the high nibbles 32-63. Loaded 64 bytes at a
 * time, the low nibbles are sub-blocks (0, 2) (or (4, 6)) and the high ones (1, 3) (or (5, 7));
 * the activations' 256-bit halves are paired to match. Products: u8 x s8 pairs summed to int16
 * (at most 2 x 15 x 128), then times the sub-blocks' scales summed to int32 (vpmaddwd). */
static inline __attribute__((always_inline)) void q4_K_rows(int k, const void *w, const void *act, size_t act_bytes,
                                                              int m, float *out) {
    const struct q4_K_block *x = w;
    const int nb = k / QK_K;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i pick01 = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i step1 = _mm512_set1_epi16(1), step4 = _mm512_set1_epi16(4);
    const __m128i pair = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m512 acc[MAX_ROWS];
    __m256 acc_m[MAX_ROWS];
    for (int r = 0; r < m; r++) {
        acc[r] = _mm512_setzero_ps();
        acc_m[r] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        uint64_t sc, mn;
        q4_K_scales(x[b].scales, &sc, &mn);
        __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        __m512i s01 = _mm512_permutexvar_epi16(pick01, sc16);
        __m512i s23 = _mm512_permutexvar_epi16(_mm512_add_epi16(pick01, step1), sc16);
        __m512i s45 = _mm512_permutexvar_epi16(_mm512_add_epi16(pick01, step4), sc16);
        __m512i s67 = _mm512_permutexvar_epi16(_mm512_add_epi16(pick01, _mm512_add_epi16(step4, step1)), sc16);
        __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn), pair));
        __m512i q0 = _mm512_loadu_si512(x[b].qs), q1 = _mm512_loadu_si512(x[b].qs + 64);
        __m512i lo0 = _mm512_and_si512(q0, low), hi0 = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low);
        __m512i lo1 = _mm512_and_si512(q1, low), hi1 = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low);
        float d = half_to_float(x[b].d), dmin = half_to_float(x[b].dmin);
        for (int r = 0; r < m; r++) {
            const struct q8_K_block *y = (const struct q8_K_block *)((const char *)act + (size_t)r * act_bytes) + b;
            __m512i a0 = _mm512_loadu_si512(y->qs), a1 = _mm512_loadu_si512(y->qs + 64);
            __m512i a2 = _mm512_loadu_si512(y->qs + 128), a3 = _mm512_loadu_si512(y->qs + 192);
            __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(lo0, _mm512_shuffle_i64x2(a0, a1, 0x44)), s01);
            p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_maddubs_epi16(hi0, _mm512_shuffle_i64x2(a0, a1, 0xee)), s23));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_maddubs_epi16(lo1, _mm512_shuffle_i64x2(a2, a3, 0x44)), s45));
            p = _mm512_add_epi32(p, _mm512_madd_epi16(_mm512_maddubs_epi16(hi1, _mm512_shuffle_i64x2(a2, a3, 0xee)), s67));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(d * y->d), acc[r]);
            __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            acc_m[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins)), _mm256_set1_ps(dmin * y->d), acc_m[r]);
        }
    }
    for (int r = 0; r < m; r++) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc_m[r]), _mm256_extractf128_ps(acc_m[r], 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[r] = hsum512(acc[r]) - _mm_cvtss_f32(h);
    }
}

/* Activation rows in passes of MAX_ROWS (each pass's count a constant, so its loop unrolls). */
static void rows_q4_K(int k, const void *w, const void *act, size_t act_bytes, int m, float *out) {
    int r = 0;
    for (; r + 4 <= m; r += 4) q4_K_rows(k, w, (const char *)act + r * act_bytes, act_bytes, 4, out + r);
    switch (m - r) {
    case 3: q4_K_rows(k, w, (const char *)act + r * act_bytes, act_bytes, 3, out + r); break;
    case 2: q4_K_rows(k, w, (const char *)act + r * act_bytes, act_bytes, 2, out + r); break;
    case 1: q4_K_rows(k, w, (const char *)act + r * act_bytes, act_bytes, 1, out + r); break;
    }
}

mlxcel_rows_fn mlxcel_rows_kernel(int ggml_type) {
    switch (ggml_type) {
    case TYPE_Q4_K: return rows_q4_K;
    default: return NULL;
    }
}
#else
mlxcel_rows_fn mlxcel_rows_kernel(int ggml_type) {
    (void)ggml_type;
    return NULL;
}
#endif
