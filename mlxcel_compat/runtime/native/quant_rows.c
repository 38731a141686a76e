/* Weight rows in ggml's K-quant blocks times activation rows quantized by ggml (Q8_K), with
 * AVX-512: what block_matmul.c's decode products run instead of ggml's vec_dot for the types this
 * file has a kernel for (mlxcel_rows_kernel).
 *
 * Why: ggml's x86 vec_dot for these types is written for AVX2 (32 values per instruction) and
 * computes one weight row with one activation row per call, unpacking the row's blocks (4- or
 * 6-bit values, 6- or 8-bit sub-block scales) each time: a batch of m decode rows unpacks every
 * weight block m times, and a row as short as a small model's (768 values: 3 super-blocks) pays
 * the call's set-up and final reduction on few blocks. Here the blocks are unpacked once per
 * pass, 64 values per instruction, for two weight rows against one activation row (sharing its
 * loads) or for one weight row against up to MAX_ROWS activation rows (sharing the unpacking),
 * and each pair's sums stay in vector registers until its row is done.
 *
 * The arithmetic is ggml's: the same integer products of the same quantized values (the
 * activations are what ggml's from_float made), scaled by the same float16 block factors; only
 * the order in which the float products are added differs (a few units of float32 rounding of
 * the sum). Each (weight row, activation row) pair takes the same operations in the same order
 * whatever the other rows of the call are, so a row of a batch is bit-identical to the row alone.
 *
 * Types: Q4_K and Q6_K, the K-quants of the common Q4_K_M and Q6_K files, whose blocks carry a
 * scale per 32 or 16 values: there the shared unpacking is most of the saving; and Q8_0, whose
 * products are one vpdpbusd per 64 values (AVX-512 VNNI) where ggml's AVX2 code takes four
 * instructions per 32 (scripts/bench_quant_rows.py, docs/benchmarks/quantized.md). Q4_1 over
 * ggml's own layout measured 0.75-1.07x (one row): its kernel here reads rows rearranged at load
 * (factors ahead of nibbles: see "rows split" below), 1.5-2.5x; Q5_0 and Q5_1 likewise. ggml's vec_dot serves the other
 * types, and every type on a CPU without AVX-512 BW (mlxcel_rows_kernel returns NULL). This file
 * also expands Q4_0-Q5_1 blocks to float32 (mlxcel_dequantizer), ggml's being scalar code, and
 * multiplies Q8_0 prompt chunks by its own int8 GEMM (mlxcel_gemm_kernel, "Q8_0 prompt chunks").
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blas_shim.h"

typedef void (*mlxcel_rows_fn)(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                               float *out, size_t ldo);

typedef void (*mlxcel_quantize_fn)(const float *x, void *y, int64_t k);

typedef void (*mlxcel_gemm_fn)(int k, const unsigned char *data, size_t row_bytes, const int32_t *rows, int r0, int r1,
                               const void *act, size_t act_bytes, int m, float *c, size_t ldc, float beta);

typedef void (*mlxcel_dequantize_fn)(const void *x, float *y, int64_t k);

enum { SPLIT_TYPE_BASE = 1000 }; /* + a ggml type: that type with its rows split (rows_q4_1_split) */
enum { TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q6_K = 14,
       TYPE_Q8_K = 15 }; /* enum ggml_type */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
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

/* acc + the int16 pairs of p times those of s, summed to int32: one vpdpwssd with AVX-512 VNNI,
 * vpmaddwd and an add without (the same integers either way). */
#if defined(__AVX512VNNI__)
#define SCALED_SUM(acc, p, s) _mm512_dpwssd_epi32((acc), (p), (s))
#else
#define SCALED_SUM(acc, p, s) _mm512_add_epi32((acc), _mm512_madd_epi16((p), (s)))
#endif

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

/* One Q4_K block's weights, unpacked: the four 64-byte vectors of 4-bit values (sub-blocks
 * (0, 2), (1, 3), (4, 6), (5, 7)), their scales as 16-bit lanes matching them, the mins as 16-bit
 * pairs matching the activations' 16-value sums, and the block's two factors. */
struct q4_K_unpacked {
    __m512i q[4], s[4];
    __m256i mins;
    float d, dmin;
};

