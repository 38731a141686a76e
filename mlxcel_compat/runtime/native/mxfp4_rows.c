/* MXFP4 weights (gpt-oss's experts) whose rows were split or grouped at load: their rows'
 * products (decode rows and prompt chunks: a lane per weight row, 16 rows a pass, 1-16 activation
 * rows against each unpacked block) and the split rows' expansion to float32, which quant_rows.c's
 * mlxcel_rows_kernel and mlxcel_dequantizer hand out for SPLIT_TYPE(TYPE_MXFP4) and
 * GROUPED_TYPE(TYPE_MXFP4) on a CPU with AVX-512 BW and VNNI (the layouts: row_layouts.c's
 * mlxcel_split_layout and mlxcel_group_layout; the grouped kernel's: mxfp4_group_lanes).
 *
 * An MXFP4 block is 32 4-bit codes (low nibbles values 0-15, high ones 16-31) looked up in ggml's
 * kvalues_mxfp4 (twice E2M1's values: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives) and an E8M0
 * exponent e, whose half 2 ** (e - 128) is the block's factor; ggml multiplies it by Q8_0
 * activations (vec_dot_mxfp4_q8_0). The loader splits each row (block_weight.split_rows) into
 * groups of 16 blocks (the last one shorter), each group as its blocks' exponents (a byte each),
 * then their codes (16 bytes each): the same bytes as ggml's row, so that a group's exponents are
 * one 16-byte read and a row is read front to back.
 *
 * Why: the kernel this replaces took a (weight row, activation row) pair in one vector of the
 * row's values (two blocks a vector): per pair and block pair it paid a scalar E8M0 conversion,
 * the sign juggling of signed-by-signed bytes, a factor product and, at the end, a horizontal
 * sum; one activation row ran at 0.81x ggml's repacked GEMV (llama-server's decode path). Here a
 * vector's 16 lanes are 16 weight rows (as split_rows.c's Q4_1 and quant_rows.c's Q8_0 kernels):
 * a block is 8 vpdpbusd, each taking 4 values of every row against the same 4 activation values
 * (one broadcast dword); the codes are looked up once per block for every activation row of the
 * pass (one vpshufb per 4 values of 16 rows), and the 16 rows' exponents turned into factors
 * once per block, with no horizontal sum at all. vpdpbusd multiplies unsigned by signed bytes:
 * the table holds kvalue + 12 (0-24), and 12 times the activation block's sum (computed once per
 * activation row and block, when the rows are copied out) is taken off: sum(kvalue x a) exactly,
 * ggml's integer sum. That times 2 ** (e - 128) d_a, added block after block.
 *
 * Each (weight row, activation row) pair is its lane of the same operations in the same order
 * whatever the other rows and lanes are (rows past the end of a band compute on a copy of its
 * last row and are not stored): bit for bit the row alone. Against ggml's vec_dot only the order
 * of the float additions differs (float32 rounding of the sum).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__AVX512VNNI__)

#define MXFP4_LANES 16    /* weight rows a pass: a vector lane each */
#define MXFP4_MAX_ROWS 16 /* activation rows a pass: 16 streams, or a verify of 15 drafts, read the weights once */
#define MXFP4_GROUP 16    /* blocks a group of a split row (block_weight.SPLIT_GROUP) */
#define MXFP4_BLOCK 17    /* bytes a block: e, then 16 bytes of codes */
#define MXFP4_OFFSET 12   /* added to every looked-up value: the table's bytes are unsigned */

/* ggml's kvalues_mxfp4 plus MXFP4_OFFSET, once per 16 bytes: vpshufb looks up within 128-bit
 * lanes by an index's low 4 bits, vpermb (AVX-512 VBMI) by its low 6 across the vector, so a byte
 * whose bits 4-5 are another code's (a low nibble as stored, a high one shifted down) needs no mask. */
static inline __m512i mxfp4_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

