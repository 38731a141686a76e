/* Weight rows in ggml's K-quant blocks times activation rows quantized by ggml (Q8_K), with
 * AVX-512: what block_matmul.c's decode products run instead of ggml's vec_dot for the types this
 * file has a kernel for (mlxcel_rows_kernel).
 *
 * Why: ggml's x86 vec_dot for these types is written for AVX2 (32 values per instruction) and
 * computes one weight row with one activation row per call, unpacking the row's blocks (4- or
 * 6-bit values, 6- or 8-bit sub-block scales) each time: a batch of m decode rows unpacks every
 * weight block m times, and a row as short as a small model's (768 values: 3 super-blocks) pays
 * the call's set-up and final reduction on few blocks. Here the K-quants' blocks are unpacked once
 * per pass, 64 values per instruction, for two weight rows against one activation row (sharing its
 * loads) or for one weight row against up to MAX_ROWS activation rows (sharing the unpacking),
 * and each pair's sums stay in vector registers until its row is done. Q8_0 turns the vector the
 * other way (its section below: a lane per weight row, 16 rows a pass), as split_rows.c does for
 * Q4_1.
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
 * ggml's own layout measured 0.75-1.07x (one row): its kernel reads rows rearranged at load
 * (factors ahead of nibbles: split_rows.c), 1.5-2.5x; Q5_0 and Q5_1 likewise; MXFP4 (gpt-oss's
 * experts) likewise (exponents ahead of codes: mxfp4_rows.c). ggml's vec_dot serves the other
 * types, and every type on a CPU without AVX-512 BW (mlxcel_rows_kernel returns NULL). The library
 * also expands Q4_0-Q5_1 blocks to float32 (mlxcel_dequantizer: dequantize.c, split_rows.c),
 * ggml's being scalar code, and multiplies Q8_0 prompt chunks by its own int8 GEMM
 * (mlxcel_gemm_kernel: q8_0_gemm.c). This file holds the K-quant and Q8_0 decode kernels, the Q8_K
 * quantizer of their activations, and the look-ups that hand out every kernel of these files.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)

#define QK_K 256
#define MAX_ROWS 8 /* activation rows per pass over a weight row (ROWS_DRIVER's cases go to 8) */

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

/* One Q4_K block's weights, unpacked in the activations' order: vector v holds values 64v to
 * 64v + 63 (sub-blocks 2v and 2v + 1: the low and then the high nibbles of bytes 32v to 32v + 31),
 * their scales as 16-bit lanes matching them, the mins as 16-bit pairs matching the activations'
 * 16-value sums, and the block's two factors. In that order an activation block is four plain
 * loads, with nothing to rearrange per activation row. */
struct q4_K_unpacked {
    __m512i q[4], s[4];
    __m256i mins;
    float d, dmin;
};

static inline __attribute__((always_inline)) void q4_K_unpack(const struct q4_K_block *x, struct q4_K_unpacked *u) {
    const __m512i low = _mm512_set1_epi8(0x0f), high_half = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i pick = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i pair = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    uint64_t sc, mn;
    q4_K_scales(x->scales, &sc, &mn);
    __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    for (int v = 0; v < 4; v++) {
        __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qs + 32 * v)));
        u->q[v] = _mm512_and_si512(_mm512_srlv_epi64(bytes, high_half), low);
        u->s[v] = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16((short)(2 * v))), sc16);
    }
    u->mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn), pair));
    u->d = half_to_float(x->d);
    u->dmin = half_to_float(x->dmin);
}

