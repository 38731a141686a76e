/* Decode rows of the K-quants (Q4_K and Q6_K: the common Q4_K_M and Q6_K files) times activation
 * rows quantized to ggml's Q8_K blocks, with AVX-512 VNNI, and the Q8_K quantizer of those
 * activations. quant_rows.c's mlxcel_rows_kernel and mlxcel_quantizer hand them out.
 *
 * Why lanes: batched decode, speculative verification and MoE experts multiply a weight by 2-16
 * activation rows. A kernel whose vector holds values of one weight row pays, per (weight row,
 * activation row) pair, for the super-block's factors and a horizontal sum, and 8 activation
 * rows cost 5-7x one (docs/benchmarks/quantized.md). Here, as in quant_rows.c's Q8_0 and
 * split_rows.c's Q4_1 kernels, a vector's 16 lanes are 16 weight rows: 4 values of every row
 * against the same 4 activation values (one broadcast dword) are one vpdpbusd. A pass unpacks
 * each super-block of its 16 rows once (their bytes brought into lane order by rows16_dwords,
 * the nibbles or 6-bit values split out, the 6- or 8-bit sub-block scales and the factors) and
 * takes it against up to 16 activation rows.
 *
 * Grouped rows (rows_q4_K_grouped, rows_q6_K_grouped: a GGUF's Q4_K and Q6_K linear weights and
 * expert stacks, block_weight.group_rows): 16 rows' super-blocks stored side by side, dword t of
 * row r at 64 t + 4 r, so that the lanes' reads are four vector loads instead of rows16_dwords'
 * 16 loads and transposes. Those transposes had cost more than the arithmetic; grouped, the lanes
 * take every product of such a weight: one row 1.05-2x the two-row path's speed from memory (a
 * 2048 x 768 Q6_K in the caches 0.94x), 4-8 rows 1.2-2.3x, prompt chunks of 16-256 rows 1.04-4x
 * ggml's mul_mat (scripts/bench_grouped_rows.py). Q6_K's 16 x 210 bytes are half a cache line over
 * whole ones: its rows' d go ahead of their dwords where a super-block starts mid-line, and its
 * dwords in the order the lanes read them; one stream read this fast outruns the hardware's
 * prefetch, so each pass prefetches into L2 GROUP_AHEAD super-blocks ahead (without either,
 * Q6_K's one row ran at 0.26-0.77x).
 *
 * Arithmetic: per super-block, ggml's integer sum exactly (the sub-blocks' products times their
 * scales, less the mins times the activations' 16-value sums for Q4_K, less 32 times the scales
 * times those sums for Q6_K: ggml's offset), then into the row's float sum as ggml does
 * (d_w d_a times it; Q4_K's mins term times dmin_w d_a), super-block after super-block. Each
 * (weight row, activation row) pair is its own lane of the same operations in the same order
 * whatever the other rows are (rows past the band's end compute on a copy of its last row and
 * are not stored): bit for bit the row alone, at every row count.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)

#define QK_K 256

struct q8_K_block { /* block_q8_K */
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
};

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
#define K_LANES 16    /* weight rows a pass: a vector lane each */
#define K_MAX_ROWS 16 /* activation rows a pass (as Q8_0's and Q4_1's lane kernels) */
#define Q4_K_BYTES 144 /* block_q4_K: d, dmin, 12 bytes of scales and mins, 128 of nibbles */
#define Q6_K_BYTES 210 /* block_q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, d */
#define Q6_K_DWORDS 52 /* its whole dwords: d (2 bytes) after them (grouped: GROUP_TAILS_AHEAD) */
/* Which path takes m activation rows: up to 2 rows always the two-row path below; 3-8 rows too
 * when a weight row is at most FEW_ROWS_BLOCKS super-blocks long (k <= 2048); else the lanes. In
 * a decode pass streaming a model's weights, 2-8 rows of the lanes over short weight rows cost
 * far more than their arithmetic (a Qwen3.5-0.8B-shaped Q4_K_M: 4 rows 16.8 ms against 4.9 for
 * one, 9.9 with the two-row path; 6 rows 18.2 -> 15.3, 8 rows 22.5 -> 19.9; the small llama's 4
 * rows 7.6 -> 3.9), while with 4096- and 11008-value rows (a 7B) the lanes stay ahead from 3 rows
 * (4 rows 227-244 against 276 ms). scripts/bench_quant_rows.py, its weight read from the caches
 * again and again, favours the lanes at every shape; over a weight larger than the caches it
 * agrees with the passes (docs/benchmarks/quantized.md, "Decode rows in a pass"). */
