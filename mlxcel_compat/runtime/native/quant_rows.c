/* Weight rows in ggml's blocks times activation rows quantized by ggml, with AVX-512: what
 * block_matmul.c's decode products run instead of ggml's vec_dot for the types that have a kernel
 * of this project (mlxcel_rows_kernel), and the look-ups that hand out every kernel of these files.
 *
 * Why: ggml's x86 vec_dot is written for AVX2 (32 values per instruction) and computes one
 * weight row with one activation row per call, unpacking the row's blocks each time: a batch of
 * m decode rows unpacks every weight block m times. The kernels here unpack a block once for
 * several activation rows, 64 values per instruction.
 *
 * The arithmetic is ggml's: the same integer products of the same quantized values (the
 * activations are what ggml's from_float made), scaled by the same float16 block factors; only
 * the order in which the float products are added differs (a few units of float32 rounding of
 * the sum). Each (weight row, activation row) pair takes the same operations in the same order
 * whatever the other rows of the call are, so a row of a batch is bit-identical to the row alone.
 *
 * Types: Q8_0, whose products are one vpdpbusd per 64 values (AVX-512 VNNI) where ggml's AVX2
 * code takes four instructions per 32, with a vector lane per weight row (its section below, 16
 * rows a pass), as k_quant_rows.c does for Q4_K and Q6_K (the K-quants of the common Q4_K_M and
 * Q6_K files, with their Q8_K activations' quantizer) and split_rows.c for Q4_1
 * (scripts/bench_quant_rows.py, docs/benchmarks/quantized.md). Q4_1 over
 * ggml's own layout measured 0.75-1.07x (one row): its kernel reads rows rearranged at load
 * (factors ahead of nibbles: split_rows.c), 1.5-2.5x; Q5_0 and Q5_1 likewise; MXFP4 (gpt-oss's
 * experts) likewise (exponents ahead of codes: mxfp4_rows.c). ggml's vec_dot serves the other
 * types, and every type on a CPU without AVX-512 VNNI (mlxcel_rows_kernel returns NULL). The library
 * also expands Q4_0-Q5_1 blocks to float32 (mlxcel_dequantizer: dequantize.c, split_rows.c),
 * ggml's being scalar code. The lane kernels take prompt chunks too (block_matmul.c:
 * mlxcel_lanes_take_prompts). This file holds the Q8_0 decode kernel and the look-ups that hand
 * out every kernel of these files.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)

#define MAX_ROWS 8 /* activation rows per pass over a weight row (ROWS_DRIVER's cases go to 8) */

static inline float hsum512(__m512 v) { return _mm512_reduce_add_ps(v); }

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
                                                              size_t ldo, const int grouped) {
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
        __m512 dw;
        __m512i v[8];
        if (grouped) { /* the 16 rows' dwords, their d (2 bytes each) after them or ahead (GROUP_TAILS_AHEAD);
                          into L2 two groups on, as the rows stored apart (measured: 4-64 KB on, a lone
                          memory-bound row 0.90-0.92x of these rows stored apart, two groups 0.94-0.97x) */
            const uint8_t *gb = w + (size_t)b * 544;
            const int ahead = GROUP_TAILS_AHEAD(gb);
            for (int l = 0; l < 9; l++) _mm_prefetch((const char *)gb + 2 * Q8_0_LANES * row_bytes + (size_t)l * 64, _MM_HINT_T1);
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ahead ? gb : gb + 512)));
            for (int t = 0; t < 8; t++) v[t] = _mm512_loadu_si512(gb + (ahead ? 32 : 0) + 64 * t);
        } else {
            for (int l = 0; l < 9; l++) _mm_prefetch((const char *)next + (size_t)b * 544 + (size_t)l * 64, _MM_HINT_T1);
            const size_t at = (size_t)b * sizeof(struct q8_0_block);
            /* the 16 rows' d: a dword gathered from each row, its low half */
            dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(row_at, (const void *)(w + at), 1)));
            rows16_dwords(rowp, at + 2, v);
            rows16_dwords(rowp, at + 18, v + 4);
        }
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
    case M:                                                                                                        \
        if (whole) q8_0_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, ar + (size_t)i * act_row, act_row, M, \
                              out + (size_t)i * ldo + r, ldo, 1);                                                  \
        else q8_0_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, ar + (size_t)i * act_row, act_row, M,    \
                        out + (size_t)i * ldo + r, ldo, 0);                                                        \
        break;