/* The activations of one Q8_K block in the unpacked vectors' order: as stored. */
static inline __attribute__((always_inline)) void q4_K_activations(const struct q8_K_block *y, __m512i a[4]) {
    for (int v = 0; v < 4; v++) a[v] = _mm512_loadu_si512(y->qs + 64 * v);
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

/* The activation rows as the type's tile reads them: ggml's as they are for the K-quants
 * (q8_0_prepare rewrites Q8_0's). */
static inline const void *k_quant_prepare(int k, const void *act, size_t *act_bytes, int m) {
    (void)k, (void)act_bytes, (void)m;
    return act;
}
#define q4_K_prepare k_quant_prepare
#define q6_K_prepare k_quant_prepare

/* Weight rows [0, n) (row_bytes apart) times m activation rows: out[i * ldo + r], by the type's
 * tile (NAME##_tile). A lone activation row takes two weight rows at a time (sharing its loads),
 * rows r and r + n/2 so that each stream of blocks stays sequential (adjacent rows measured 2.5x
 * slower on weights out of the caches: the prefetchers lost the streams); several activation
 * rows take one weight row at a time, MAX_ROWS of them a pass (each weight block unpacked once
 * for all of them), the tile's row count a constant of each case so that its loops unroll. */
#define TILE_CASE(NAME, M)                                                                                         \
    case M: NAME##_tile(k, row, row_bytes, 1, ar + (size_t)i * act_bytes, act_bytes, M, t); break;
#define ROWS_DRIVER(NAME)                                                                                          \
    static void rows_##NAME(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes,     \
                            int m, float *out, size_t ldo) {                                                      \
        float t[2 * MAX_ROWS] = {0};                                                                              \
        act = NAME##_prepare(k, act, &act_bytes, m);                                                              \
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
            for (int i = 0; i < m; i += MAX_ROWS) {                                                               \
                int rows = m - i < MAX_ROWS ? m - i : MAX_ROWS;                                                   \
                switch (rows) {                                                                                   \
                    TILE_CASE(NAME, 1) TILE_CASE(NAME, 2) TILE_CASE(NAME, 3) TILE_CASE(NAME, 4)                   \
                    TILE_CASE(NAME, 5) TILE_CASE(NAME, 6) TILE_CASE(NAME, 7) TILE_CASE(NAME, 8)                   \
                }                                                                                                 \
                for (int x = 0; x < rows; x++) out[(size_t)(i + x) * ldo + r] = t[x];                             \
            }                                                                                                     \
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
 * ggml), with a vector lane per weight row (as split_rows.c's Q4_1 kernel, and for the same
 * reason: a (weight row, activation row) pair kept in a vector of its own values paid, per
 * activation row, for the factors and a horizontal sum several times over the products; 8
 * activation rows cost 4-6x one). 16 weight rows a pass: a block is 8 vpdpbusd, each taking 4
 * values of every row against 4 activation values (a broadcast dword). vpdpbusd multiplies
 * unsigned by signed bytes: the activations go in as a + 128 (copied so once per call), and
 * 128 times the block's sum of weights (8 more vpdpbusd, once per pass for every activation row)
 * is taken off: sum(w a) exactly, ggml's integer sum. Then times d_w d_a, added block after
 * block. Each (weight row, activation row) pair is its lane of the same operations in the same
 * order whatever the other rows are (rows past the band's end compute on a copy of its last row
 * and are not stored): bit for bit the row alone. */
#define Q8_0_LANES 16
#define Q8_0_MAX_ROWS 16 /* activation rows a pass (as split_rows.c's LANE_MAX_ROWS) */

/* Weight rows [0, nrows) (nrows <= 16) times m activation rows (m <= Q8_0_MAX_ROWS, as
 * q8_0_prepare left them): out[i * ldo + r]. */
static inline __attribute__((always_inline)) void q8_0_lanes(int nb, const uint8_t *w, size_t row_bytes, int nrows,
                                                              const uint8_t *act, size_t act_row, int m, float *out,
                                                              size_t ldo) {
    const uint8_t *rowp[Q8_0_LANES], *next = w + 2 * Q8_0_LANES * row_bytes;
    int32_t offsets[Q8_0_LANES];
    for (int r = 0; r < Q8_0_LANES; r++) {
        const size_t at = (size_t)(r < nrows ? r : nrows - 1) * row_bytes;
        rowp[r] = w + at;
        offsets[r] = (int32_t)at;
    }
    const __m512i row_at = _mm512_loadu_si512(offsets), ones = _mm512_set1_epi8(1);
    __m512 acc[Q8_0_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        /* the pass after next, into L2 (34 bytes a block and row: 544 a block of the 16), as
         * split_rows.c's Q4_1 kernel does: 16 rows side by side lose the hardware prefetchers */
        for (int l = 0; l < 9; l++) _mm_prefetch((const char *)next + (size_t)b * 544 + (size_t)l * 64, _MM_HINT_T1);
        const size_t at = (size_t)b * sizeof(struct q8_0_block);
        /* the 16 rows' d: a dword gathered from each row, its low half */
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(row_at, (const void *)(w + at), 1)));
        __m512i v[8];
        rows16_dwords(rowp, at + 2, v);
        rows16_dwords(rowp, at + 18, v + 4);
        __m512i wsum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, v[0]);
        for (int t = 1; t < 8; t++) wsum = _mm512_dpbusd_epi32(wsum, ones, v[t]);
        const __m512i offset = _mm512_slli_epi32(wsum, 7);
        for (int i = 0; i < m; i++) {
            const uint8_t *row = act + (size_t)i * act_row;
            const int32_t *q = (const int32_t *)(row + (size_t)b * 32);
            const float da = ((const float *)(row + (size_t)nb * 32))[b];
            __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(q[0]), v[0]);
            __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(q[4]), v[4]);
            for (int t = 1; t < 4; t++) {
                s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(q[t]), v[t]);
                s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(q[t + 4]), v[t + 4]);
            }
            __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), offset);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc[i]);
        }
    }
    const __mmask16 stored = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++) _mm512_mask_storeu_ps(out + (size_t)i * ldo, stored, acc[i]);
}