static inline __attribute__((always_inline)) void q4_K_unpack(const struct q4_K_block *x, struct q4_K_unpacked *u) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i pick = _mm512_set_epi16(2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i pair = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    uint64_t sc, mn;
    q4_K_scales(x->scales, &sc, &mn);
    __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    static const short first[4] = {0, 1, 4, 5}; /* sub-blocks (first, first + 2) in each vector */
    for (int v = 0; v < 4; v++) u->s[v] = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16(first[v])), sc16);
    u->mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn), pair));
    __m512i q0 = _mm512_loadu_si512(x->qs), q1 = _mm512_loadu_si512(x->qs + 64);
    u->q[0] = _mm512_and_si512(q0, low);
    u->q[1] = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low);
    u->q[2] = _mm512_and_si512(q1, low);
    u->q[3] = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low);
    u->d = half_to_float(x->d);
    u->dmin = half_to_float(x->dmin);
}

/* The activations of one Q8_K block paired with the unpacked vectors: the first and third
 * 32-value quarters of each half together, then the second and fourth. */
static inline __attribute__((always_inline)) void q4_K_activations(const struct q8_K_block *y, __m512i a[4]) {
    __m512i a0 = _mm512_loadu_si512(y->qs), a1 = _mm512_loadu_si512(y->qs + 64);
    __m512i a2 = _mm512_loadu_si512(y->qs + 128), a3 = _mm512_loadu_si512(y->qs + 192);
    a[0] = _mm512_shuffle_i64x2(a0, a1, 0x44);
    a[1] = _mm512_shuffle_i64x2(a0, a1, 0xee);
    a[2] = _mm512_shuffle_i64x2(a2, a3, 0x44);
    a[3] = _mm512_shuffle_i64x2(a2, a3, 0xee);
}

/* One weight block times one activation block, added to the row's sums: u8 x s8 pairs summed
 * to int16 (at most 2 x 15 x 128), times the sub-blocks' scales summed to int32 (vpmaddwd);
 * the mins times the activations' 16-value sums likewise. */
static inline __attribute__((always_inline)) void q4_K_accumulate(const struct q4_K_unpacked *u, const __m512i a[4],
                                                                    const struct q8_K_block *y, __m512 *acc,
                                                                    __m256 *acc_m) {
    __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(u->q[0], a[0]), u->s[0]);
    for (int v = 1; v < 4; v++) p = SCALED_SUM(p, _mm512_maddubs_epi16(u->q[v], a[v]), u->s[v]);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(u->d * y->d), *acc);
    __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
    *acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, u->mins)), _mm256_set1_ps(u->dmin * y->d), *acc_m);
}

/* A pair's sum: the products' lanes less the mins' (both kept as float lanes until the row is done). */
static inline float k_quant_total(__m512 acc, __m256 acc_m) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc_m), _mm256_extractf128_ps(acc_m, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return hsum512(acc) - _mm_cvtss_f32(h);
}

/* NAME##_tile: nw weight rows (w, w + w_bytes, ...) times m activation rows (Q8_K blocks),
 * out[i * nw + j] for activation row i and weight row j, from the type's NAME##_unpack (a weight
 * block into struct NAME##_unpacked), NAME##_activations (an activation block's four vectors,
 * paired as the unpacked ones) and NAME##_accumulate. Every (weight row, activation row) pair
 * takes the same operations in the same order whatever nw and m are. */
#define K_QUANT_TILE(NAME)                                                                                         \
    static inline __attribute__((always_inline)) void NAME##_tile(int k, const void *w, size_t w_bytes, int nw,    \
                                                                  const void *act, size_t act_bytes, int m,       \
                                                                  float *out) {                                   \
        const int nb = k / QK_K;                                                                                  \
        __m512 acc[2 * MAX_ROWS];                                                                                 \
        __m256 acc_m[2 * MAX_ROWS];                                                                               \
        for (int t = 0; t < nw * m; t++) {                                                                        \
            acc[t] = _mm512_setzero_ps();                                                                         \
            acc_m[t] = _mm256_setzero_ps();                                                                       \
        }                                                                                                         \
        for (int b = 0; b < nb; b++) {                                                                            \
            struct NAME##_unpacked u[2];                                                                          \
            for (int j = 0; j < nw; j++)                                                                          \
                NAME##_unpack((const struct NAME##_block *)((const char *)w + j * w_bytes) + b, &u[j]);           \
            for (int i = 0; i < m; i++) {                                                                         \
                const struct q8_K_block *y = (const struct q8_K_block *)((const char *)act + (size_t)i * act_bytes) + b; \
                __m512i a[4];                                                                                     \
                NAME##_activations(y, a);                                                                         \
                for (int j = 0; j < nw; j++) NAME##_accumulate(&u[j], a, y, &acc[i * nw + j], &acc_m[i * nw + j]); \
            }                                                                                                     \
        }                                                                                                         \
        for (int t = 0; t < nw * m; t++) out[t] = k_quant_total(acc[t], acc_m[t]);                                \
    }

