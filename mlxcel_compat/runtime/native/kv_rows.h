/* The KV cache's storage types in the CPU decode runtime's attention (attention.c, chunk_attention.c): rows of keys
 * and values stored as float32, IEEE half (f16) or bfloat16, as llama-server's -ctk/-ctv say
 * (runtime/kv_precision.py). New rows are rounded to the type when written (round to nearest,
 * ties to even: what MLX's astype and ggml's fp32-to-fp16 conversion do) and widened back to
 * float32 as attention reads them (ggml's CPU flash attention also converts its f16 rows to
 * float32 for its sums). F16C converts eight values an instruction where the CPU has it; the
 * scalar conversions below give the same bits (tests/runtime/test_cpu_decode_kv16.py).
 * Everything here is static: attention.c and chunk_attention.c each compile their own copy. */
#ifndef MLXCEL_KV_ROWS_H
#define MLXCEL_KV_ROWS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_kernels.h"
#include "small_m_kernel.h"
#include "vector_math.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's 32-value blocks (-ctk/-ctv q8_0, q4_0): an f16 scale, then 32 int8 values (q8_0) or 32
 * 4-bit values offset by 8, value j in the low nibble of byte j and value j + 16 in its high one
 * (q4_0). */
#define KV_QK 32
#define KV_Q8_0_BYTES 34
#define KV_Q4_0_BYTES 18

static inline int kv_blocks(int type) { return type == MLXCEL_KV_Q8_0 || type == MLXCEL_KV_Q4_0; }

/* The bytes one stored row of d values takes (d a multiple of 32 for the block types). */
static inline size_t kv_row_bytes(int type, int d) {
    if (type == MLXCEL_KV_Q8_0) return (size_t)d / KV_QK * KV_Q8_0_BYTES;
    if (type == MLXCEL_KV_Q4_0) return (size_t)d / KV_QK * KV_Q4_0_BYTES;
    return (size_t)d * (type == MLXCEL_KV_F32 ? 4 : 2);
}

/* The bytes of one value of the element types (f32, f16, bf16): what the span readers below take
 * (a paged layer of block types never reaches them: decode_kv.paged_fits refuses it). */
static inline size_t kv_value_bytes(int type) { return type == MLXCEL_KV_F32 ? 4 : 2; }

static inline float kv_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (!man) {
        bits = sign;
    } else { /* a subnormal half is a normal float: shift the mantissa up to its leading one */
        uint32_t e = 113;
        while (!(man & 0x400u)) man <<= 1, e--;
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t kv_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* nan stays nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and above round to inf */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, in units of 2^-24, ties to even */
        float a;
        memcpy(&a, &ax, sizeof a);
        float units = a * 0x1p24f; /* exact: a power of 2 */
        float whole = (units + 0x1p23f) - 0x1p23f; /* rounds to an integer, ties to even (units < 2^10) */
        return (uint16_t)(sign | (uint32_t)whole);
    }
    uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u); /* ties to even at the 13 bits dropped */
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