#define SMALL_M_MAX 8 /* activation rows the two-row path takes at most */
#define q4_K_FEW_ROWS 8
#define q6_K_FEW_ROWS 8
#define FEW_ROWS_BLOCKS 8

/* vpshufb within each dword lane: pattern's bytes (the same for every lane) are byte indices 0-3
 * into the lane's own dword, 0x80 for a zero. vpshufb indexes the 128-bit lane: dword p of it
 * adds 4p to its indices (0x80 + 4p still reads as a zero). */
static inline __m512i lane_bytes(__m512i a, uint32_t pattern) {
    const __m512i base = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c));
    return _mm512_shuffle_epi8(a, _mm512_add_epi8(_mm512_set1_epi32((int)pattern), base));
}

/* Each lane's byte `byte` (0-3) as an unsigned int32. */
static inline __m512i lane_byte(__m512i a, int byte) { return lane_bytes(a, 0x80808000u | (uint32_t)byte); }

/* The pass after next into L2 (16 rows side by side are too short a stream each for the hardware
 * prefetchers, as the other lane kernels found): its bytes at the pace this pass reads its own. */
static inline void prefetch_next(const uint8_t *next, int b, int block_bytes) {
    const char *at = (const char *)next + (size_t)b * K_LANES * block_bytes;
    for (int l = 0; l < K_LANES * block_bytes; l += 64) _mm_prefetch(at + l, _MM_HINT_T1);
}

/* vpdpbusd from zero over n dwords: weights v[0..n) (u8) against the activation dwords q[0..n)
 * (s8, each broadcast to every lane). */
static inline __attribute__((always_inline)) __m512i dot_dwords(const __m512i *v, const int32_t *q, int n) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(q[0]));
    for (int t = 1; t < n; t++) s = _mm512_dpbusd_epi32(s, v[t], _mm512_set1_epi32(q[t]));
    return s;
}

/* The weight rows of a pass: rowp[r] for lane r (rows past nrows: copies of the last) and each
 * row's byte offset from w (for gathers). */
static inline void lane_rows(const uint8_t *w, size_t row_bytes, int nrows, const uint8_t *rowp[K_LANES],
                             int32_t offsets[K_LANES]) {
    for (int r = 0; r < K_LANES; r++) {
        const size_t at = (size_t)(r < nrows ? r : nrows - 1) * row_bytes;
        rowp[r] = w + at;
        offsets[r] = (int32_t)at;
    }
}

/* How far ahead grouped rows are prefetched into L2, in super-blocks of 16 rows (the next
 * group's when a group ends first): the hardware's prefetch of one stream read this fast fell
 * behind (a Q6_K trial: one row 0.57-0.77x the rows stored apart without it, 1.06-1.32x with it,
 * 4 to 16 ahead alike). */
#define GROUP_AHEAD 8
/* Grouped Q6_K: where each quad of dwords (4 q .. 4 q + 3: one vector load each) is stored, so that
 * the lanes read a super-block front to back (the scales, then each quarter's low, middle and
 * high bits); block_weight.QUAD_ORDER holds the same order the other way round. */
static const int8_t q6_K_quad_slot[13] = {1, 4, 2, 5, 7, 10, 8, 11, 3, 6, 9, 12, 0};

/* Grouped rows (GROUPED_TYPE): dwords t0 .. t0 + 3 of the 16 rows' super-block at `block`, a
 * vector each (dword t of row r at block + 64 t + 4 r): what rows16_dwords gathers and transposes
 * from rows stored apart, here four loads. */
static inline __attribute__((always_inline)) void group_dwords(const uint8_t *block, int t0, __m512i v[4]) {
    for (int j = 0; j < 4; j++) v[j] = _mm512_loadu_si512(block + 64 * (size_t)(t0 + j));
}

/* A lane kernel's read of 16 bytes at `off` in each of its rows' current super-block: from grouped
 * rows (`grouped`, a constant: `gb` their super-block) or from rows stored apart (`rowp`, `at`). */
#define LANE_DWORDS(off, v)                                        \
    do {                                                           \
        if (grouped) group_dwords(gb, (int)((off) / 4), v);        \
        else rows16_dwords(rowp, at + (off), v);                   \
    } while (0)