K_QUANT_TILE(q4_K)

/* Weight rows [0, n) (row_bytes apart) times m activation rows: out[i * ldo + r], by the type's
 * tile (NAME##_tile). A lone activation row takes two weight rows at a time (sharing its loads),
 * rows r and r + n/2 so that each stream of blocks stays sequential (adjacent rows measured 2.5x
 * slower on weights out of the caches: the prefetchers lost the streams); several activation
 * rows take one weight row at a time for up to MAX_ROWS of them (sharing its unpacking). */
#define ROWS_DRIVER(NAME)                                                                                          \
    static void rows_##NAME(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes,     \
                            int m, float *out, size_t ldo) {                                                      \
        float t[2 * MAX_ROWS] = {0};                                                                              \
        const char *wr = w, *ar = act;                                                                            \
        if (m == 1) {                                                                                             \
            int half = n / 2;                                                                                     \
            for (int r = 0; r < half; r++) {                                                                      \
                NAME##_tile(k, wr + r * row_bytes, half * row_bytes, 2, act, act_bytes, 1, t);                    \
                out[r] = t[0], out[r + half] = t[1];                                                              \
            }                                                                                                     \
            if (n % 2) NAME##_tile(k, wr + (n - 1) * row_bytes, row_bytes, 1, act, act_bytes, 1, out + n - 1);    \
            return;                                                                                               \
        }                                                                                                         \
        for (int r = 0; r < n; r++) {                                                                             \
            const char *row = wr + r * row_bytes;                                                                 \
            int i = 0;                                                                                            \
            for (; i + 4 <= m; i += 4) {                                                                          \
                NAME##_tile(k, row, row_bytes, 1, ar + i * act_bytes, act_bytes, 4, t);                           \
                for (int x = 0; x < 4; x++) out[(i + x) * ldo + r] = t[x];                                        \
            }                                                                                                     \
            switch (m - i) {                                                                                      \
            case 3: NAME##_tile(k, row, row_bytes, 1, ar + i * act_bytes, act_bytes, 3, t); break;                \
            case 2: NAME##_tile(k, row, row_bytes, 1, ar + i * act_bytes, act_bytes, 2, t); break;                \
            case 1: NAME##_tile(k, row, row_bytes, 1, ar + i * act_bytes, act_bytes, 1, t); break;                \
            }                                                                                                     \
            for (int x = 0; x < m - i; x++) out[(i + x) * ldo + r] = t[x];                                        \
        }                                                                                                         \
    }

ROWS_DRIVER(q4_K)

/* --------------------------------------------------------------------------------------- Q6_K
 * 256 values: ql (low 4 bits), qh (high 2 bits), 16 int8 scales (one per 16 values), d. In each
 * half of 128 values, the low nibbles of ql's 64 bytes are values 0-63 and the high ones 64-127;
 * qh's 32 bytes carry their top bits two at a time (values 0-31, 32-63, 64-95, 96-127). The
 * stored values are q + 32 (0-63): the products take q + 32 as u8, and 32 times the activations'
 * 16-value sums times the scales are subtracted. */

struct q6_K_block {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
};

struct q6_K_unpacked {
    __m512i q[4], s[4]; /* values 0-63, 64-127, 128-191, 192-255 and their scales as 16-bit lanes */
    __m256i scales;     /* the 16 scales as 16-bit lanes, for the activations' sums */
    float d;
};