/* The 4-bit codes of v's bytes' low (high) nibbles looked up: each byte kvalue + 12. */
static inline __m512i mxfp4_low(__m512i table, __m512i v) {
#if defined(__AVX512VBMI__)
    return _mm512_permutexvar_epi8(v, table);
#else
    return _mm512_shuffle_epi8(table, _mm512_and_si512(v, _mm512_set1_epi8(0x0f)));
#endif
}

static inline __m512i mxfp4_high(__m512i table, __m512i v) {
    return mxfp4_low(table, _mm512_srli_epi16(v, 4));
}

/* 2 ** (e - 128) for each 32-bit lane's exponent e (0-255): ggml's GGML_E8M0_TO_FP32_HALF's bits,
 * a subnormal for e < 2. */
static inline __m512 e8m0_halves(__m512i e) {
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
}

/* One activation row as mxfp4_lanes reads it: per block its 32 values, its factor and 12 times
 * the sum of its values. */
struct mxfp4_act {
    const int8_t *q;
    const float *d;
    const int32_t *offset;
};

/* Block b of 16 weight rows against m activation rows: u[t]'s dword r holds row r's code bytes
 * 4t .. 4t + 3, dw the rows' factors 2 ** (e - 128) (lanes: rows). The arithmetic both lane
 * kernels share (over split rows and over grouped ones), so that their results are the same bits. */
static inline __attribute__((always_inline)) void mxfp4_block(__m512i table, const __m512i u[4], __m512 dw, int b,
                                                              const struct mxfp4_act *act, int m, __m512 *acc) {
    /* v[t] values 4t .. 4t + 3, v[t + 4] values 16 + 4t .. 19 + 4t, as kvalue + 12 */
    __m512i v[8];
    for (int t = 0; t < 4; t++) v[t] = mxfp4_low(table, u[t]), v[t + 4] = mxfp4_high(table, u[t]);
    for (int i = 0; i < m; i++) {
        /* the integer sum starts at -12 x the block's sum; two chains of 4 (their latency) */
        const int32_t *q = (const int32_t *)(act[i].q + (size_t)b * 32);
        __m512i s0 = _mm512_dpbusd_epi32(_mm512_set1_epi32(-act[i].offset[b]), v[0], _mm512_set1_epi32(q[0]));
        __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], _mm512_set1_epi32(q[4]));
        for (int t = 1; t < 4; t++) {
            s0 = _mm512_dpbusd_epi32(s0, v[t], _mm512_set1_epi32(q[t]));
            s1 = _mm512_dpbusd_epi32(s1, v[t + 4], _mm512_set1_epi32(q[t + 4]));
        }
        const __m512i sum = _mm512_add_epi32(s0, s1);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(act[i].d[b])), acc[i]);
    }
}

/* Split weight rows [0, nrows) (nrows <= 16, row_bytes apart, nb blocks) times m activation rows
 * (m <= MXFP4_MAX_ROWS): out[i * ldo + r]. */
static inline __attribute__((always_inline)) void mxfp4_lanes(int nb, const uint8_t *w, size_t row_bytes, int nrows,
                                                               const struct mxfp4_act *act, int m, float *out,
                                                               size_t ldo) {
    const __m512i table = mxfp4_table(), byte = _mm512_set1_epi32(0xff);
    const uint8_t *rowp[MXFP4_LANES], *next = w + 2 * MXFP4_LANES * row_bytes;
    for (int r = 0; r < MXFP4_LANES; r++) rowp[r] = w + (size_t)(r < nrows ? r : nrows - 1) * row_bytes;
    __m512 acc[MXFP4_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += MXFP4_GROUP) {
        const int count = nb - b0 < MXFP4_GROUP ? nb - b0 : MXFP4_GROUP;
        const size_t group = (size_t)b0 * MXFP4_BLOCK, at_codes = group + (size_t)count;
        /* the group's exponents: e[t]'s dword r holds row r's exponents of blocks 4t .. 4t + 3
         * (a short group's 16 bytes run into its codes, which are not used as exponents) */
        __m512i e[4];
        rows16_dwords(rowp, group, e);
        for (int p = 0; p < count; p++) {
            const int b = b0 + p;
            /* the pass after next, into L2 (17 bytes a block and row: 272 a block of the 16): a
             * pass reads its 16 rows side by side, each too short a stream for the prefetchers */
            for (int l = 0; l < 5; l++) _mm_prefetch((const char *)next + (size_t)b * 272 + (size_t)l * 64, _MM_HINT_T1);
            const __m512 dw = e8m0_halves(_mm512_and_si512(_mm512_srli_epi32(e[p >> 2], 8 * (p & 3)), byte));
            /* u[t]'s dword r: row r's code bytes 4t .. 4t + 3 */
            __m512i u[4];
            rows16_dwords(rowp, at_codes + (size_t)p * 16, u);
            mxfp4_block(table, u, dw, b, act, m, acc);
        }
    }
    const __mmask16 stored = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++) _mm512_mask_storeu_ps(out + (size_t)i * ldo, stored, acc[i]);
}