/* The same for Q6_K, its grouped quads in reading order (q6_K_quad_slot). */
#define Q6_DWORDS(off, v)                                                 \
    do {                                                                  \
        if (grouped) group_dwords(gb, 4 * q6_K_quad_slot[(off) / 16], v); \
        else rows16_dwords(rowp, at + (off), v);                          \
    } while (0)

/* --------------------------------------------------------------------------------------- Q4_K
 * 256 values: 8 sub-blocks of 32 with a 6-bit scale and min each (12 bytes, ggml's
 * get_scale_min_k4), d and dmin; value = d sc q - dmin m, q a nibble. Byte l of 32-byte group g
 * holds value 64g + l (low nibble, sub-block 2g) and 64g + 32 + l (high, sub-block 2g + 1).
 * Per super-block and pair: sum_j sc_j dot_j(q, a), and sum_j m_j (the sub-block's two 16-value
 * sums of a), each exact in int32; then d_w d_a and dmin_w d_a. */

/* Weight rows [0, nrows) (nrows <= 16) times m activation rows (m <= K_MAX_ROWS): out[i * ldo + r].
 * `grouped` (a constant): w is a group of 16 grouped rows (GROUPED_TYPE), nrows 16. */
static inline __attribute__((always_inline)) void q4_K_lanes(int nb, const uint8_t *w, size_t row_bytes, int nrows,
                                                           const uint8_t *act, size_t act_bytes, int m, float *out,
                                                           size_t ldo, const int grouped) {
    const __m512i low = _mm512_set1_epi8(0x0f), six = _mm512_set1_epi8(0x3f), two = _mm512_set1_epi8(0x03);
    const uint8_t *rowp[K_LANES], *next = w + 2 * K_LANES * row_bytes;
    int32_t offsets[K_LANES];
    lane_rows(w, row_bytes, nrows, rowp, offsets);
    (void)offsets;
    __m512 acc[K_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const size_t at = (size_t)b * Q4_K_BYTES;
        const uint8_t *gb = w + (size_t)b * K_LANES * Q4_K_BYTES;
        if (grouped) /* one stream, read front to back: into L2 from GROUP_AHEAD super-blocks on */
            for (int l = 0; l < K_LANES * Q4_K_BYTES; l += 64)
                _mm_prefetch((const char *)gb + GROUP_AHEAD * K_LANES * Q4_K_BYTES + l, _MM_HINT_T1);
        else
            prefetch_next(next, b, Q4_K_BYTES);
        /* h[0]: d and dmin; h[1..3]: the 12 bytes of scales and mins */
        __m512i h[4];
        LANE_DWORDS(0, h);
        const __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h[0]));
        const __m512 dminw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h[0], 16)));
        /* bytes: scales 0-3, mins 0-3, scales 4-7, mins 4-7 (get_scale_min_k4) */
        const __m512i sc_lo = _mm512_and_si512(h[1], six), m_lo = _mm512_and_si512(h[2], six);
        const __m512i sc_hi = _mm512_or_si512(_mm512_and_si512(h[3], low),
                                              _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[1], 6), two), 4));
        const __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(h[3], 4), low),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h[2], 6), two), 4));
        /* mins[j]: m_j in both 16-bit halves, against the dword of 16-value sums 2j and 2j + 1 */
        __m512i mins[8];
        for (int j = 0; j < 4; j++) {
            const uint32_t twice = 0x80008000u | (uint32_t)j << 16 | (uint32_t)j; /* bytes j, zero, j, zero */
            mins[j] = lane_bytes(m_lo, twice);
            mins[4 + j] = lane_bytes(m_hi, twice);
        }
        __m512i isum[K_MAX_ROWS];
        for (int i = 0; i < m; i++) isum[i] = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            const __m512i sc0 = lane_byte(g < 2 ? sc_lo : sc_hi, (2 * g) & 3);
            const __m512i sc1 = lane_byte(g < 2 ? sc_lo : sc_hi, (2 * g + 1) & 3);
            __m512i u[8], lo[8], hi[8];
            LANE_DWORDS(16 + 32 * (size_t)g, u);
            LANE_DWORDS(32 + 32 * (size_t)g, u + 4);
            for (int t = 0; t < 8; t++) {
                lo[t] = _mm512_and_si512(u[t], low);
                hi[t] = _mm512_and_si512(_mm512_srli_epi32(u[t], 4), low);
            }
            for (int i = 0; i < m; i++) {
                const struct q8_K_block *y = (const struct q8_K_block *)(act + (size_t)i * act_bytes) + b;
                const int32_t *q = (const int32_t *)(y->qs + 64 * g);
                __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(dot_dwords(lo, q, 8), sc0),
                                             _mm512_mullo_epi32(dot_dwords(hi, q + 8, 8), sc1));
                isum[i] = _mm512_add_epi32(isum[i], s);
            }
        }
        for (int i = 0; i < m; i++) {
            const struct q8_K_block *y = (const struct q8_K_block *)(act + (size_t)i * act_bytes) + b;
            const int32_t *bs = (const int32_t *)y->bsums;
            __m512i msum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mins[0], _mm512_set1_epi32(bs[0]));
            for (int j = 1; j < 8; j++) msum = _mm512_dpwssd_epi32(msum, mins[j], _mm512_set1_epi32(bs[j]));
            const __m512 da = _mm512_set1_ps(y->d);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(dw, da), acc[i]);
            acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dminw, da), acc[i]);
        }
    }
    const __mmask16 stored = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++) _mm512_mask_storeu_ps(out + (size_t)i * ldo, stored, acc[i]);
}