static inline float kv_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t kv_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* nan stays nan */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------ ggml's q8_0 and q4_0 blocks
 * Rounded as ggml's reference quantizers round (quantize_row_q8_0_ref, quantize_row_q4_0_ref):
 * q8_0's scale is the block's largest magnitude over 127 and each value x / scale rounded half
 * away from zero; q4_0's scale is the value of largest magnitude over -8 and each value
 * x / scale + 8.5 truncated, at most 15. Contraction into fused multiply-adds is off here: the
 * MLX side (kv_precision.py) rounds x * (1 / scale) + 8.5 in two steps, and the two must give
 * the same blocks. */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static void kv_quantize_q8_0(uint8_t *dst, const float *x, int n) {
    for (int b = 0; b < n / KV_QK; b++, x += KV_QK, dst += KV_Q8_0_BYTES) {
        float amax = 0.0f;
        for (int j = 0; j < KV_QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = kv_f32_to_f16(d);
        memcpy(dst, &h, 2);
        for (int j = 0; j < KV_QK; j++) dst[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
    }
}

static void kv_quantize_q4_0(uint8_t *dst, const float *x, int n) {
    for (int b = 0; b < n / KV_QK; b++, x += KV_QK, dst += KV_Q4_0_BYTES) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < KV_QK; j++)
            if (amax < fabsf(x[j])) amax = fabsf(x[j]), max = x[j];
        float d = max / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t h = kv_f32_to_f16(d);
        memcpy(dst, &h, 2);
        for (int j = 0; j < KV_QK / 2; j++) {
            float x0 = x[j] * id, x1 = x[j + KV_QK / 2] * id;
            int q0 = (int)(x0 + 8.5f), q1 = (int)(x1 + 8.5f);
            q0 = q0 < 15 ? q0 : 15, q1 = q1 < 15 ? q1 : 15;
            dst[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}
#pragma GCC pop_options

static inline float kv_block_scale(const uint8_t *block) {
    uint16_t h;
    memcpy(&h, block, 2);
    return kv_f16_to_f32(h);
}

/* dst (n floats) = n values of q8_0 or q4_0 blocks (whole rows) times their scales. */
static void kv_dequantize(int type, const uint8_t *src, float *dst, int n) {
    for (int b = 0; b < n / KV_QK; b++, dst += KV_QK) {
        float d = kv_block_scale(src);
        if (type == MLXCEL_KV_Q8_0) {
            const int8_t *qs = (const int8_t *)(src + 2);
            for (int j = 0; j < KV_QK; j++) dst[j] = qs[j] * d;
            src += KV_Q8_0_BYTES;
        } else {
            for (int j = 0; j < KV_QK / 2; j++) {
                dst[j] = ((src[2 + j] & 0x0f) - 8) * d;
                dst[j + KV_QK / 2] = ((src[2 + j] >> 4) - 8) * d;
            }
            src += KV_Q4_0_BYTES;
        }
    }
}

/* scores (M, ldc) columns [0, n1) = x (M, d) . block key rows [0, n1): x the float32 queries,
 * already scaled (as the 16-bit rows' kv_scores takes them), each key row dequantized once (its
 * blocks' values times their scales, kv_dequantize) and dotted with each query in float32.
 *
 * Why float32 queries, where ggml's CPU flash attention rounds the query to q8_0 for an integer
 * dot: the keys' own rounding is the precision the -ctk flag asks for; rounding the query too
 * added an error of about the same size on top, and q8_0 runs then agreed with this server's f16
 * run less often than llama-server's q8_0 with its f16 (docs/benchmarks/kv-precision.md). A
 * prompt chunk already read the dequantized rows with float32 queries: a step and a chunk now do
 * the same arithmetic, as with f16 keys, and MLX's path (which dequantizes the rows) too. */
#define KV_BLOCK_ROWS 64 /* key rows dequantized at a time: 16 KiB of float32 at d = 64 */
static void kv_block_scores(int T, int M, int n1, int d, const float *x, const uint8_t *keys, float *c, size_t ldc) {
    size_t row = kv_row_bytes(T, d);
    float *k = malloc((size_t)KV_BLOCK_ROWS * d * sizeof(float));
    if (!k) abort();
    for (int t0 = 0; t0 < n1; t0 += KV_BLOCK_ROWS) {
        int rows = n1 - t0 < KV_BLOCK_ROWS ? n1 - t0 : KV_BLOCK_ROWS;
        for (int t = 0; t < rows; t++) kv_dequantize(T, keys + (size_t)(t0 + t) * row, k + (size_t)t * d, d);
        rows_nt(M, 0, rows, d, x, (size_t)d, k, (size_t)d, c + t0, ldc, 1.0f, 0.0f); /* float32 rows' kernel */
    }
    free(k);
}

/* out[i] += p[i, t] * v for each of the M rows (a zero weight adds nothing): one value row, dequantized
 * to v, into every query's sum (kv_block_weighted, kv_span_block_weighted). */
static inline void kv_add_weighted_row(int M, int d, const float *p, size_t ldp, int t, const float *v, float *out) {
    for (int i = 0; i < M; i++) {
        float w = p[(size_t)i * ldp + t];
        float *o = out + (size_t)i * d;
        if (w != 0.0f)
            for (int k = 0; k < d; k++) o[k] += w * v[k];
    }
}

/* out (M, d) = p (M, ldp) columns [0, n) times block value rows [0, n) (rows from K1 on: from
 * v2), each row dequantized once and accumulated in order of the rows (ggml's flash attention
 * dequantizes each V row to float32 and adds it, weighted, to the sum). */
static void kv_block_weighted(int T, int M, int d, int n, const float *p, size_t ldp, const uint8_t *values,
                              const uint8_t *v2, int K1, float *out) {
    size_t row = kv_row_bytes(T, d);
    float *v = malloc((size_t)d * sizeof(float));
    if (!v) abort();
    memset(out, 0, (size_t)M * d * sizeof(float));
    for (int t = 0; t < n; t++) {
        kv_dequantize(T, t < K1 ? values + (size_t)t * row : v2 + (size_t)(t - K1) * row, v, d);
        kv_add_weighted_row(M, d, p, ldp, t, v, out);
    }
    free(v);
}

/* dst (n values of `type`) = src rounded to the type (whole rows of blocks for q8_0 and q4_0). */
static inline void kv_narrow(int type, void *dst, const float *src, int n) {
    if (type == MLXCEL_KV_Q8_0) {
        kv_quantize_q8_0(dst, src, n);
        return;
    }
    if (type == MLXCEL_KV_Q4_0) {
        kv_quantize_q4_0(dst, src, n);
        return;
    }
    if (type == MLXCEL_KV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = dst;
    int i = 0;
    if (type == MLXCEL_KV_BF16) {
        for (; i < n; i++) d[i] = kv_f32_to_bf16(src[i]);
        return;
    }
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) d[i] = kv_f32_to_f16(src[i]);
}

/* dst (n floats) = src (n values of `type`) widened, exactly (blocks: dequantized). */
static inline void kv_widen(int type, const void *src, float *dst, int n) {
    if (kv_blocks(type)) {
        kv_dequantize(type, src, dst, n);
        return;
    }
    if (type == MLXCEL_KV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    int i = 0;
    if (type == MLXCEL_KV_BF16) {
        for (; i < n; i++) dst[i] = kv_bf16_to_f32(s[i]);
        return;
    }
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
    for (; i < n; i++) dst[i] = kv_f16_to_f32(s[i]);
}

/* ------------------------------------------------------------------ products over 16-bit rows
 * The decode step's two products with the stored rows read as they are: each vector of 16-bit
 * keys or values widened in registers (F16C / AVX-512's conversions, or the scalar ones) right
 * where small_m_kernel.h's kernels load a float32 vector, so the step reads half the bytes of a
 * float32 cache and writes nothing back. Each output element is summed in the same order
 * whatever the row counts (vector partial sums over k in order, hsum, the scalar tail), as in
 * small_m_kernel.h. `T` is a constant at every call site (kv_scores, kv_weighted). */

static inline __attribute__((always_inline)) vf kv_load16(const int T, const uint16_t *p) {
#if VL == 16 && defined(__AVX512F__)
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (T == MLXCEL_KV_F16) return (vf)_mm512_cvtph_ps(h);
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif VL == 8 && defined(__AVX2__) && defined(__F16C__)
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (T == MLXCEL_KV_F16) return (vf)_mm256_cvtph_ps(h);
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    float t[VL];
    for (int l = 0; l < VL; l++) t[l] = T == MLXCEL_KV_F16 ? kv_f16_to_f32(p[l]) : kv_bf16_to_f32(p[l]);
    vf v;
    memcpy(&v, t, sizeof v);
    return v;
#endif
}

static inline float kv_load16s(const int T, uint16_t h) { return T == MLXCEL_KV_F16 ? kv_f16_to_f32(h) : kv_bf16_to_f32(h); }

/* c[i, j] = dot(x[i, :], w[j, :]) for i < MB, j < NB: small_m_kernel.h's block over 16-bit rows of w. */
static inline __attribute__((always_inline)) void kv_dot_block(const int T, const int MB, const int NB, int K,
                                                               const float *x, size_t ldx, const uint16_t *w,
                                                               size_t ldw, float *c, size_t ldc) {
    vf acc[MB_MAX][NB_MAX];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = (vf){0};
    int k = 0;
    for (; k + VL <= K; k += VL) {
        vf wv[NB_MAX];
        for (int j = 0; j < NB; j++) {
            wv[j] = kv_load16(T, w + j * ldw + k);
            KEEP_IN_REGISTER(wv[j]);
        }
        for (int i = 0; i < MB; i++) {
            vf xv = loadv(x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < MB; i++) {
        float sums[NB_MAX];
#ifdef HAVE_HSUM4
        if (NB == 4) hsum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3], sums); /* hsum's bits, fewer shuffles */
        else
#endif
            for (int j = 0; j < NB; j++) sums[j] = hsum(acc[i][j]);
        if (k == K) { /* no scalar tail (every head size but odd ones): the block's scores in one store */
            memcpy(c + i * ldc, sums, NB * sizeof(float));
            continue;
        }
        for (int j = 0; j < NB; j++) {
            float s = sums[j];
            for (int kk = k; kk < K; kk++) s += x[i * ldx + kk] * kv_load16s(T, w[j * ldw + kk]);
            c[i * ldc + j] = s;
        }
    }
}

#define KV_DOT(mb, nb) kv_dot_block(T, mb, nb, K, x + (size_t)m * ldx, ldx, w + (size_t)n * ldw, ldw, c + (size_t)m * ldc + n, ldc)

/* c (M, n1 - n0 columns from n0) = x (M, K) against 16-bit rows [n0, n1) of w. */
static inline __attribute__((always_inline)) void kv_rows_nt(const int T, int M, int n0, int n1, int K, const float *x,
                                                             size_t ldx, const uint16_t *w, size_t ldw, float *c,
                                                             size_t ldc) {
    int n = n0;
    for (; n + NB_MAX <= n1; n += NB_MAX) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) KV_DOT(MB_MAX, NB_MAX);
        REMAINING_ROWS(KV_DOT, NB_MAX);
    }
    for (; n < n1; n++) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) KV_DOT(MB_MAX, 1);
        REMAINING_ROWS(KV_DOT, 1);
    }
}

