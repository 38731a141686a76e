/* Q4_1, Q5_0 and Q5_1 weights whose rows were split or grouped at load: their rows' products
 * (decode rows and prompt chunks) and the split rows' expansion to float32, which quant_rows.c's
 * mlxcel_rows_kernel and mlxcel_dequantizer hand out for the split and grouped types (SPLIT_TYPE,
 * GROUPED_TYPE) on a CPU with AVX-512 VNNI and VL.
 *
 * A weight of one of these types whose rows were rearranged at load (block_weight.split_rows):
 * a row's blocks in groups of 16 (the last one shorter), each group as its blocks' factors d
 * (half floats), then their minimums m (Q4_1, Q5_1), then their fifth bits (4 bytes a block,
 * the Q5 types), then their nibbles (16 bytes a block): the same bytes as ggml's row in another
 * order, read front to back, so that 16 blocks' factors (minimums, fifth bits) are one load a
 * row. ggml's vec_dot for these types on x86 (AVX2) converts each block's factors one at a time
 * and takes 32 values an instruction; this takes 16 weight rows' 4 values each an instruction
 * (vpdpbusd: the values as u8 times the activations' s8), one arithmetic for the three forms
 * (lanes_block below, the form a compile-time constant), over split rows (split_lanes) or rows
 * grouped at load (group_lanes): a vector lane per weight row, 16 weight rows a pass, each block
 * unpacked once for up to 16 activation rows.
 *
 * The activations are ggml's own blocks, Q8_1 (d and s = d x the sum of the values) for the
 * types with a minimum, Q8_0 (d) for Q5_0, copied per row into arrays of values, d and s (for
 * Q8_0: where a block's integer sum starts, -16 x the sum of the values). A block's term is
 * d_w d_a x sum(q a) plus m_w s_a, or for Q5_0 (values q - 16) d_w d_a x sum((q - 16) a), the
 * integer sum started at -16 sum(a): ggml's integer sums, its terms added in another order
 * (float32 rounding).
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

/* One activation row as the split kernels read it: its values, and per block d and either s (the
 * forms with a minimum) or where the integer sums start (Q5_0). */
struct split_act {
    const int8_t *q;
    const float *d, *s;
    const int32_t *start; /* -16 x the sum of the block's values: the integer sums are then ggml's, of q - 16 */
};

static __thread struct mlxcel_scratch split_scratch;

/* The m activation rows (ggml's Q8_1 blocks for the forms with a minimum, else Q8_0) copied into
 * the thread's scratch as arrays of values, d and s (Q8_1) or start (Q8_0: -16 x the sum of the
 * values): the kernels then take a block's 32 values as 8 broadcast dwords and its d, s or start
 * as one number each. */
static struct split_act *split_activations(int nb, const void *act, size_t act_bytes, int m, struct split_form form) {
    const size_t per_row = (size_t)nb * (32 + 2 * sizeof(float));
    char *space = mlxcel_scratch(&split_scratch, per_row * (size_t)m + sizeof(struct split_act) * (size_t)m);
    struct split_act *rows = (struct split_act *)(space + per_row * (size_t)m);
    for (int i = 0; i < m; i++) {
        float *d = (float *)(space + per_row * (size_t)i), *s = d + nb; /* s or start */
        int32_t *start = (int32_t *)s;
        int8_t *q = (int8_t *)(s + nb);
        rows[i] = (struct split_act){q, d, form.minimum ? s : NULL, form.minimum ? NULL : start};
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
                start[b] = -16 * _mm_cvtsi128_si32(t);
            }
        }
    }
    return rows;
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