/* --------------------------------------------------------------------------------------- Q6_K
 * 256 values: ql (low 4 bits), qh (high 2 bits), 16 int8 scales (one per 16 values), d. In half
 * n (values 128n ..), byte l < 32 of ql's 64 holds values 128n + l (low nibble) and + 64 (high),
 * byte 32 + l values + 32 and + 96, their top bits in qh's byte l (bit pairs 0-1, 2-3, 4-5, 6-7
 * for + 0, + 32, + 64, + 96). The stored values are q + 32 (0-63): the products take them as u8,
 * and 32 times the scales times the activations' 16-value sums are taken off (ggml's way): per
 * super-block sum_j sc_j (dot_j(q + 32, a) - 32 bsum_j), exact in int32; then d_w d_a. */

static inline __attribute__((always_inline)) void q6_K_lanes(int nb, const uint8_t *w, size_t row_bytes, int nrows,
                                                           const uint8_t *act, size_t act_bytes, int m, float *out,
                                                           size_t ldo, const int grouped) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const uint8_t *rowp[K_LANES], *next = w + 2 * K_LANES * row_bytes;
    int32_t offsets[K_LANES];
    lane_rows(w, row_bytes, nrows, rowp, offsets);
    const __m512i row_at = _mm512_loadu_si512(offsets);
    __m512 acc[K_MAX_ROWS];
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const size_t at = (size_t)b * Q6_K_BYTES;
        const uint8_t *blk = w + (size_t)b * K_LANES * Q6_K_BYTES; /* grouped: the 16 rows' super-block */
        const int ahead = grouped && GROUP_TAILS_AHEAD(blk);
        const uint8_t *gb = blk + (ahead ? 2 * K_LANES : 0); /* its dwords */
        __m512 dw;
        if (grouped) { /* the 16 rows' d after their dwords or ahead of them */
            for (int l = 0; l < K_LANES * Q6_K_BYTES; l += 64)
                _mm_prefetch((const char *)blk + GROUP_AHEAD * K_LANES * Q6_K_BYTES + l, _MM_HINT_T1);
            dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(ahead ? blk : blk + 64 * Q6_K_DWORDS)));
        } else {
            prefetch_next(next, b, Q6_K_BYTES);
            /* and each row's next block into L1: a pass's 13 scattered loads a row and block left
             * the rows waiting on memory (2 activation rows 3x one on 4096x11008; with this, 8 rows
             * 20-25 % faster; Q4_K's contiguous 9 loads a row lost with it) */
            for (int r = 0; r < K_LANES; r++)
                for (int l = 0; l < Q6_K_BYTES + 63; l += 64)
                    _mm_prefetch((const char *)rowp[r] + at + Q6_K_BYTES + (l < Q6_K_BYTES ? l : Q6_K_BYTES - 1), _MM_HINT_T0);
            /* d: the high half of the dword of bytes 206-209 (the block's last four) */
            dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                _mm512_srli_epi32(_mm512_i32gather_epi32(row_at, (const void *)(w + at + 206), 1), 16)));
        }
        __m512i sv[4];
        Q6_DWORDS(192, sv); /* sv[t]'s lane: scales 4t .. 4t + 3 */
        /* pairs[t]: scales 2t and 2t + 1 as int16 halves, against the dword of 16-value sums 2t, 2t + 1 */
        __m512i pairs[8];
        for (int t = 0; t < 4; t++) {
            /* bytes zero, 0, zero, 1 (and 2, 3): each scale the high byte of its half, then shifted down */
            pairs[2 * t] = _mm512_srai_epi16(lane_bytes(sv[t], 0x01800080u), 8);
            pairs[2 * t + 1] = _mm512_srai_epi16(lane_bytes(sv[t], 0x03800280u), 8);
        }
        __m512i isum[K_MAX_ROWS];
        for (int i = 0; i < m; i++) isum[i] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) { /* half n = c / 2, bytes l0 .. l0 + 15 with l0 = 16 (c % 2) */
            const int n = c / 2, l0 = 16 * (c % 2);
            __m512i a[4], bq[4], h[4], v[16];
            Q6_DWORDS(64 * (size_t)n + (size_t)l0, a);
            Q6_DWORDS(64 * (size_t)n + 32 + (size_t)l0, bq);
            Q6_DWORDS(128 + 32 * (size_t)n + (size_t)l0, h);
            for (int t = 0; t < 4; t++) { /* v[4s + t]: sub-block 8n + 2s + c % 2, its dword t */
                v[t] = _mm512_or_si512(_mm512_and_si512(a[t], low), _mm512_and_si512(_mm512_slli_epi32(h[t], 4), top));
                v[4 + t] = _mm512_or_si512(_mm512_and_si512(bq[t], low), _mm512_and_si512(_mm512_slli_epi32(h[t], 2), top));
                v[8 + t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a[t], 4), low), _mm512_and_si512(h[t], top));
                v[12 + t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(bq[t], 4), low),
                                            _mm512_and_si512(_mm512_srli_epi32(h[t], 2), top));
            }
            __m512i sc[4];
            for (int s = 0; s < 4; s++) { /* sub-block j's scale, sign-extended: byte j % 4 of sv[j / 4] */
                const int j = 8 * n + 2 * s + c % 2;
                sc[s] = _mm512_srai_epi32(_mm512_slli_epi32(sv[j / 4], 24 - 8 * (j % 4)), 24);
            }
            for (int i = 0; i < m; i++) {
                const struct q8_K_block *y = (const struct q8_K_block *)(act + (size_t)i * act_bytes) + b;
                const int32_t *q = (const int32_t *)(y->qs + 128 * n + l0);
                __m512i s = _mm512_mullo_epi32(dot_dwords(v, q, 4), sc[0]);
                for (int t = 1; t < 4; t++)
                    s = _mm512_add_epi32(s, _mm512_mullo_epi32(dot_dwords(v + 4 * t, q + 8 * t, 4), sc[t]));
                isum[i] = _mm512_add_epi32(isum[i], s);
            }
        }
        for (int i = 0; i < m; i++) {
            const struct q8_K_block *y = (const struct q8_K_block *)(act + (size_t)i * act_bytes) + b;
            const int32_t *bs = (const int32_t *)y->bsums;
            __m512i offset = _mm512_dpwssd_epi32(_mm512_setzero_si512(), pairs[0], _mm512_set1_epi32(bs[0]));
            for (int t = 1; t < 8; t++) offset = _mm512_dpwssd_epi32(offset, pairs[t], _mm512_set1_epi32(bs[t]));
            const __m512i sum = _mm512_sub_epi32(isum[i], _mm512_slli_epi32(offset, 5));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(y->d)), acc[i]);
        }
    }
    const __mmask16 stored = (__mmask16)((1u << nrows) - 1);
    for (int i = 0; i < m; i++) _mm512_mask_storeu_ps(out + (size_t)i * ldo, stored, acc[i]);
}