/* 16 weight rows grouped at load (block_weight.group_rows: whole groups only) times m activation
 * rows (m <= MXFP4_MAX_ROWS): out[i * ldo + r]. Why: mxfp4_lanes spends more on bringing 16 split
 * rows' bytes into lane order (a 4 x 4 transpose of dwords a block, the exponents' once a group)
 * than a lone activation row's arithmetic. Grouped, a block of the 16 rows is their codes as dwords
 * side by side (dword t of row r at 64 t + 4 r: 256 bytes, four vector loads) and their exponents
 * (a byte each) after them, or ahead of them where the block starts mid-line (GROUP_TAILS_AHEAD:
 * 16 x 17 bytes start at every 16th byte of a line, so half the blocks' codes still straddle two
 * lines); one stream read front to back. The same arithmetic (mxfp4_block): the split rows' bits. */
static inline __attribute__((always_inline)) void mxfp4_group_lanes(int nb, const uint8_t *w,
                                                                     const struct mxfp4_act *act, int m, float *out,
                                                                     size_t ldo) {
    const __m512i table = mxfp4_table();
    const size_t group_block = (size_t)MXFP4_LANES * MXFP4_BLOCK, ahead = 2 * group_block * (size_t)nb;
    __m512 acc[MXFP4_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *gb = w + (size_t)b * group_block;
        for (size_t l = 0; l < group_block + 63; l += 64) /* into L2, two groups on (as split_rows.c's) */
            _mm_prefetch((const char *)gb + ahead + l, _MM_HINT_T1);
        const int first = GROUP_TAILS_AHEAD(gb); /* the exponents ahead of the codes */
        const uint8_t *codes = gb + (first ? MXFP4_LANES : 0), *exps = first ? gb : gb + 4 * 64;
        const __m512 dw = e8m0_halves(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)exps)));
        __m512i u[4];
        for (int t = 0; t < 4; t++) u[t] = _mm512_loadu_si512(codes + 64 * t);
        mxfp4_block(table, u, dw, b, act, m, acc);
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(out + (size_t)i * ldo, acc[i]);
}

static __thread struct mlxcel_scratch mxfp4_scratch;

/* The activation rows (ggml's Q8_0 blocks: a float16 factor, 32 values) as mxfp4_lanes reads
 * them, into a buffer of this thread: per row its values, factors as floats and offsets (12 x
 * each block's sum), and the rows' struct mxfp4_act after them all. */