static inline __attribute__((always_inline)) void q6_K_unpack(const struct q6_K_block *x, struct q6_K_unpacked *u) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    /* qh's bit pairs 0-1 and 2-3 moved to bits 4-5 (left by 4 and 2), pairs 4-5 and 6-7 (right
     * by 0 and 2), for the two 256-bit halves; what crosses into a neighbouring byte is masked */
    const __m512i left = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), right = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    /* in each 128-bit lane L, 16-bit scale L (or 4 + L) of a broadcast group of eight */
    const __m512i pick_l = _mm512_set_epi8(7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4,
                                           5, 4, 5, 4, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 1, 0, 1, 0, 1, 0, 1, 0,
                                           1, 0, 1, 0, 1, 0, 1, 0);
    const __m512i pick_h = _mm512_add_epi8(pick_l, _mm512_set1_epi8(8));
    u->scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
    for (int half = 0; half < 2; half++) {
        __m512i ql = _mm512_loadu_si512(x->ql + 64 * half);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qh + 32 * half)));
        __m512i h_lo = _mm512_and_si512(_mm512_sllv_epi64(qh, left), top);
        __m512i h_hi = _mm512_and_si512(_mm512_srlv_epi64(qh, right), top);
        u->q[2 * half] = _mm512_or_si512(_mm512_and_si512(ql, low), h_lo);
        u->q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low), h_hi);
        __m512i group = _mm512_broadcast_i32x4(half ? _mm256_extracti128_si256(u->scales, 1) : _mm256_castsi256_si128(u->scales));
        u->s[2 * half] = _mm512_shuffle_epi8(group, pick_l);
        u->s[2 * half + 1] = _mm512_shuffle_epi8(group, pick_h);
    }
    u->d = half_to_float(x->d);
}

/* A Q8_K block's values in the unpacked vectors' order: as stored. */
static inline __attribute__((always_inline)) void q6_K_activations(const struct q8_K_block *y, __m512i a[4]) {
    for (int v = 0; v < 4; v++) a[v] = _mm512_loadu_si512(y->qs + 64 * v);
}

static inline __attribute__((always_inline)) void q6_K_accumulate(const struct q6_K_unpacked *u, const __m512i a[4],
                                                                    const struct q8_K_block *y, __m512 *acc, __m256 *acc_m) {
    __m512i p = _mm512_madd_epi16(_mm512_maddubs_epi16(u->q[0], a[0]), u->s[0]);
    for (int v = 1; v < 4; v++) p = SCALED_SUM(p, _mm512_maddubs_epi16(u->q[v], a[v]), u->s[v]);
    float dd = u->d * y->d;
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_set1_ps(dd), *acc);
    __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
    *acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, u->scales)), _mm256_set1_ps(32.0f * dd), *acc_m);
}

K_QUANT_TILE(q6_K)
ROWS_DRIVER(q6_K)

/* ------------------------------------------------------------------------ Q8_K activations
 * ggml's quantize_row_q8_K, byte for byte, with vectors: per 256 values, the value of largest
 * magnitude (the first one, on ties) maps to -127 (iscale = -127 / it), every value to
 * round-half-even(iscale x) capped at 127, the 16-value sums, and d = 1 / iscale. ggml's x86
 * build runs its scalar reference for this: ~2.5 us for a 768-value row, before every decode
 * product of a K-quant weight, on the calling thread alone while the pool waits (about 8 % of a
 * small model's step). */
void mlxcel_quantize_q8_K(const float *x, void *out, int64_t k) {
    struct q8_K_block *y = out;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        __m512 m = _mm512_setzero_ps();
        for (int j = 0; j < QK_K; j += 16) m = _mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(x + j)), m); /* a NaN is passed over, as ggml's */
        float amax = _mm512_reduce_max_ps(m);
        if (!(amax > 0.0f)) {
            y[b].d = 0.0f;
            memset(y[b].qs, 0, QK_K);
            memset(y[b].bsums, 0, sizeof y[b].bsums);
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < QK_K; j += 16) {
            __mmask16 at = _mm512_cmp_ps_mask(_mm512_andnot_ps(sign, _mm512_loadu_ps(x + j)), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (at) {
                max = x[j + __builtin_ctz(at)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m512 scale = _mm512_set1_ps(iscale);
        for (int j = 0; j < QK_K; j += 16) {
            __m512i v = _mm512_min_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(scale, _mm512_loadu_ps(x + j)),
                                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                         _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(y[b].qs + j), _mm512_cvtsepi32_epi8(v));
            y[b].bsums[j / 16] = (int16_t)_mm512_reduce_add_epi32(v);
        }
        y[b].d = 1 / iscale;
    }
}

#if defined(__AVX512VNNI__)
/* --------------------------------------------------------------------------------------- Q8_0
 * 32 int8 values and a float16 factor a block, on both sides (activations quantized to Q8_0 by
 * ggml). Two blocks a step (64 values in one vector): signed x signed through vpdpbusd (AVX-512
 * VNNI) as |w| x (a with w's sign). A row's last block, when the count is odd, takes the same
 * operations on a vector whose upper half is zero. */

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

static inline __attribute__((always_inline)) void q8_0_tile(int k, const void *w, size_t w_bytes, int nw, const void *act,
                                                              size_t act_bytes, int m, float *out) {
    const int nb = k / 32;
    __m512 acc[2 * MAX_ROWS];
    for (int t = 0; t < nw * m; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b += 2) {
        int pair = b + 1 < nb;
        __m512i mag[2];
        __mmask64 negative[2];
        float d0[2], d1[2];
        for (int j = 0; j < nw; j++) {
            const struct q8_0_block *x = (const struct q8_0_block *)((const char *)w + j * w_bytes) + b;
            __m512i q = two_blocks_q8_0(x, pair);
            mag[j] = _mm512_abs_epi8(q);
            negative[j] = _mm512_movepi8_mask(q);
            d0[j] = half_to_float(x[0].d);
            d1[j] = pair ? half_to_float(x[1].d) : 0.0f;
        }
        for (int i = 0; i < m; i++) {
            const struct q8_0_block *y = (const struct q8_0_block *)((const char *)act + (size_t)i * act_bytes) + b;
            __m512i a = two_blocks_q8_0(y, pair);
            float e0 = half_to_float(y[0].d), e1 = pair ? half_to_float(y[1].d) : 0.0f;
            for (int j = 0; j < nw; j++) {
                /* a with the weights' signs (|w| times that is w times a; where w is 0, so is |w|) */
                __m512i signed_a = _mm512_mask_sub_epi8(a, negative[j], _mm512_setzero_si512(), a);
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mag[j], signed_a);
                acc[i * nw + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), two_factors(d0[j] * e0, d1[j] * e1), acc[i * nw + j]);
            }
        }
    }
    for (int t = 0; t < nw * m; t++) out[t] = hsum512(acc[t]);
}