/* ------------------------------------------------------------------------ few activation rows
 * A lone activation row (single-stream decode) shares no unpacking, and the lanes' transposes
 * cost more than its weights take to read (Q6_K's up to 2 rows: q6_K_FEW_ROWS): it takes two
 * weight rows at a time instead (rows r
 * and r + n/2, so that each stream of blocks stays sequential for the prefetchers), each row's
 * super-block read with whole loads, its values in vector lanes (ggml's layout), the sums
 * reduced to the same exact integers as the lanes' per super-block, and then the lanes' float
 * operations in the same order (a product, then a fused multiply-add per term): the same bits
 * as the row in any pass of the lanes. */

/* The lanes of four vectors summed each: [sum a, sum b, sum c, sum d] (c and d: 256-bit sums). */
static inline __m128i four_sums(__m512i a, __m512i b, __m256i c, __m256i d) {
    const __m512i cz = _mm512_zextsi256_si512(c), dz = _mm512_zextsi256_si512(d);
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(cz, dz), _mm512_unpackhi_epi32(cz, dz));
    const __m512i all = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(all), _mm512_extracti64x4_epi64(all, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* One Q4_K super-block against one Q8_K block: the lanes of *p sum to sum_j sc_j dot_j, those of
 * *mins to sum_j m_j (the sub-block's two 16-value sums). Vector v: bytes 32v .. 32v + 31 broadcast, low nibbles (sub-block
 * 2v) in the lower half and high ones (2v + 1) in the upper: values 64v .. 64v + 63 as stored in
 * the activations; u8 x s8 pairs to int16 (at most 2 x 15 x 127), times the scales to int32. */
static inline __attribute__((always_inline)) void q4_K_row_ints(const uint8_t *x, const struct q8_K_block *y,
                                                                 __m512i *sums, __m256i *min_sums) {
    const __m512i low = _mm512_set1_epi8(0x0f), high_half = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i pick = _mm512_set_epi16(1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                          0, 0, 0, 0, 0, 0);
    const __m128i pair = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    uint32_t u0, u1, u2;
    memcpy(&u0, x + 4, 4);
    memcpy(&u1, x + 8, 4);
    memcpy(&u2, x + 12, 4);
    const uint64_t sc = (uint64_t)(u0 & 0x3f3f3f3fu) |
                        (uint64_t)((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
    const uint64_t mn = (uint64_t)(u1 & 0x3f3f3f3fu) |
                        (uint64_t)(((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
    __m512i p = _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        __m512i bytes = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 16 + 32 * v)));
        __m512i q = _mm512_and_si512(_mm512_srlv_epi64(bytes, high_half), low);
        __m512i s = _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16((short)(2 * v))), sc16);
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(q, _mm512_loadu_si512(y->qs + 64 * v)), s);
    }
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn), pair));
    *sums = p;
    *min_sums = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), mins);
}