/* c[i, cols] = sum_k x[i, k] * w[k, cols] for i < MB and NV vectors of columns: small_m_kernel.h's
 * block_nn over 16-bit rows of w, rows k >= K1 read from w2 (row k - K1) instead. */
static inline __attribute__((always_inline)) void kv_nn_block(const int T, const int MB, const int NV, int K,
                                                              const float *x, size_t ldx, const uint16_t *w,
                                                              size_t ldw, float *c, size_t ldc, const uint16_t *w2,
                                                              int K1) {
    vf acc[MB_MAX][NB_MAX];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};
    for (int k = 0; k < K; k++) {
        const uint16_t *row = k < K1 ? w + k * ldw : w2 + (k - K1) * ldw;
        vf wv[NB_MAX];
        for (int j = 0; j < NV; j++) {
            wv[j] = kv_load16(T, row + j * VL);
            KEEP_IN_REGISTER(wv[j]);
        }
        for (int i = 0; i < MB; i++) {
            vf xs = splat(x[i * ldx + k]);
            for (int j = 0; j < NV; j++) acc[i][j] += xs * wv[j];
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NV; j++) memcpy(c + i * ldc + j * VL, &acc[i][j], sizeof acc[i][j]);
}

#define KV_NN(mb, nv) kv_nn_block(T, mb, nv, K, x + (size_t)m * ldx, ldx, w + n, ldw, c + (size_t)m * ldc + n, ldc, w2 + n, K1)