ROWS_DRIVER(q8_0)

#if defined(__AVX512VL__)
/* ------------------------------------------------------------------ Q8_0 prompt chunks (GEMM)
 * A prompt chunk (many activation rows, quantized to Q8_0 by ggml's from_float as llama.cpp's
 * prompts are) times weight rows [r0, r1). GEMM_ROWS weight rows at a time are copied into a
 * panel, per pair of blocks the values as u8 (w + 128: vpdpbusd takes u8 x s8) and the two
 * factors as one vector; the panel then meets every activation row, two at a time, with 16 sums
 * in registers. (w + 128) a = w a + 128 a: each pair's integer sum starts at -128 times the
 * activations' sums (per 4 values: their own vpdpbusd), so it ends at the plain w a. Per pair of
 * blocks and (weight row, activation row): one vpdpbusd, one conversion, the two factors' product
 * and one fused multiply-add, where the decode kernel above spends four more on the signs and
 * the factors (llamafile's GEMM, which ggml runs for a Q8_0 prompt on x86, takes 256 bits at a
 * time). A pair's sum and its final reduction take the same steps whatever rows, band or panel it
 * falls in, so a row's result does not depend on the others. */
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
static void gemm_q8_0(int k, const unsigned char *data, size_t row_bytes, const int32_t *rows, int r0, int r1,
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

static inline void nibble_halves(const uint8_t *qs, uint32_t qh, int five_bits, __m512i *first, __m512i *second);
static inline void store_block(float *y, __m512i first, __m512i second, int offset, float d, int with_min, float m);

/* --------------------------------------------------- Q4_1, Q5_0 and Q5_1, rows split
 * A weight of one of these types whose rows were rearranged at load (block_weight.split_rows):
 * a row's blocks in groups of 16 (the last one shorter), each group as its blocks' factors d
 * (half floats), then their minimums m (Q4_1, Q5_1), then their fifth bits (4 bytes a block,
 * the Q5 types), then their nibbles (16 bytes a block): the same bytes as ggml's row in another
 * order, read front to back, so that 16 blocks' factors are one load, two blocks' nibbles
 * another and their fifth bits a mask. ggml's vec_dot for these
 * types on x86 (AVX2) converts each block's factors one at a time and takes 32 values an
 * instruction; this takes 64 (vpdpbusd: the values as u8 times the activations' s8).
 *
 * The activations are ggml's own blocks, Q8_1 (d and s = d x the sum of the values) for the
 * types with a minimum, Q8_0 (d) for Q5_0, copied per row into arrays of values, d and s (for
 * Q8_0: d x the sum, computed here). A block's term is d_w d_a x sum(q a) plus m_w s_a, or for
 * Q5_0 (values q - 16) minus 16 d_w s_a: ggml's integer sums, added in another order (float32
 * rounding). */
#define SPLIT_TYPE(type) (SPLIT_TYPE_BASE + (type))

struct split_form {
    int five_bits; /* a fifth bit a value (qh) */
    int minimum;   /* a minimum a block (else values are offset by 16) */
};

static const struct split_form Q4_1_SPLIT = {0, 1}, Q5_0_SPLIT = {1, 0}, Q5_1_SPLIT = {1, 1};

struct q8_1_block {
    uint16_t d, s;
    int8_t qs[32];
};

/* nw (1 or 2) split rows (w, w + w_bytes) of nb blocks times one activation row (q: its values,
 * d and s: per block): out[j]. Each row takes the same operations whatever nw is. */
static inline __attribute__((always_inline)) void split_tile(int nb, const uint8_t *w, size_t w_bytes, int nw,
                                                              const int8_t *q, const float *d, const float *s,
                                                              float *out, struct split_form form) {
    const __m512i shift = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0, 0x0004000400040004LL,
                                           0x0004000400040004LL, 0, 0); /* high nibbles in 128-bit lanes 1 and 3 */
    const __m512i low = _mm512_set1_epi8(0x0f), twice = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    const __m512i fifth = _mm512_set1_epi8(0x10);
    const int block_bytes = 18 + 2 * form.minimum + 4 * form.five_bits;
    __m512 acc[2], mins[2];
    for (int j = 0; j < nw; j++) acc[j] = mins[j] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 16) {
        const int count = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 in = (__mmask16)((1u << count) - 1);
        const __m512 ad = _mm512_maskz_loadu_ps(in, d + b0), as = _mm512_maskz_loadu_ps(in, s + b0);
        /* the group's parts: d, m, qh, nibbles (block_weight.SPLIT_FIELDS) */
        const size_t group = (size_t)b0 * block_bytes, at_qh = (size_t)count * (2 + 2 * form.minimum),
                     at_nibbles = at_qh + (size_t)count * 4 * form.five_bits;
        __m512 f[2];
        for (int j = 0; j < nw; j++) {
            const uint16_t *factors = (const uint16_t *)(w + j * w_bytes + group);
            __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, factors));
            f[j] = _mm512_mul_ps(dw, ad);
            __m512 m = form.minimum ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, factors + count))
                                    : _mm512_mul_ps(dw, _mm512_set1_ps(-16.0f));
            mins[j] = _mm512_fmadd_ps(m, as, mins[j]);
        }
        for (int p = 0; p < count; p += 2) {
            const int b = b0 + p, pair = p + 1 < count;
            /* blocks b and b + 1: activations in the halves, factors in lanes 0-7 and 8-15 */
            __m512i a = pair ? _mm512_loadu_si512(q + (size_t)b * 32)
                             : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(q + (size_t)b * 32)));
            __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(p), _mm256_set1_epi32(p + pair), 1);
            for (int j = 0; j < nw; j++) {
                const uint8_t *part = w + j * w_bytes + group, *nibbles = part + at_nibbles + (size_t)p * 16;
                __m512i raw = pair ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)nibbles))
                                   : _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)nibbles));
                __m512i v = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi64(twice, raw), shift), low);
                if (form.five_bits) { /* bit i of the two blocks' qh is value i's fifth bit: byte i of v */
                    const uint8_t *qh = part + at_qh + (size_t)p * 4;
                    uint64_t word;
                    uint32_t one;
                    if (pair) memcpy(&word, qh, 8);
                    else memcpy(&one, qh, 4), word = one;
                    __mmask64 bits = _cvtu64_mask64(word);
                    v = _mm512_mask_add_epi8(v, bits, v, fifth);
                }
                if (!pair) v = _mm512_maskz_mov_epi32(0x00ff, v);
                __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, a);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(pick, f[j]), acc[j]);
            }
        }
    }
    for (int j = 0; j < nw; j++) out[j] = _mm512_reduce_add_ps(acc[j]) + _mm512_reduce_add_ps(mins[j]);
}