/* One Q6_K super-block against one Q8_K block: the lanes of *sums add up to sum_j sc_j dot_j(q + 32, a),
 * those of *offsets to sum_j sc_j bsum_j. */
static inline __attribute__((always_inline)) void q6_K_row_ints(const uint8_t *x, const struct q8_K_block *y,
                                                                 __m512i *sums, __m256i *offsets) {
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    /* qh's bit pairs 0-1 and 2-3 moved to bits 4-5 (left by 4 and 2), pairs 4-5 and 6-7 (right
     * by 0 and 2), for the two 256-bit halves; what crosses into a neighbouring byte is masked */
    const __m512i left = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), right = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    /* in each 128-bit lane L, 16-bit scale L (or 4 + L) of a broadcast group of eight */
    const __m512i pick_l = _mm512_set_epi8(7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 7, 6, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
    const __m512i pick_h = _mm512_add_epi8(pick_l, _mm512_set1_epi8(8));
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(x + 192)));
    __m512i p = _mm512_setzero_si512();
    for (int half = 0; half < 2; half++) {
        __m512i ql = _mm512_loadu_si512(x + 64 * half);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 128 + 32 * half)));
        __m512i q0 = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_and_si512(_mm512_sllv_epi64(qh, left), top));
        __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low),
                                     _mm512_and_si512(_mm512_srlv_epi64(qh, right), top));
        __m512i group = _mm512_broadcast_i32x4(half ? _mm256_extracti128_si256(scales, 1) : _mm256_castsi256_si128(scales));
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(q0, _mm512_loadu_si512(y->qs + 128 * half)),
                                _mm512_shuffle_epi8(group, pick_l));
        p = _mm512_dpwssd_epi32(p, _mm512_maddubs_epi16(q1, _mm512_loadu_si512(y->qs + 128 * half + 64)),
                                _mm512_shuffle_epi8(group, pick_h));
    }
    *sums = p;
    *offsets = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), scales);
}

/* Weight rows w0 and w1 of nb super-blocks (w1 may be w0) times m activation rows (y, act_bytes
 * apart): out0[i * ldo] and out1[i * ldo]. Lane 0 of a row's float vector is w0's, lane 1 w1's.
 * Each weight block is unpacked once for the m rows (the same loads and operations: the compiler
 * keeps one copy). */