/* ------------------------------------------------------------ the decode rows: a vector lane per weight row
 * Why: a vector of one row's values (this file's first kernel, split_tile, until 2026-12-07) keeps
 * a (weight row, activation row) pair's partial sums in one vector whose lanes are values of the
 * row, so every pair pays for its blocks' factors (a conversion, a permutation and a multiply-add
 * per two blocks) and for two horizontal sums at the end: per activation row that is several times
 * the integer products themselves, and 8 activation rows cost 2.7-4.9x one
 * (docs/benchmarks/quantized.md). Here a vector's 16 lanes are 16 weight rows: a block of 32
 * values is 8 vpdpbusd, each taking 4 values of every row against the same 4 activation values
 * (one broadcast dword), and its factors are one multiply-add a block for all 16 rows, with no
 * horizontal sum at all. The rows' nibbles are brought into that order once per block (a 4 x 4
 * transpose of dwords within 128-bit lanes) and a group's factors, minimums and fifth bits once
 * per 16 blocks (16 x 16 transposes), for all activation rows of the pass. A Q5 block's fifth bits
 * (one dword a row after the transpose, bit i for value i) become a byte mask per 4 values: the
 * dword's byte holding them copied to the 4 bytes (vpshufb), each byte tested for its own bit.
 *
 * Arithmetic: each (weight row, activation row) pair is its lane of the same operations in the
 * same order whatever the other rows and lanes are (rows past the end of the band compute on a
 * copy of its last row and are not stored): bit for bit the row alone. Per block, the integer sum
 * of the 32 products (exact: ggml's; Q5_0's started at -16 x the activations' sum, so that it is
 * the sum over q - 16) times d_w d_a, plus m_w s_a (the forms with a minimum, summed apart and
 * added at the end), added block after block. */
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

/* The constants of a block's unpacking (split_lanes and group_lanes make them once a call). */
struct lane_consts {
    __m512i low, fifth, pick[4], bit_of[2];
};

static inline __attribute__((always_inline)) struct lane_consts lane_consts(void) {
    struct lane_consts c;
    c.low = _mm512_set1_epi8(0x0f), c.fifth = _mm512_set1_epi8(0x10);
    /* pick[j]: byte j of each dword copied to its 4 bytes (vpshufb indices, per 128-bit lane) */
    const __m512i dwords = _mm512_set4_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    for (int j = 0; j < 4; j++) c.pick[j] = _mm512_add_epi8(dwords, _mm512_set1_epi8((char)j));
    /* byte j: bit j of the low or the high half of a byte of fifth bits */
    c.bit_of[0] = _mm512_set1_epi32(0x08040201), c.bit_of[1] = _mm512_set1_epi32((int)0x80402010u);
    return c;
}

/* Block b of 16 weight rows against m activation rows: u[t]'s dword r holds row r's nibble bytes
 * 4t .. 4t + 3, h's dword r its fifth bits (bit i for value i; the Q5 forms), dw and mw its d and
 * m (lanes: rows). The arithmetic every lane kernel of these forms shares. */
static inline __attribute__((always_inline)) void lanes_block(const struct lane_consts *c, const __m512i u[4],
                                                              __m512i h, __m512 dw, __m512 mw, int b,
                                                              const struct split_act *act, int m, __m512 *acc,
                                                              __m512 *mins, struct split_form form) {
    __m512i v[8];
    for (int t = 0; t < 4; t++) { /* values 4t .. 4t + 3 (low nibbles) and 16 + 4t .. (high) */
        v[t] = _mm512_and_si512(u[t], c->low);
        v[t + 4] = _mm512_and_si512(_mm512_srli_epi32(u[t], 4), c->low);
    }
    if (form.five_bits) { /* value 4t + j's fifth bit: bit 4(t & 1) + j of qh's byte t >> 1 */
        for (int j = 0; j < 4; j++) { /* qh's byte j: values 8j .. 8j + 7, in v[2j] and v[2j + 1] */
            const __m512i bits = _mm512_shuffle_epi8(h, c->pick[j]);
            for (int half = 0; half < 2; half++) {
                const int t = 2 * j + half;
                v[t] = _mm512_mask_add_epi8(v[t], _mm512_test_epi8_mask(bits, c->bit_of[half]), v[t], c->fifth);
            }
        }
    }
    for (int i = 0; i < m; i++) {
        const int32_t *q = (const int32_t *)(act[i].q + (size_t)b * 32);
        /* two chains of 4 (the low and the high nibbles' values) */
        __m512i s0 = form.minimum ? _mm512_setzero_si512() : _mm512_set1_epi32(act[i].start[b]);
        __m512i s1 = _mm512_setzero_si512();
        for (int t = 0; t < 4; t++) {
            s0 = _mm512_dpbusd_epi32(s0, v[t], _mm512_set1_epi32(q[t]));
            s1 = _mm512_dpbusd_epi32(s1, v[t + 4], _mm512_set1_epi32(q[t + 4]));
        }
        const __m512i sum = _mm512_add_epi32(s0, s1);
        __m512 f = _mm512_mul_ps(dw, _mm512_set1_ps(act[i].d[b]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, acc[i]);
        if (form.minimum) mins[i] = _mm512_fmadd_ps(mw, _mm512_set1_ps(act[i].s[b]), mins[i]);
    }
}

static inline __attribute__((always_inline)) void lanes_store(const __m512 *acc, const __m512 *mins, int m, int nrows,
                                                              float *out, size_t ldo, struct split_form form) {
    const __mmask16 stored = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++)
        _mm512_mask_storeu_ps(out + (size_t)i * ldo, stored, form.minimum ? _mm512_add_ps(acc[i], mins[i]) : acc[i]);
}