static inline __attribute__((always_inline)) void kv_rows_nn(const int T, int M, int n1, int K, const float *x,
                                                             size_t ldx, const uint16_t *w, size_t ldw, float *c,
                                                             size_t ldc, const uint16_t *w2, int K1) {
    int n = 0;
    for (; n + NB_MAX * VL <= n1; n += NB_MAX * VL) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) KV_NN(MB_MAX, NB_MAX);
        REMAINING_ROWS(KV_NN, NB_MAX);
    }
    for (; n + VL <= n1; n += VL) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) KV_NN(MB_MAX, 1);
        REMAINING_ROWS(KV_NN, 1);
    }
    for (; n < n1; n++) /* the last columns, one at a time, in the same order */
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++)
                s += x[(size_t)m * ldx + k] * kv_load16s(T, k < K1 ? w[(size_t)k * ldw + n] : w2[(size_t)(k - K1) * ldw + n]);
            c[(size_t)m * ldc + n] = s;
        }
}

/* scores (M, ldc) columns [0, n1) = x (M, K) . 16-bit key rows [0, n1) of `keys` (type T: f16 or bf16). */
static void kv_scores(int T, int M, int n1, int K, const float *x, const uint16_t *keys, float *c, size_t ldc) {
    if (T == MLXCEL_KV_F16) kv_rows_nt(MLXCEL_KV_F16, M, 0, n1, K, x, K, keys, K, c, ldc);
    else kv_rows_nt(MLXCEL_KV_BF16, M, 0, n1, K, x, K, keys, K, c, ldc);
}

