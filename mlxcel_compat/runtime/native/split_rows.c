/* Q4_1, Q5_0 and Q5_1 weights whose rows were split at load: their decode rows and their expansion
 * to float32, which quant_rows.c's mlxcel_rows_kernel and mlxcel_dequantizer hand out for the
 * split types (SPLIT_TYPE) on a CPU with AVX-512 VNNI and VL.
 *
 * A weight of one of these types whose rows were rearranged at load (block_weight.split_rows):
 * a row's blocks in groups of 16 (the last one shorter), each group as its blocks' factors d
 * (half floats), then their minimums m (Q4_1, Q5_1), then their fifth bits (4 bytes a block,
 * the Q5 types), then their nibbles (16 bytes a block): the same bytes as ggml's row in another
 * order, read front to back, so that 16 blocks' factors are one load, two blocks' nibbles
 * another and their fifth bits a mask. ggml's vec_dot for these
 * types on x86 (AVX2) converts each block's factors one at a time and takes 32 values an
 * instruction; this takes 64 (vpdpbusd: the values as u8 times the activations' s8).
 *
 * Q4_1 takes q4_1_lanes below (a vector lane per weight row, 16 rows a pass); Q5_0 and Q5_1 take
 * split_tile (a vector of one row's values), whose per-pair factors and horizontal sums cost
 * each activation row several times its products.
 *
 * The activations are ggml's own blocks, Q8_1 (d and s = d x the sum of the values) for the
 * types with a minimum, Q8_0 (d) for Q5_0, copied per row into arrays of values, d and s (for
 * Q8_0: d x the sum, computed here). A block's term is d_w d_a x sum(q a) plus m_w s_a, or for
 * Q5_0 (values q - 16) minus 16 d_w s_a: ggml's integer sums, added in another order (float32
 * rounding).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "thread_pool.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__)

struct split_form {
    int five_bits; /* a fifth bit a value (qh) */
    int minimum;   /* a minimum a block (else values are offset by 16) */
};

static const struct split_form Q4_1_SPLIT = {0, 1}, Q5_0_SPLIT = {1, 0}, Q5_1_SPLIT = {1, 1};

struct q8_1_block {
    uint16_t d, s;
    int8_t qs[32];
};

#define SPLIT_MAX_ROWS 8 /* activation rows per pass over a weight row */

/* One activation row as the split kernels read it: its values, and per block d and s. */
struct split_act {
    const int8_t *q;
    const float *d, *s;
};

/* nw split rows (w, w + w_bytes: nw is 1 or 2) of nb blocks times m activation rows (m is 1 with
 * nw 2, else at most SPLIT_MAX_ROWS): out[i * nw + j]. Each block's nibbles are unpacked once for
 * all m rows; each (weight row, activation row) pair takes the same operations in the same order
 * whatever nw and m are, so a row of a batch is bit for bit the row alone. */