/* Weight rows [0, nrows) (nrows <= 16, row_bytes apart, split rows of nb blocks in the given form)
 * times m activation rows (m <= LANE_MAX_ROWS): out[i * ldo + r]. */
static inline __attribute__((always_inline)) void split_lanes(int nb, const uint8_t *w, size_t row_bytes, int nrows,
                                                               const struct split_act *act, int m, float *out,
                                                               size_t ldo, struct split_form form) {
    const struct lane_consts c = lane_consts();
    const int block_bytes = 18 + 2 * form.minimum + 4 * form.five_bits;
    const size_t pass_block = (size_t)LANE_ROWS * block_bytes; /* a block's bytes in 16 rows */
    const uint8_t *rowp[LANE_ROWS], *next = w + 2 * LANE_ROWS * row_bytes;
    for (int r = 0; r < LANE_ROWS; r++) rowp[r] = w + (size_t)(r < nrows ? r : nrows - 1) * row_bytes;
    __m512 acc[LANE_MAX_ROWS], mins[LANE_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = mins[i] = _mm512_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += 16) {
        const int count = nb - b0 < 16 ? nb - b0 : 16;
        const __mmask16 in = (__mmask16)((1u << count) - 1);
        /* the group's parts: d, m, qh, nibbles (block_weight.SPLIT_FIELDS) */
        const size_t group = (size_t)b0 * block_bytes, at_mins = group + (size_t)count * 2,
                     at_qh = at_mins + (size_t)count * 2 * form.minimum,
                     at_nibbles = at_qh + (size_t)count * 4 * form.five_bits;
        /* the group's factors, a row a vector (lanes: blocks), transposed: dt[p]'s lanes are the
         * rows' d of block b0 + p, mt[p]'s their m, ht[p]'s their fifth bits */
        __m512 dt[16], mt[16], ht[16];
        for (int r = 0; r < LANE_ROWS; r++) {
            dt[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, rowp[r] + group));
            if (form.minimum) mt[r] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, rowp[r] + at_mins));
            if (form.five_bits) ht[r] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(in, rowp[r] + at_qh));
        }
        transpose16(dt);
        if (form.minimum) transpose16(mt);
        if (form.five_bits) transpose16(ht);
        for (int p = 0; p < count; p++) {
            const int b = b0 + p;
            /* the pass after next, into L2: 16 rows (contiguous, block_bytes a block and row). A
             * pass reads its rows side by side, each too short a stream for the prefetchers to
             * follow: without this, one activation row of Q4_1 ran 2-3x slower than a two-row
             * kernel on weights out of the caches; one pass ahead or into L1, 1.1-1.5x. */
            for (size_t l = (size_t)b * pass_block / 64; l <= ((size_t)b * pass_block + pass_block - 1) / 64; l++)
                _mm_prefetch((const char *)next + l * 64, _MM_HINT_T1);
            /* u[t]'s dword r: row r's nibble bytes 4t .. 4t + 3 */
            __m512i u[4];
            rows16_dwords(rowp, at_nibbles + (size_t)p * 16, u);
            lanes_block(&c, u, form.five_bits ? _mm512_castps_si512(ht[p]) : _mm512_setzero_si512(), dt[p],
                        form.minimum ? mt[p] : _mm512_setzero_ps(), b, act, m, acc, mins, form);
        }
    }
    lanes_store(acc, mins, m, nrows, out, ldo, form);
}