/* out (M, d) = p (M, ldp) columns [0, n) times 16-bit value rows [0, n) (rows from K1 on: from v2). */
static void kv_weighted(int T, int M, int d, int n, const float *p, size_t ldp, const uint16_t *values,
                        const uint16_t *v2, int K1, float *out) {
    if (T == MLXCEL_KV_F16) kv_rows_nn(MLXCEL_KV_F16, M, d, n, p, ldp, values, d, out, d, v2, K1);
    else kv_rows_nn(MLXCEL_KV_BF16, M, d, n, p, ldp, values, d, out, d, v2, K1);
}

/* ------------------------------------------------------------------ where a head's rows are
 * A sequence that adopted a prompt-cache entry's shared blocks (docs/prompt-cache.md, "The CPU
 * decode runtime reads the blocks in place") reads its first n_blocked positions from the blocks
 * themselves: block b holds positions [b * block_tokens, (b + 1) * block_tokens), laid out
 * (Hk, block_tokens, d) like the own buffer, which holds the positions from n_blocked on (row
 * t - n_blocked). The kernels below see a head's rows as a span: runs of consecutive rows (one
 * per block, then the own buffer's, then a row kept apart), and go run by run, so the row readers
 * are those of one buffer and no position takes a branch. The scores are each their own dot
 * product and the products by the values sum the rows in position order across the runs, with
 * the same operations as small_m_kernel.h's block_nn and kv_nn_block: a span gives the bits of
 * the same rows in one buffer. */

struct kv_run {
    const char *rows; /* n rows of d values of the span's type, one after another */
    int n;
};

/* The shared blocks a layer's cache starts with: blocks[b] and blocks[n_blocks + b] are block b's
 * keys and values ((Hk, block_tokens, d) each), n_blocks = n_blocked / block_tokens; NULL: none. */