static __thread struct mlxcel_scratch q8_0_scratch;

/* The activation rows (ggml's Q8_0 blocks: a float16 factor, 32 values) as q8_0_lanes reads
 * them, into a buffer of this thread: a row's nb x 32 values plus 128 (as unsigned bytes), then
 * its blocks' factors as floats. Returns the buffer; *row_size is a row's bytes there. */
static const uint8_t *q8_0_prepare(int k, const void *act, size_t act_bytes, int m, size_t *row_size) {
    const int nb = k / 32;
    const size_t row = (size_t)nb * 32 + (size_t)nb * sizeof(float);
    uint8_t *copy = mlxcel_scratch(&q8_0_scratch, row * (size_t)m);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int i = 0; i < m; i++) {
        const struct q8_0_block *y = (const struct q8_0_block *)((const char *)act + (size_t)i * act_bytes);
        uint8_t *q = copy + (size_t)i * row;
        float *d = (float *)(q + (size_t)nb * 32);
        for (int b = 0; b < nb; b++) {
            _mm256_storeu_si256((__m256i *)(q + (size_t)b * 32),
                                _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)y[b].qs), flip));
            d[b] = half_to_float(y[b].d);
        }
    }
    *row_size = row;
    return copy;
}

#define Q8_0_CASE(M)                                                                                               \
    case M: q8_0_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, ar + (size_t)i * act_row, act_row, M,     \
                       out + (size_t)i * ldo + r, ldo); break;

static void rows_q8_0(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                      float *out, size_t ldo) {
    const int nb = k / 32;
    size_t act_row;
    const uint8_t *ar = q8_0_prepare(k, act, act_bytes, m, &act_row), *wr = w;
    for (int r = 0; r < n; r += Q8_0_LANES) {
        const int nrows = n - r < Q8_0_LANES ? n - r : Q8_0_LANES;
        for (int i = 0; i < m; i += Q8_0_MAX_ROWS) {
            switch (m - i < Q8_0_MAX_ROWS ? m - i : Q8_0_MAX_ROWS) {
                Q8_0_CASE(1) Q8_0_CASE(2) Q8_0_CASE(3) Q8_0_CASE(4) Q8_0_CASE(5) Q8_0_CASE(6)
                Q8_0_CASE(7) Q8_0_CASE(8) Q8_0_CASE(9) Q8_0_CASE(10) Q8_0_CASE(11) Q8_0_CASE(12)
                Q8_0_CASE(13) Q8_0_CASE(14) Q8_0_CASE(15) Q8_0_CASE(16)
            }
        }
    }
}
#endif /* AVX512VNNI */

/* This library's quantizer of activations into a vec_dot_type, or NULL (ggml's then). */
mlxcel_quantize_fn mlxcel_quantizer(int ggml_type) { return ggml_type == TYPE_Q8_K ? mlxcel_quantize_q8_K : NULL; }

/* This library's expansion of a weight row of the type to float32, or NULL (ggml's to_float). */
mlxcel_dequantize_fn mlxcel_dequantizer(int ggml_type) {
    switch (ggml_type) {
    case TYPE_Q4_0: return dequantize_q4_0;
    case TYPE_Q4_1: return dequantize_q4_1;
    case TYPE_Q5_0: return dequantize_q5_0;
    case TYPE_Q5_1: return dequantize_q5_1;
#if defined(__AVX512VNNI__)
    case SPLIT_TYPE(TYPE_MXFP4): return dequantize_mxfp4_split;
#endif
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
    case SPLIT_TYPE(TYPE_MXFP4): return rows_mxfp4_split;
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