static __thread struct mlxcel_scratch split_scratch;

/* rows_fn over split rows: for each activation row, its values, d and s copied out, then weight
 * rows r and r + n/2 together (as ROWS_DRIVER's single row). */
static inline __attribute__((always_inline)) void split_rows_driver(int k, const void *w, size_t row_bytes, int n,
                                                                     const void *act, size_t act_bytes, int m,
                                                                     float *out, size_t ldo, struct split_form form) {
    const int nb = k / 32;
    float *d = mlxcel_scratch(&split_scratch, (size_t)nb * (32 + 2 * sizeof(float))), *s = d + nb;
    int8_t *q = (int8_t *)(s + nb);
    const uint8_t *wr = w;
    for (int i = 0; i < m; i++) {
        const char *y = (const char *)act + (size_t)i * act_bytes;
        for (int b = 0; b < nb; b++) {
            if (form.minimum) { /* Q8_1 */
                const struct q8_1_block *block = (const struct q8_1_block *)y + b;
                memcpy(q + (size_t)b * 32, block->qs, 32);
                d[b] = half_to_float(block->d);
                s[b] = half_to_float(block->s);
            } else { /* Q8_0: 2 bytes of d, 32 values */
                const uint8_t *block = (const uint8_t *)y + (size_t)b * 34;
                uint16_t h;
                memcpy(&h, block, 2);
                memcpy(q + (size_t)b * 32, block + 2, 32);
                __m256i v = _mm256_loadu_si256((const __m256i *)(block + 2));
                __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
                d[b] = half_to_float(h);
                s[b] = d[b] * (float)_mm_cvtsi128_si32(t);
            }
        }
        float *o = out + (size_t)i * ldo, t[2];
        const int half = n / 2;
        for (int r = 0; r < half; r++) {
            split_tile(nb, wr + (size_t)r * row_bytes, (size_t)half * row_bytes, 2, q, d, s, t, form);
            o[r] = t[0], o[r + half] = t[1];
        }
        if (n % 2) split_tile(nb, wr + (size_t)(n - 1) * row_bytes, row_bytes, 1, q, d, s, o + n - 1, form);
    }
}