static inline __attribute__((always_inline)) void split_tile(int nb, const uint8_t *w, size_t w_bytes, int nw,
                                                              const struct split_act *act, int m, float *out,
                                                              struct split_form form) {
    const __m512i shift = _mm512_set_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0, 0, 0x0004000400040004LL,
                                           0x0004000400040004LL, 0, 0); /* high nibbles in 128-bit lanes 1 and 3 */
    const __m512i low = _mm512_set1_epi8(0x0f), twice = _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0);
    const __m512i fifth = _mm512_set1_epi8(0x10);
    const int block_bytes = 18 + 2 * form.minimum + 4 * form.five_bits;
    __m512 acc[2 * SPLIT_MAX_ROWS], mins[2 * SPLIT_MAX_ROWS];
    for (int t = 0; t < nw * m; t++) acc[t] = mins[t] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 16) {
        const int count = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 in = (__mmask16)((1u << count) - 1);
        /* the group's parts: d, m, qh, nibbles (block_weight.SPLIT_FIELDS) */
        const size_t group = (size_t)b0 * block_bytes, at_qh = (size_t)count * (2 + 2 * form.minimum),
                     at_nibbles = at_qh + (size_t)count * 4 * form.five_bits;
        __m512 f[2 * SPLIT_MAX_ROWS];
        for (int j = 0; j < nw; j++) {
            const uint16_t *factors = (const uint16_t *)(w + j * w_bytes + group);
            __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, factors));
            __m512 mw = form.minimum ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, factors + count))
                                     : _mm512_mul_ps(dw, _mm512_set1_ps(-16.0f));
            for (int i = 0; i < m; i++) {
                f[i * nw + j] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(in, act[i].d + b0));
                mins[i * nw + j] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(in, act[i].s + b0), mins[i * nw + j]);
            }
        }
        for (int p = 0; p < count; p += 2) {
            const int b = b0 + p, pair = p + 1 < count;
            /* blocks b and b + 1: activations in the halves, factors in lanes 0-7 and 8-15 */
            __m512i pick = _mm512_inserti64x4(_mm512_set1_epi32(p), _mm256_set1_epi32(p + pair), 1);
            __m512i v[2];
            for (int j = 0; j < nw; j++) {
                const uint8_t *part = w + j * w_bytes + group, *nibbles = part + at_nibbles + (size_t)p * 16;
                __m512i raw = pair ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)nibbles))
                                   : _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)nibbles));
                v[j] = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi64(twice, raw), shift), low);
                if (form.five_bits) { /* bit i of the two blocks' qh is value i's fifth bit: byte i of v */
                    const uint8_t *qh = part + at_qh + (size_t)p * 4;
                    uint64_t word;
                    uint32_t one;
                    if (pair) memcpy(&word, qh, 8);
                    else memcpy(&one, qh, 4), word = one;
                    __mmask64 bits = _cvtu64_mask64(word);
                    v[j] = _mm512_mask_add_epi8(v[j], bits, v[j], fifth);
                }
                if (!pair) v[j] = _mm512_maskz_mov_epi32(0x00ff, v[j]);
            }
            for (int i = 0; i < m; i++) {
                const int8_t *q = act[i].q + (size_t)b * 32;
                __m512i a = pair ? _mm512_loadu_si512(q) : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q));
                for (int j = 0; j < nw; j++) {
                    __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[j], a);
                    acc[i * nw + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(pick, f[i * nw + j]),
                                                      acc[i * nw + j]);
                }
            }
        }
    }
    for (int t = 0; t < nw * m; t++) out[t] = _mm512_reduce_add_ps(acc[t]) + _mm512_reduce_add_ps(mins[t]);
}

static __thread struct mlxcel_scratch split_scratch;

#define SPLIT_CASE(M)                                                                                              \
    case M: split_tile(nb, row, row_bytes, 1, rows + i, M, t, form); break;

/* rows_fn over split rows: every activation row's values, d and s copied out first; then a lone
 * activation row takes weight rows r and r + n/2 together (as ROWS_DRIVER's single row), several
 * take one weight row at a time, SPLIT_MAX_ROWS of them a pass (each block unpacked once for
 * all of them, the weight row read once). */