struct kv_blocks {
    const void *const *blocks;
    int n_blocked, block_tokens;
};

/* Head h's runs in `runs` (room for n_blocked / block_tokens + 2): the blocks' rows (`which`: 0
 * keys, 1 values; b NULL: none), then `own_n` rows from `own` (the head's first own row), then
 * `apart_n` rows kept apart from `apart`. Returns the runs' count. */
static inline int kv_head_runs(struct kv_run *runs, const struct kv_blocks *b, int which, size_t row_bytes, int h,
                               const char *own, int own_n, const char *apart, int apart_n) {
    int count = 0;
    if (b && b->blocks) {
        int n_blocks = b->n_blocked / b->block_tokens;
        const void *const *base = b->blocks + (size_t)which * n_blocks;
        for (int i = 0; i < n_blocks; i++)
            runs[count++] = (struct kv_run){(const char *)base[i] + (size_t)h * b->block_tokens * row_bytes,
                                            b->block_tokens};
    }
    if (own_n > 0) runs[count++] = (struct kv_run){own, own_n};
    if (apart_n > 0) runs[count++] = (struct kv_run){apart, apart_n};
    return count;
}

static inline __attribute__((always_inline)) vf kv_loadv_any(const int T, const char *p) {
    return T == MLXCEL_KV_F32 ? loadv((const float *)p) : kv_load16(T, (const uint16_t *)p);
}

static inline float kv_loads_any(const int T, const char *p) {
    return T == MLXCEL_KV_F32 ? *(const float *)p : kv_load16s(T, *(const uint16_t *)p);
}

/* c[i, cols] = sum over the span's rows k of x[i, k] * row_k[cols] for i < MB and NV vectors of
 * columns from `col` (in values): block_nn / kv_nn_block run by run. */
static inline __attribute__((always_inline)) void kv_span_nn_block(const int T, const int MB, const int NV,
                                                                   const struct kv_run *runs, int n_runs,
                                                                   size_t row_bytes, int col, const float *x,
                                                                   size_t ldx, float *c, size_t ldc) {
    vf acc[MB_MAX][NB_MAX];
    size_t value = kv_value_bytes(T);
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};
    int k = 0;
    for (int r = 0; r < n_runs; r++) {
        const char *row = runs[r].rows + (size_t)col * value;
        for (int t = 0; t < runs[r].n; t++, k++, row += row_bytes) {
            vf wv[NB_MAX];
            for (int j = 0; j < NV; j++) {
                wv[j] = kv_loadv_any(T, row + (size_t)j * VL * value);
                KEEP_IN_REGISTER(wv[j]);
            }
            for (int i = 0; i < MB; i++) {
                vf xs = splat(x[i * ldx + k]);
                for (int j = 0; j < NV; j++) acc[i][j] += xs * wv[j];
            }
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NV; j++) memcpy(c + i * ldc + col + j * VL, &acc[i][j], sizeof acc[i][j]);
}

#define KV_SPAN_NN(mb, nv) kv_span_nn_block(T, mb, nv, runs, n_runs, row_bytes, n, x + (size_t)m * ldx, ldx, c + (size_t)m * ldc, ldc)

static inline __attribute__((always_inline)) void kv_span_nn(const int T, int M, int d, const struct kv_run *runs,
                                                             int n_runs, const float *x, size_t ldx, float *c,
                                                             size_t ldc) {
    size_t row_bytes = kv_row_bytes(T, d);
    int n = 0;
    for (; n + NB_MAX * VL <= d; n += NB_MAX * VL) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) KV_SPAN_NN(MB_MAX, NB_MAX);
        REMAINING_ROWS(KV_SPAN_NN, NB_MAX);
    }
    for (; n + VL <= d; n += VL) {
        int m = 0;
        for (; m + MB_MAX <= M; m += MB_MAX) KV_SPAN_NN(MB_MAX, 1);
        REMAINING_ROWS(KV_SPAN_NN, 1);
    }
    for (; n < d; n++) /* the last columns, one at a time, in the same order */
        for (int m = 0; m < M; m++) {
            float s = 0.0f;
            int k = 0;
            for (int r = 0; r < n_runs; r++)
                for (int t = 0; t < runs[r].n; t++, k++)
                    s += x[(size_t)m * ldx + k] * kv_loads_any(T, runs[r].rows + (size_t)t * row_bytes + (size_t)n * kv_value_bytes(T));
            c[(size_t)m * ldc + n] = s;
        }
}