/* A split row expanded to float32: the same values as ggml's to_float of the original row. */
static inline __attribute__((always_inline)) void split_dequantize(const void *vx, float *y, int64_t k,
                                                                    struct split_form form) {
    const int64_t nb = k / 32;
    const int block_bytes = 18 + 2 * form.minimum + 4 * form.five_bits;
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int64_t count = nb - b0 < 16 ? nb - b0 : 16;
        const uint8_t *part = (const uint8_t *)vx + b0 * block_bytes;
        const uint16_t *factors = (const uint16_t *)part;
        const uint8_t *qh = part + count * (2 + 2 * form.minimum), *nibbles = qh + count * 4 * form.five_bits;
        for (int64_t p = 0; p < count; p++, y += 32) {
            uint32_t bits = 0;
            if (form.five_bits) memcpy(&bits, qh + p * 4, 4);
            __m512i first, second;
            nibble_halves(nibbles + p * 16, bits, form.five_bits, &first, &second);
            store_block(y, first, second, form.minimum ? 0 : 16, half_to_float(factors[p]), form.minimum,
                        form.minimum ? half_to_float(factors[count + p]) : 0.0f);
        }
    }
}

#define SPLIT_KERNELS(NAME, FORM)                                                                                  \
    static void rows_##NAME##_split(int k, const void *w, size_t row_bytes, int n, const void *act,               \
                                    size_t act_bytes, int m, float *out, size_t ldo) {                            \
        split_rows_driver(k, w, row_bytes, n, act, act_bytes, m, out, ldo, FORM);                                 \
    }                                                                                                             \
    static void dequantize_##NAME##_split(const void *x, float *y, int64_t k) { split_dequantize(x, y, k, FORM); }

SPLIT_KERNELS(q4_1, Q4_1_SPLIT)
SPLIT_KERNELS(q5_0, Q5_0_SPLIT)
SPLIT_KERNELS(q5_1, Q5_1_SPLIT)
#endif /* AVX512VL */

#endif /* AVX512VNNI */

/* ------------------------------------------------------------- 32-value blocks to float32
 * Weight rows of Q4_0, Q4_1, Q5_0 and Q5_1 expanded to float32 (a prompt chunk's tiles,
 * block_matmul.c; an embedding row), 16 values an instruction: ggml's to_float for these types
 * is its scalar reference code (~0.8 ns a value here, ~40 ms of a 32-token prompt on SmolLM2's
 * Q4_1 file; this takes ~0.1 ns). The same values as ggml's, bit for bit: the integer value
 * (less its offset) converted to float, times d, plus m for the types with a minimum (the
 * product of a 5-bit integer and a half-precision d is exact in float32, so a fused
 * multiply-add rounds once where ggml's x*d + m does). A 32-value block: value j of the first
 * half is the low nibble of qs[j], of the second half its high nibble; the Q5 types' fifth bits
 * are bits j and 16 + j of qh. (Q8_0's to_float, vectorized by the compiler, is as fast.) */