static inline __attribute__((always_inline)) void q4_K_few_rows(int nb, const uint8_t *w0, const uint8_t *w1,
                                                                 const uint8_t *y, size_t act_bytes, int m,
                                                                 float *out0, float *out1, size_t ldo) {
    __m128 acc[SMALL_M_MAX] = {_mm_setzero_ps()};
    for (int i = 0; i < m; i++) acc[i] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++, w0 += Q4_K_BYTES, w1 += Q4_K_BYTES) {
        uint32_t h0, h1;
        memcpy(&h0, w0, 4), memcpy(&h1, w1, 4);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)((uint64_t)h1 << 32 | h0))); /* d0 dmin0 d1 dmin1 */
        const __m128 d4 = _mm_shuffle_ps(dd, dd, _MM_SHUFFLE(3, 1, 2, 0));
        for (int i = 0; i < m; i++) {
            const struct q8_K_block *a = (const struct q8_K_block *)(y + (size_t)i * act_bytes) + b;
            __m512i p0, p1;
            __m256i m0, m1;
            q4_K_row_ints(w0, a, &p0, &m0);
            q4_K_row_ints(w1, a, &p1, &m1);
            const __m128 sums = _mm_cvtepi32_ps(four_sums(p0, p1, m0, m1)); /* isum 0, 1, msum 0, 1 */
            const __m128 f = _mm_mul_ps(d4, _mm_set1_ps(a->d));
            acc[i] = _mm_fmadd_ps(sums, f, acc[i]);
            acc[i] = _mm_fnmadd_ps(_mm_movehl_ps(sums, sums), _mm_movehl_ps(f, f), acc[i]);
        }
    }
    for (int i = 0; i < m; i++) {
        out0[i * ldo] = _mm_cvtss_f32(acc[i]);
        out1[i * ldo] = _mm_cvtss_f32(_mm_movehdup_ps(acc[i]));
    }
}

static inline __attribute__((always_inline)) void q6_K_few_rows(int nb, const uint8_t *w0, const uint8_t *w1,
                                                                 const uint8_t *y, size_t act_bytes, int m,
                                                                 float *out0, float *out1, size_t ldo) {
    __m128 acc[SMALL_M_MAX] = {_mm_setzero_ps()};
    for (int i = 0; i < m; i++) acc[i] = _mm_setzero_ps();
    for (int b = 0; b < nb; b++, w0 += Q6_K_BYTES, w1 += Q6_K_BYTES) {
        uint16_t h0, h1;
        memcpy(&h0, w0 + 208, 2), memcpy(&h1, w1 + 208, 2);
        const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)h1 << 16 | h0)));
        for (int i = 0; i < m; i++) {
            const struct q8_K_block *a = (const struct q8_K_block *)(y + (size_t)i * act_bytes) + b;
            __m512i p0, p1;
            __m256i o0, o1;
            q6_K_row_ints(w0, a, &p0, &o0);
            q6_K_row_ints(w1, a, &p1, &o1);
            const __m128i four = four_sums(p0, p1, o0, o1); /* products 0, 1, offsets 0, 1 */
            const __m128i sums = _mm_sub_epi32(four, _mm_slli_epi32(_mm_unpackhi_epi64(four, four), 5));
            acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums), _mm_mul_ps(d, _mm_set1_ps(a->d)), acc[i]);
        }
    }
    for (int i = 0; i < m; i++) {
        out0[i * ldo] = _mm_cvtss_f32(acc[i]);
        out1[i * ldo] = _mm_cvtss_f32(_mm_movehdup_ps(acc[i]));
    }
}

/* rows_fn: weight rows [0, n) times m activation rows (ggml's Q8_K blocks as they are), 16
 * weight rows a pass against K_MAX_ROWS activation rows (each count a constant, so loops unroll). */
#define K_CASE(NAME, M)                                                                                            \
    case M: NAME##_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, nrows, ar + (size_t)i * act_bytes, act_bytes, \
                         M, out + (size_t)i * ldo + r, ldo, 0); break;
/* The two-row path over all n weight rows (rows r and r + n/2 together; an odd last row with
 * itself) for M activation rows, a constant: each count its own unrolled copy (a runtime count
 * left a lone row's accumulators in memory, 3-4 % slower). */
