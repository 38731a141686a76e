/* The float vectors the shim's kernels compute with (the few-row matrix kernel, the thread pool's
 * products, the decode runtime's element-wise and attention kernels): the vector width of the
 * instruction set compiled for, the few operations on whole vectors that GCC's vector extensions
 * lack, and a vectorized power of 2. Everything here is static inline: each source that includes
 * it inlines the helpers where it calls them. */
#ifndef MLXCEL_VECTOR_MATH_H
#define MLXCEL_VECTOR_MATH_H

#include <math.h>
#include <string.h>

/* Vector width and block shape per instruction set: the block's accumulators, weight rows and one
 * input vector must fit the register file (AVX-512: 32 registers; AVX2: 16; NEON: 32). */
#if defined(__AVX512F__)
#define VL 16
#define MB_MAX 4
#elif defined(__AVX2__) || defined(__AVX__)
#define VL 8
#define MB_MAX 2
#else
#define VL 4
#define MB_MAX 4
#endif
#define NB_MAX 4

typedef float vf __attribute__((vector_size(VL * sizeof(float)), aligned(sizeof(float))));

/* Keeps a loaded vector in a register for the loop that reuses it: GCC otherwise folds the load
 * into each use (a memory operand per multiply-add), reading it once per row. The constraint
 * names the vector registers of the target ("v": x86's xmm/ymm/zmm, "w": AArch64's). */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

static inline vf loadv(const float *p) { return *(const vf *)p; }

/* a in every lane. Written as a scalar minus a vector of zeros (GCC and Clang broadcast the
 * scalar: one instruction; x - 0 is x for every x, signed zeros included); a loop over the lanes
 * compiled (GCC 12, AVX-512) to one masked broadcast per lane, which made every kernel that
 * broadcasts in its inner loop (rows_nn: probabilities @ values) ~3x slower. */
static inline vf splat(float a) { return a - (vf){0}; }

/* Sum of the lanes by halving: one fixed order (lane i plus lane i + w, w = VL / 2, ..., 1).
 * Where the compiler has vector shuffles it is written with them: the same additions in the same
 * order, so the same bits. The loop over an array that it was alone (still the fallback) compiled
 * (GCC 12, AVX-512) to scalar adds through the stack, each waiting on the store before it: 40 % of
 * the decode attention's scores over 16-bit keys (kv_rows.h), 2026-12-07. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector) && (VL == 16 || VL == 8)
#define HAVE_SHUFFLE_HSUM 1
#endif
#endif
static inline float hsum(vf v) {
#ifdef HAVE_SHUFFLE_HSUM
    typedef float h8 __attribute__((vector_size(8 * sizeof(float))));
    typedef float h4 __attribute__((vector_size(4 * sizeof(float))));
    typedef float h2 __attribute__((vector_size(2 * sizeof(float))));
#if VL == 16
    h8 e = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    h8 e = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
#endif
    h4 f = __builtin_shufflevector(e, e, 0, 1, 2, 3) + __builtin_shufflevector(e, e, 4, 5, 6, 7);
    h2 g = __builtin_shufflevector(f, f, 0, 1) + __builtin_shufflevector(f, f, 2, 3);
    return g[0] + g[1];
#else
    float t[VL];
    memcpy(t, &v, sizeof t);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) t[i] += t[i + w];
    return t[0];
#endif
}

/* The sums of four vectors, each added in exactly hsum's order (so a block's results do not
 * depend on how many outputs it reduces together), with a quarter of the shuffles. */
#if VL == 16 && defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_HSUM4 1
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));
static inline void hsum4(vf a, vf b, vf c, vf d, float out[4]) {
    vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    v8 h = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
    v4 r = __builtin_shufflevector(h, h, 0, 2, 4, 6) + __builtin_shufflevector(h, h, 1, 3, 5, 7);
    memcpy(out, &r, sizeof r);
}
#endif
#endif

typedef int vi __attribute__((vector_size(VL * sizeof(int)), aligned(sizeof(int))));

/* a where mask, else b (GCC's C vector extensions have no vector ?:). */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* 2 ** x for x in [-126, 126] (clamped), within 1e-7 relative: 2 ** floor(x) from the exponent
 * bits times a degree-6 polynomial of the fraction (a least-squares fit of 2 ** f on [0, 1)). */
static inline vf exp2v(vf x) {
    x = vselect(x < splat(-126.0f), splat(-126.0f), x);
    x = vselect(x > splat(126.0f), splat(126.0f), x);
    vi t = __builtin_convertvector(x, vi); /* toward zero */
    vf tf = __builtin_convertvector(t, vf);
    t += (vi)(tf > x); /* -1 where truncation went up: floor */
    vf f = x - __builtin_convertvector(t, vf);
    vf p = splat(2.18712622881867e-4f);
    p = p * f + splat(1.238241558894515e-3f);
    p = p * f + splat(9.686185978353024e-3f);
    p = p * f + splat(5.5478911846876144e-2f);
    p = p * f + splat(2.4023109674453735e-1f);
    p = p * f + splat(6.93146824836731e-1f);
    p = p * f + splat(1.0f);
    return (vf)((vi)p + (t << 23));
}

static inline float exp2s(float x) {
    vf v = splat(x);
    return exp2v(v)[0];
}

/* The scalar functions the recurrent layers share (delta_net.c, mamba2.c). */
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* log(1 + e^x) as mx.logaddexp(x, 0) computes it: max(x, 0) + log1p(e^-|x|). */
static inline float softplus(float x) { return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x))); }

#endif