static inline __attribute__((always_inline)) void split_rows_driver(int k, const void *w, size_t row_bytes, int n,
                                                                     const void *act, size_t act_bytes, int m,
                                                                     float *out, size_t ldo, struct split_form form) {
    const int nb = k / 32;
    const size_t per_row = (size_t)nb * (32 + 2 * sizeof(float));
    char *space = mlxcel_scratch(&split_scratch, per_row * (size_t)m + sizeof(struct split_act) * (size_t)m);
    struct split_act *rows = (struct split_act *)(space + per_row * (size_t)m);
    const uint8_t *wr = w;
    for (int i = 0; i < m; i++) {
        float *d = (float *)(space + per_row * (size_t)i), *s = d + nb;
        int8_t *q = (int8_t *)(s + nb);
        rows[i] = (struct split_act){q, d, s};
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
    }
    float t[2 * SPLIT_MAX_ROWS];
    if (m == 1) {
        const int half = n / 2;
        for (int r = 0; r < half; r++) {
            split_tile(nb, wr + (size_t)r * row_bytes, (size_t)half * row_bytes, 2, rows, 1, t, form);
            out[r] = t[0], out[r + half] = t[1];
        }
        if (n % 2) split_tile(nb, wr + (size_t)(n - 1) * row_bytes, row_bytes, 1, rows, 1, out + n - 1, form);
        return;
    }
    for (int r = 0; r < n; r++) {
        const uint8_t *row = wr + (size_t)r * row_bytes;
        for (int i = 0; i < m; i += SPLIT_MAX_ROWS) {
            const int count = m - i < SPLIT_MAX_ROWS ? m - i : SPLIT_MAX_ROWS;
            switch (count) {
                SPLIT_CASE(1) SPLIT_CASE(2) SPLIT_CASE(3) SPLIT_CASE(4)
                SPLIT_CASE(5) SPLIT_CASE(6) SPLIT_CASE(7) SPLIT_CASE(8)
            }
            for (int x = 0; x < count; x++) out[(size_t)(i + x) * ldo + r] = t[x];
        }
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

/* ------------------------------------------------------------ Q4_1: a vector lane per weight row
 * Why: split_tile keeps a (weight row, activation row) pair's partial sums in one vector whose lanes
 * are values of the row, so every pair pays for its blocks' factors (a conversion, a permutation
 * and a multiply-add per two blocks) and for two horizontal sums at the end: per activation row
 * that is several times the integer products themselves, and 8 activation rows cost 4-5x one
 * (docs/benchmarks/quantized.md). Here a vector's 16 lanes are 16 weight rows: a block of 32
 * values is 8 vpdpbusd, each taking 4 values of every row against the same 4 activation values
 * (one broadcast dword), and its factors are one multiply-add a block for all 16 rows, with no
 * horizontal sum at all. The rows' nibbles are brought into that order once per block (a 4 x 4
 * transpose of dwords within 128-bit lanes) and a group's factors once per 16 blocks (a 16 x 16
 * transpose), for all activation rows of the pass.
 *
 * Arithmetic: each (weight row, activation row) pair is its lane of the same operations in the
 * same order whatever the other rows and lanes are (rows past the end of the band compute on a
 * copy of its last row and are not stored): bit for bit the row alone. Per block, the integer sum
 * of the 32 products (exact: ggml's) times d_w d_a, plus m_w s_a, added block after block. */
#define LANE_ROWS 16
#define LANE_MAX_ROWS 16 /* activation rows a pass: a verify of 15 draft tokens, or 16 streams, reads the weights once */

/* r[i]'s lane j into r[j]'s lane i (16 x 16 floats): pairs of rows interleaved, then quadruples,
 * then 128-bit lanes exchanged among every fourth vector. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    for (int g = 0; g < 16; g += 4) { /* u[g + c]'s lane j: column 4j + c of rows g .. g + 3 */
        u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44), u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xEE);
        u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44), u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        __m512 s0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), s1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        __m512 s2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44), s3 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(s0, s2, 0x88), r[4 + c] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
        r[8 + c] = _mm512_shuffle_f32x4(s1, s3, 0x88), r[12 + c] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
    }
}

/* Weight rows [0, nrows) (nrows <= 16, row_bytes apart, split Q4_1 rows of nb blocks) times m
 * activation rows (m <= LANE_MAX_ROWS): out[i * ldo + r]. */
static inline __attribute__((always_inline)) void q4_1_lanes(int nb, const uint8_t *w, size_t row_bytes, int nrows,
                                                              const struct split_act *act, int m, float *out,
                                                              size_t ldo) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const uint8_t *rowp[LANE_ROWS], *next = w + 2 * LANE_ROWS * row_bytes;
    for (int r = 0; r < LANE_ROWS; r++) rowp[r] = w + (size_t)(r < nrows ? r : nrows - 1) * row_bytes;
    __m512 acc[LANE_MAX_ROWS], mins[LANE_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = mins[i] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 16) {
        const int count = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 in = (__mmask16)((1u << count) - 1);
        const size_t group = (size_t)b0 * 20, at_mins = group + (size_t)count * 2, at_nibbles = group + (size_t)count * 4;
        /* the group's factors, a row a vector (lanes: blocks), transposed: dt[p]'s lanes are the
         * rows' d of block b0 + p, mt[p]'s their m */
        __m512 dt[16], mt[16];
        for (int r = 0; r < LANE_ROWS; r++) {
            dt[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, rowp[r] + group));
            mt[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, rowp[r] + at_mins));
        }
        transpose16(dt);
        transpose16(mt);
        for (int p = 0; p < count; p++) {
            const int b = b0 + p;
            const __m512 dw = dt[p], mw = mt[p];
            /* the pass after next, into L2: 16 rows (contiguous, 20 bytes a block and row: 5 lines
             * a block of the 16). A pass reads its rows side by side, each too short a stream for
             * the prefetchers to follow: without this, one activation row ran 2-3x slower than the
             * two-row kernel on weights out of the caches; one pass ahead or into L1, 1.1-1.5x. */
            for (int l = 0; l < 5; l++) _mm_prefetch((const char *)next + ((size_t)b * 5 + l) * 64, _MM_HINT_T1);
            /* u[t]'s dword r: row r's nibble bytes 4t .. 4t + 3 */
            __m512i u[4], v[8];
            rows16_dwords(rowp, at_nibbles + (size_t)p * 16, u);
            for (int t = 0; t < 4; t++) { /* values 4t .. 4t + 3 (low nibbles) and 16 + 4t .. (high) */
                v[t] = _mm512_and_si512(u[t], low);
                v[t + 4] = _mm512_and_si512(_mm512_srli_epi32(u[t], 4), low);
            }
            for (int i = 0; i < m; i++) {
                const int32_t *q = (const int32_t *)(act[i].q + (size_t)b * 32);
                __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(q[0]));
                __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], _mm512_set1_epi32(q[4]));
                for (int t = 1; t < 4; t++) {
                    s0 = _mm512_dpbusd_epi32(s0, v[t], _mm512_set1_epi32(q[t]));
                    s1 = _mm512_dpbusd_epi32(s1, v[t + 4], _mm512_set1_epi32(q[t + 4]));
                }
                __m512 f = _mm512_mul_ps(dw, _mm512_set1_ps(act[i].d[b]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), f, acc[i]);
                mins[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(act[i].s[b]), mins[i]);
            }
        }
    }
    const __mmask16 stored = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++) _mm512_mask_storeu_ps(out + (size_t)i * ldo, stored, _mm512_add_ps(acc[i], mins[i]));
}