static const struct mxfp4_act *mxfp4_prepare(int nb, const void *act, size_t act_bytes, int m) {
    const size_t per_row = (size_t)nb * (32 + sizeof(float) + sizeof(int32_t));
    char *space = mlxcel_scratch(&mxfp4_scratch, per_row * (size_t)m + sizeof(struct mxfp4_act) * (size_t)m);
    struct mxfp4_act *rows = (struct mxfp4_act *)(space + per_row * (size_t)m);
    const __m256i ones = _mm256_set1_epi8(1);
    for (int i = 0; i < m; i++) {
        float *d = (float *)(space + per_row * (size_t)i);
        int32_t *offset = (int32_t *)(d + nb);
        int8_t *q = (int8_t *)(offset + nb);
        rows[i] = (struct mxfp4_act){q, d, offset};
        const struct q8_0_block *y = (const struct q8_0_block *)((const char *)act + (size_t)i * act_bytes);
        for (int b = 0; b < nb; b++) {
            const __m256i values = _mm256_loadu_si256((const __m256i *)y[b].qs);
            _mm256_storeu_si256((__m256i *)(q + (size_t)b * 32), values);
            const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, values), _mm256_set1_epi16(1));
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            offset[b] = MXFP4_OFFSET * _mm_cvtsi128_si32(s);
            d[b] = half_to_float(y[b].d);
        }
    }
    return rows;
}

#define MXFP4_CASE(M)                                                                                              \
    case M:                                                                                                        \
        if (grouped) mxfp4_group_lanes(nb, wr + (size_t)r * row_bytes, rows + i, M, out + (size_t)i * ldo + r, ldo); \
        else mxfp4_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, rows + i, M, out + (size_t)i * ldo + r, ldo); \
        break;

/* rows_fn over split MXFP4 rows, or (`grouped`, a constant) over grouped rows (n a multiple of 16,
 * w starting a group): the activation rows copied out (mxfp4_prepare), then 16 weight rows a pass
 * against MXFP4_MAX_ROWS activation rows (each count a constant, so loops unroll). */
static inline __attribute__((always_inline)) void mxfp4_driver(int k, const void *w, size_t row_bytes, int n,
                                                                const void *act, size_t act_bytes, int m, float *out,
                                                                size_t ldo, const int grouped) {
    const int nb = k / 32;
    const struct mxfp4_act *rows = mxfp4_prepare(nb, act, act_bytes, m);
    const uint8_t *wr = w;
    for (int r = 0; r < n; r += MXFP4_LANES) {
        const int nrows = n - r < MXFP4_LANES ? n - r : MXFP4_LANES;
        for (int i = 0; i < m; i += MXFP4_MAX_ROWS) {
            switch (m - i < MXFP4_MAX_ROWS ? m - i : MXFP4_MAX_ROWS) {
                MXFP4_CASE(1) MXFP4_CASE(2) MXFP4_CASE(3) MXFP4_CASE(4) MXFP4_CASE(5) MXFP4_CASE(6)
                MXFP4_CASE(7) MXFP4_CASE(8) MXFP4_CASE(9) MXFP4_CASE(10) MXFP4_CASE(11) MXFP4_CASE(12)
                MXFP4_CASE(13) MXFP4_CASE(14) MXFP4_CASE(15) MXFP4_CASE(16)
            }
        }
    }
}

void rows_mxfp4_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                      float *out, size_t ldo) {
    mxfp4_driver(k, w, row_bytes, n, act, act_bytes, m, out, ldo, 0);
}

void rows_mxfp4_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                        float *out, size_t ldo) {
    mxfp4_driver(k, w, row_bytes, n, act, act_bytes, m, out, ldo, 1);
}

/* A split row expanded to float32: ggml's to_float of the original row (kvalue x 2 ** (e - 128),
 * one exact product a value). */
void dequantize_mxfp4_split(const void *x, float *y, int64_t k) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const uint8_t *row = x;
    const int64_t nb = k / 32;
    for (int64_t b0 = 0; b0 < nb; b0 += MXFP4_GROUP) {
        const int64_t count = nb - b0 < MXFP4_GROUP ? nb - b0 : MXFP4_GROUP;
        const uint8_t *group = row + b0 * MXFP4_BLOCK, *codes = group + count;
        for (int64_t p = 0; p < count; p++, y += 32) {
            __m512i first, second;
            nibble_halves(codes + p * 16, 0, 0, &first, &second);
            const __m512 d = e8m0_halves(_mm512_set1_epi32(group[p]));
            _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_permutexvar_ps(first, table), d));
            _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_permutexvar_ps(second, table), d));
        }
    }
}
#endif