#define FEW_CASE(NAME, M)                                                                                          \
    case M: {                                                                                                      \
        const int half = n / 2;                                                                                    \
        for (int r = 0; r < half; r++)                                                                             \
            NAME##_few_rows(nb, wr + (size_t)r * row_bytes, wr + (size_t)(r + half) * row_bytes, ar, act_bytes, M, \
                            out + r, out + r + half, ldo);                                                         \
        if (n % 2) {                                                                                               \
            const uint8_t *last = wr + (size_t)(n - 1) * row_bytes;                                                \
            NAME##_few_rows(nb, last, last, ar, act_bytes, M, out + n - 1, out + n - 1, ldo); /* lanes alike */    \
        }                                                                                                          \
        break;                                                                                                     \
    }
/* CASE(NAME, M) for each count of activation rows a pass of the lanes takes, 1 to K_MAX_ROWS. */
#define EACH_COUNT(CASE, NAME)                                                                                     \
    CASE(NAME, 1) CASE(NAME, 2) CASE(NAME, 3) CASE(NAME, 4) CASE(NAME, 5) CASE(NAME, 6) CASE(NAME, 7) CASE(NAME, 8) \
    CASE(NAME, 9) CASE(NAME, 10) CASE(NAME, 11) CASE(NAME, 12) CASE(NAME, 13) CASE(NAME, 14) CASE(NAME, 15)      \
    CASE(NAME, 16)
#define K_ROWS(NAME)                                                                                               \
    void rows_##NAME(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,     \
                     float *out, size_t ldo) {                                                                    \
        const int nb = k / QK_K;                                                                                  \
        const uint8_t *wr = w, *ar = act;                                                                         \
        if (m <= 2 || (m <= NAME##_FEW_ROWS && nb <= FEW_ROWS_BLOCKS)) {                                          \
            switch (m) {                                                                                          \
                FEW_CASE(NAME, 1) FEW_CASE(NAME, 2) FEW_CASE(NAME, 3) FEW_CASE(NAME, 4) FEW_CASE(NAME, 5)         \
                FEW_CASE(NAME, 6) FEW_CASE(NAME, 7) FEW_CASE(NAME, 8)                                             \
            }                                                                                                     \
            return;                                                                                               \
        }                                                                                                         \
        for (int r = 0; r < n; r += K_LANES) {                                                                    \
            const int nrows = n - r < K_LANES ? n - r : K_LANES;                                                  \
            for (int i = 0; i < m; i += K_MAX_ROWS) {                                                             \
                switch (m - i < K_MAX_ROWS ? m - i : K_MAX_ROWS) { EACH_COUNT(K_CASE, NAME) }                    \
            }                                                                                                     \
        }                                                                                                         \
    }

K_ROWS(q4_K)
K_ROWS(q6_K)

/* rows_fn over grouped rows (GROUPED_TYPE): w is the first of n rows and starts a group (a band
 * of the weight's rows starts at a multiple of 16: block_matmul.c's PART_ROWS). Every whole group
 * takes the lanes, for every count of activation rows: no transposes, and its bytes are read
 * front to back. The weight's last rows, past its last whole group, are stored as they were and
 * take rows_NAME. Each pair is the lanes' arithmetic, so the same bits as the rows stored apart. */
#define G_CASE(NAME, M)                                                                                            \
    case M: NAME##_lanes(nb, wr + (size_t)r * row_bytes, row_bytes, K_LANES, ar + (size_t)i * act_bytes,          \
                         act_bytes, M, out + (size_t)i * ldo + r, ldo, 1); break;
#define K_GROUPED(NAME)                                                                                            \
    void rows_##NAME##_grouped(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes,  \
                               int m, float *out, size_t ldo) {                                                    \
        const int nb = k / QK_K;                                                                                  \
        const uint8_t *wr = w, *ar = act;                                                                         \
        int r = 0;                                                                                                \
        for (; r + K_LANES <= n; r += K_LANES) {                                                                  \
            for (int i = 0; i < m; i += K_MAX_ROWS) {                                                             \
                switch (m - i < K_MAX_ROWS ? m - i : K_MAX_ROWS) { EACH_COUNT(G_CASE, NAME) }                    \
            }                                                                                                     \
        }                                                                                                         \
        if (r < n) rows_##NAME(k, wr + (size_t)r * row_bytes, row_bytes, n - r, act, act_bytes, m, out + r, ldo); \
    }

K_GROUPED(q4_K)
K_GROUPED(q6_K)
#endif /* AVX512VNNI */
#endif /* AVX512F, AVX512BW, F16C */