/* Where a 32-value type keeps its parts: bytes a block, offsets of the minimum m (-1: none),
 * the fifth bits qh (-1: none) and the 16 bytes of nibbles (d at 0), and the offset taken from
 * every integer value. */
struct nibble_layout {
    int bytes, m, qh, qs, offset;
};

static const struct nibble_layout Q4_0_LAYOUT = {18, -1, -1, 2, 8}, Q4_1_LAYOUT = {20, 2, -1, 4, 0},
                                  Q5_0_LAYOUT = {22, -1, 2, 6, 16}, Q5_1_LAYOUT = {24, 2, 4, 8, 0};

/* The block's 16 bytes of nibbles as two vectors of 16 int32 values: the low nibbles (values
 * 0-15) and the high ones (values 16-31), each with its fifth bit from qh where there is one. */
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

static inline __attribute__((always_inline)) void dequantize_nibbles(const uint8_t *x, float *y, int64_t k,
                                                                      struct nibble_layout L) {
    for (int64_t b = 0; b < k / 32; b++, x += L.bytes, y += 32) {
        uint16_t d, m = 0;
        uint32_t qh = 0;
        memcpy(&d, x, 2);
        if (L.m >= 0) memcpy(&m, x + L.m, 2);
        if (L.qh >= 0) memcpy(&qh, x + L.qh, 4);
        __m512i first, second;
        nibble_halves(x + L.qs, qh, L.qh >= 0, &first, &second);
        store_block(y, first, second, L.offset, half_to_float(d), L.m >= 0, half_to_float(m));
    }
}

static void dequantize_q4_0(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q4_0_LAYOUT); }
static void dequantize_q4_1(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q4_1_LAYOUT); }
static void dequantize_q5_0(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q5_0_LAYOUT); }
static void dequantize_q5_1(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q5_1_LAYOUT); }

/* This library's quantizer of activations into a vec_dot_type, or NULL (ggml's then). */
mlxcel_quantize_fn mlxcel_quantizer(int ggml_type) { return ggml_type == TYPE_Q8_K ? mlxcel_quantize_q8_K : NULL; }

/* This library's expansion of a weight row of the type to float32, or NULL (ggml's to_float). */
mlxcel_dequantize_fn mlxcel_dequantizer(int ggml_type) {
    switch (ggml_type) {
    case TYPE_Q4_0: return dequantize_q4_0;
    case TYPE_Q4_1: return dequantize_q4_1;
    case TYPE_Q5_0: return dequantize_q5_0;
    case TYPE_Q5_1: return dequantize_q5_1;
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case SPLIT_TYPE(TYPE_Q4_1): return dequantize_q4_1_split;
    case SPLIT_TYPE(TYPE_Q5_0): return dequantize_q5_0_split;
    case SPLIT_TYPE(TYPE_Q5_1): return dequantize_q5_1_split;
#endif
    default: return NULL;
    }
}

/* This library's product of a prompt chunk with weights of the type (activations in the type's
 * vec_dot_type), or NULL (float32 tiles and the BLAS, or ggml's mul_mat). */
mlxcel_gemm_fn mlxcel_gemm_kernel(int ggml_type) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (ggml_type == TYPE_Q8_0) return gemm_q8_0;
#endif
    (void)ggml_type;
    return NULL;
}

mlxcel_rows_fn mlxcel_rows_kernel(int ggml_type) {
    switch (ggml_type) {
    case TYPE_Q4_K: return rows_q4_K;
    case TYPE_Q6_K: return rows_q6_K;
#if defined(__AVX512VNNI__)
    case TYPE_Q8_0: return rows_q8_0;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case SPLIT_TYPE(TYPE_Q4_1): return rows_q4_1_split;
    case SPLIT_TYPE(TYPE_Q5_0): return rows_q5_0_split;
    case SPLIT_TYPE(TYPE_Q5_1): return rows_q5_1_split;
#endif
    default: return NULL;
    }
}
#else
mlxcel_quantize_fn mlxcel_quantizer(int ggml_type) {
    (void)ggml_type;
    return NULL;
}

mlxcel_dequantize_fn mlxcel_dequantizer(int ggml_type) {
    (void)ggml_type;
    return NULL;
}

mlxcel_rows_fn mlxcel_rows_kernel(int ggml_type) {
    (void)ggml_type;
    return NULL;
}

mlxcel_gemm_fn mlxcel_gemm_kernel(int ggml_type) {
    (void)ggml_type;
    return NULL;
}
#endif