#define LANES_CASE(M)                                                                                              \
    case M: q4_1_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, rows + i, M, out + (size_t)i * ldo + r, ldo); break;

/* rows_fn over split Q4_1 rows: the activation rows copied out as split_rows_driver does, then
 * 16 weight rows a pass against LANE_MAX_ROWS activation rows (each constant, so loops unroll). */
void rows_q4_1_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                     float *out, size_t ldo) {
    const int nb = k / 32;
    const size_t per_row = (size_t)nb * (32 + 2 * sizeof(float));
    char *space = mlxcel_scratch(&split_scratch, per_row * (size_t)m + sizeof(struct split_act) * (size_t)m);
    struct split_act *rows = (struct split_act *)(space + per_row * (size_t)m);
    for (int i = 0; i < m; i++) {
        float *d = (float *)(space + per_row * (size_t)i), *s = d + nb;
        int8_t *q = (int8_t *)(s + nb);
        rows[i] = (struct split_act){q, d, s};
        const struct q8_1_block *y = (const struct q8_1_block *)((const char *)act + (size_t)i * act_bytes);
        for (int b = 0; b < nb; b++) {
            memcpy(q + (size_t)b * 32, y[b].qs, 32);
            d[b] = half_to_float(y[b].d);
            s[b] = half_to_float(y[b].s);
        }
    }
    const uint8_t *wr = w;
    for (int r = 0; r < n; r += LANE_ROWS) {
        const int nrows = n - r < LANE_ROWS ? n - r : LANE_ROWS;
        for (int i = 0; i < m; i += LANE_MAX_ROWS) {
            switch (m - i < LANE_MAX_ROWS ? m - i : LANE_MAX_ROWS) {
                LANES_CASE(1) LANES_CASE(2) LANES_CASE(3) LANES_CASE(4) LANES_CASE(5) LANES_CASE(6)
                LANES_CASE(7) LANES_CASE(8) LANES_CASE(9) LANES_CASE(10) LANES_CASE(11) LANES_CASE(12)
                LANES_CASE(13) LANES_CASE(14) LANES_CASE(15) LANES_CASE(16)
            }
        }
    }
}

#define SPLIT_KERNELS(NAME, FORM)                                                                                  \
    void rows_##NAME##_split(int k, const void *w, size_t row_bytes, int n, const void *act,               \
                                    size_t act_bytes, int m, float *out, size_t ldo) {                            \
        split_rows_driver(k, w, row_bytes, n, act, act_bytes, m, out, ldo, FORM);                                 \
    }                                                                                                             \
    void dequantize_##NAME##_split(const void *x, float *y, int64_t k) { split_dequantize(x, y, k, FORM); }

void dequantize_q4_1_split(const void *x, float *y, int64_t k) { split_dequantize(x, y, k, Q4_1_SPLIT); }
SPLIT_KERNELS(q5_0, Q5_0_SPLIT)
SPLIT_KERNELS(q5_1, Q5_1_SPLIT)
#endif