/* rows_fn over Q8_0 rows stored apart, or (`grouped`) over rows grouped at load
 * (block_weight.group_rows: w is the first of n rows and starts a group; the rows past the last
 * whole group are stored apart). Grouped, a pass loads its 16 rows' block as 8 vectors and their
 * d as one, where stored apart it gathers and transposes them (rows16_dwords); the same
 * arithmetic, so the same bits. */
static void q8_0_rows(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                      float *out, size_t ldo, const int grouped) {
    const int nb = k / 32;
    size_t act_row;
    const uint8_t *ar = q8_0_prepare(k, act, act_bytes, m, &act_row), *wr = w;
    for (int r = 0; r < n; r += Q8_0_LANES) {
        const int nrows = n - r < Q8_0_LANES ? n - r : Q8_0_LANES;
        const int whole = grouped && nrows == Q8_0_LANES; /* grouped: a whole group (the rest is stored apart) */
        for (int i = 0; i < m; i += Q8_0_MAX_ROWS) {
            switch (m - i < Q8_0_MAX_ROWS ? m - i : Q8_0_MAX_ROWS) {
                Q8_0_CASE(1) Q8_0_CASE(2) Q8_0_CASE(3) Q8_0_CASE(4) Q8_0_CASE(5) Q8_0_CASE(6)
                Q8_0_CASE(7) Q8_0_CASE(8) Q8_0_CASE(9) Q8_0_CASE(10) Q8_0_CASE(11) Q8_0_CASE(12)
                Q8_0_CASE(13) Q8_0_CASE(14) Q8_0_CASE(15) Q8_0_CASE(16)
            }
        }
    }
}

static void rows_q8_0(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                      float *out, size_t ldo) {
    q8_0_rows(k, w, row_bytes, n, act, act_bytes, m, out, ldo, 0);
}

static void rows_q8_0_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                              float *out, size_t ldo) {
    q8_0_rows(k, w, row_bytes, n, act, act_bytes, m, out, ldo, 1);
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

mlxcel_rows_fn mlxcel_rows_kernel(int ggml_type) {
    switch (ggml_type) {
#if defined(__AVX512VNNI__)
    case TYPE_Q4_K: return rows_q4_K;
    case TYPE_Q6_K: return rows_q6_K;
    case GROUPED_TYPE(TYPE_Q4_K): return rows_q4_K_grouped;
    case GROUPED_TYPE(TYPE_Q6_K): return rows_q6_K_grouped;
    case TYPE_Q8_0: return rows_q8_0;
    case GROUPED_TYPE(TYPE_Q8_0): return rows_q8_0_grouped;
    case SPLIT_TYPE(TYPE_MXFP4): return rows_mxfp4_split;
    case GROUPED_TYPE(TYPE_MXFP4): return rows_mxfp4_grouped;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case SPLIT_TYPE(TYPE_Q4_1): return rows_q4_1_split;
    case SPLIT_TYPE(TYPE_Q5_0): return rows_q5_0_split;
    case SPLIT_TYPE(TYPE_Q5_1): return rows_q5_1_split;
    case GROUPED_TYPE(TYPE_Q4_1): return rows_q4_1_grouped;
    case GROUPED_TYPE(TYPE_Q5_0): return rows_q5_0_grouped;
    case GROUPED_TYPE(TYPE_Q5_1): return rows_q5_1_grouped;
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
#endif
