/* The softmax of the CPU decode runtime's attention rows (attention.c's decode steps,
 * chunk_attention.c's prompt chunks): a vectorized power of 2 (vector_math.h), where MLX's CPU
 * exponential is scalar, with gpt-oss's sinks, and Gemma 2's logit soft-capping. Static: each
 * includer compiles its own copy. */
#ifndef MLXCEL_SOFTMAX_ROWS_H
#define MLXCEL_SOFTMAX_ROWS_H

#include <math.h>
#include <string.h>

#include "vector_math.h"

/* Weights below 2 ** NEGLIGIBLE of the largest (which is 1) are set to zero: the sum is at least
 * 1, so they are far below float32's resolution of it, and multiplying the values by them could
 * produce denormal numbers, which x86 cores handle in microcode, many times slower. (Not seen on
 * the generated models, whose random weights give flat attention; trained models' is peaky.) */
#define NEGLIGIBLE -64.0f

/* s[t] = 2 ** (s[t] - max s) for t < n, in place (weights below 2 ** NEGLIGIBLE set to zero);
 * returns their sum. The caller normalises (the weights, or the output they give). `sink`:
 * NULL, or one more logit (gpt-oss's learned per-head sink, times log2 e) that takes part in the
 * maximum and the sum but has no value: the weights then sum to less than 1. */
static float exp2_shifted_row_sink(float *s, int n, const float *sink) {
    float top = sink && *sink > s[0] ? *sink : s[0];
    int t0 = 0;
    if (n >= VL) { /* the maximum a vector at a time (the scalar loop was a fifth of a chunk's attention) */
        vf m = loadv(s);
        for (t0 = VL; t0 + VL <= n; t0 += VL) {
            vf v = loadv(s + t0);
            m = vselect(v > m, v, m);
        }
        float lanes[VL];
        memcpy(lanes, &m, sizeof m);
        for (int l = 0; l < VL; l++) top = lanes[l] > top ? lanes[l] : top;
    }
    for (int t = t0; t < n; t++) top = s[t] > top ? s[t] : top;
    vf acc = {0};
    int t = 0;
    for (; t + VL <= n; t += VL) {
        vf x = loadv(s + t) - splat(top);
        vf e = vselect(x < splat(NEGLIGIBLE), splat(0.0f), exp2v(x));
        memcpy(s + t, &e, sizeof e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; t < n; t++) sum += s[t] = s[t] - top < NEGLIGIBLE ? 0.0f : exp2s(s[t] - top);
    if (sink) sum += *sink - top < NEGLIGIBLE ? 0.0f : exp2s(*sink - top);
    return sum;
}

/* Gemma 2's attention logit soft-capping, as mlx-lm's gemma2.py computes it: s[t] = tanh(s[t] / cap)
 * * cap for t < n, then times log2 e for the powers of 2 (the kernels given a cap form the scores
 * with the plain softmax scale, so the cap sees the score mlx-lm's does). cap 0: nothing (every
 * other family: the scale already holds log2 e). */
static void soft_cap_row(float *s, int n, float cap) {
    if (cap == 0.0f) return;
    for (int t = 0; t < n; t++) s[t] = tanhf(s[t] / cap) * cap * 1.4426950408889634f;
}

#endif