/* ------------------------------------------------------------ grouped rows (block_weight.group_rows)
 * Why: split_lanes spends more on bringing 16 rows' bytes into lane order (their nibbles, a 4 x 4
 * transpose of dwords a block; their factors, 16 x 16 transposes a group of blocks) than on the
 * arithmetic of one activation row. Grouped at load, the 16 rows of a group are stored block by
 * block as their dwords side by side (ggml's block, dword t of row r at 64 t + 4 r:
 * row_layouts.c), so a block's lanes are plain vector loads and the group is read front to back:
 * Q4_1's d and m (its first dword) then its 4 dwords of nibbles (320 bytes, 5 lines); Q5_1's d
 * and m, its fifth bits, its nibbles (384 bytes); Q5_0's fifth bits and nibbles, its rows' d (2
 * bytes each) after them or, where the block starts mid-line (16 x 22 bytes: every other one),
 * ahead of them (GROUP_TAILS_AHEAD). The same arithmetic as split_lanes (lanes_block), so each
 * pair's result is the same bits as over the rows split. A weight is grouped only in whole groups
 * (block_weight.group_rows), so every pass has 16 rows. */
static inline __attribute__((always_inline)) void group_lanes(int nb, const uint8_t *w, const struct split_act *act,
                                                               int m, float *out, size_t ldo, struct split_form form) {
    const struct lane_consts c = lane_consts();
    const int block_bytes = 18 + 2 * form.minimum + 4 * form.five_bits;
    const size_t group_block = (size_t)LANE_ROWS * block_bytes, ahead = 2 * group_block * (size_t)nb;
    __m512 acc[LANE_MAX_ROWS], mins[LANE_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = mins[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *gb = w + (size_t)b * group_block;
        for (size_t l = 0; l < group_block; l += 64) /* one stream, front to back: into L2, two groups on (as split_lanes) */
            _mm_prefetch((const char *)gb + ahead + l, _MM_HINT_T1);
        __m512 dw, mw = _mm512_setzero_ps();
        __m512i h = _mm512_setzero_si512();
        const uint8_t *lanes = gb;
        if (form.minimum) { /* dword 0: d, then m */
            const __m512i dm = _mm512_loadu_si512(gb);
            dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
            mw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
            lanes += 64;
        } else { /* Q5_0: the rows' d (2 bytes each) after the dwords or ahead of them */
            const int ahead = GROUP_TAILS_AHEAD(gb);
            lanes += ahead ? 32 : 0;
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ahead ? gb : gb + 64 * 5)));
        }
        if (form.five_bits) h = _mm512_loadu_si512(lanes), lanes += 64;
        __m512i u[4];
        for (int t = 0; t < 4; t++) u[t] = _mm512_loadu_si512(lanes + 64 * t);
        lanes_block(&c, u, h, dw, mw, b, act, m, acc, mins, form);
    }
    lanes_store(acc, mins, m, LANE_ROWS, out, ldo, form);
}

#define LANES_CASE(M)                                                                                              \
    case M:                                                                                                        \
        if (grouped) group_lanes(nb, wr + (size_t)r * row_bytes, rows + i, M, out + (size_t)i * ldo + r, ldo, form); \
        else split_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, rows + i, M, out + (size_t)i * ldo + r,  \
                         ldo, form);                                                                               \
        break;

/* rows_fn over split rows, or (`grouped`, a constant) over grouped rows (w the first of n rows, n a
 * multiple of 16, starting a group): the activation rows copied out, then 16 weight rows a pass
 * against LANE_MAX_ROWS activation rows (each count a constant, so the kernel's loops unroll). */
static inline __attribute__((always_inline)) void lanes_driver(int k, const void *w, size_t row_bytes, int n,
                                                                const void *act, size_t act_bytes, int m, float *out,
                                                                size_t ldo, struct split_form form, const int grouped) {
    const int nb = k / 32;
    const struct split_act *rows = split_activations(nb, act, act_bytes, m, form);
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
    void rows_##NAME##_split(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes,    \
                             int m, float *out, size_t ldo) {                                                     \
        lanes_driver(k, w, row_bytes, n, act, act_bytes, m, out, ldo, FORM, 0);                                   \
    }                                                                                                             \
    void rows_##NAME##_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes,  \
                               int m, float *out, size_t ldo) {                                                   \
        lanes_driver(k, w, row_bytes, n, act, act_bytes, m, out, ldo, FORM, 1);                                   \
    }                                                                                                             \
    void dequantize_##NAME##_split(const void *x, float *y, int64_t k) { split_dequantize(x, y, k, FORM); }

SPLIT_KERNELS(q4_1, Q4_1_SPLIT)
SPLIT_KERNELS(q5_0, Q5_0_SPLIT)
SPLIT_KERNELS(q5_1, Q5_1_SPLIT)
#endif