/* out (M, d) = p (M, ldp) columns [0, the span's rows) times the span's value rows (type T). */
static void kv_span_weighted(int T, int M, int d, const struct kv_run *runs, int n_runs, const float *p, size_t ldp,
                             float *out) {
    if (T == MLXCEL_KV_F32) kv_span_nn(MLXCEL_KV_F32, M, d, runs, n_runs, p, ldp, out, d);
    else if (T == MLXCEL_KV_F16) kv_span_nn(MLXCEL_KV_F16, M, d, runs, n_runs, p, ldp, out, d);
    else kv_span_nn(MLXCEL_KV_BF16, M, d, runs, n_runs, p, ldp, out, d);
}

/* scores (M, ldc) columns [0, the span's rows) = x (M, K) . the span's key rows (type T), each its
 * own dot product (rows_nt, kv_scores: the same numbers as over one buffer). */
static void kv_span_scores(int T, int M, int K, const struct kv_run *runs, int n_runs, const float *x, float *c,
                           size_t ldc) {
    int k0 = 0;
    for (int r = 0; r < n_runs; k0 += runs[r++].n) {
        if (T == MLXCEL_KV_F32) rows_nt(M, 0, runs[r].n, K, x, K, (const float *)runs[r].rows, K, c + k0, ldc, 1.0f, 0.0f);
        else kv_scores(T, M, runs[r].n, K, x, (const uint16_t *)runs[r].rows, c + k0, ldc);
    }
}

/* kv_block_scores over a span's block key rows (q8_0, q4_0), run by run, x the scaled float32
 * queries: the same numbers as over one buffer holding the rows. */
static void kv_span_block_scores(int T, int M, int d, const struct kv_run *runs, int n_runs, const float *x, float *c,
                                 size_t ldc) {
    int k0 = 0;
    for (int r = 0; r < n_runs; k0 += runs[r++].n)
        kv_block_scores(T, M, runs[r].n, d, x, (const uint8_t *)runs[r].rows, c + k0, ldc);
}

/* kv_block_weighted over a span's block value rows: out (M, d) = p (M, ldp) columns [0, the span's
 * rows) times the rows, each dequantized once and added in order of the rows (run by run): the
 * same numbers as over one buffer holding them. */
static void kv_span_block_weighted(int T, int M, int d, const struct kv_run *runs, int n_runs, const float *p,
                                   size_t ldp, float *out) {
    size_t row = kv_row_bytes(T, d);
    float *v = malloc((size_t)d * sizeof(float));
    if (!v) abort();
    memset(out, 0, (size_t)M * d * sizeof(float));
    for (int r = 0, t = 0; r < n_runs; r++)
        for (int j = 0; j < runs[r].n; j++, t++) {
            kv_dequantize(T, (const uint8_t *)runs[r].rows + (size_t)j * row, v, d);
            kv_add_weighted_row(M, d, p, ldp, t, v, out);
        }
    free(v);
}

/* dst (the span's rows x d floats, in order) = the span's rows widened (float32: copied). */
static inline void kv_span_widen(int T, const struct kv_run *runs, int n_runs, int d, float *dst) {
    for (int r = 0; r < n_runs; dst += (size_t)runs[r++].n * d) kv_widen(T, runs[r].rows, dst, runs[r].n * d);
}

#endif
