/* LFM2's short-convolution layer in the decode pass (runtime/decode_conv.py describes it).
 *
 * Why: in MLX's step the layer is a handful of small operations (the split, B * x, the state's
 * concatenation, a depthwise convolution, C * its output), each evaluated between the products;
 * here one call runs, for every row (or every prompt chunk, its tokens in order): the
 * in-projection (decode_pass.c's products on the blocks), B * x, the causal depthwise convolution
 * over the rolling state, C * its output, and the out-projection added to the residual stream.
 * The state stays in the sequence's mlx-lm ArraysCache array, updated in place.
 *
 * The math is mlx-lm's (lfm2.py ShortConv): for channel c, with in_0 .. in_{kernel - 2} the
 * state's rows (oldest first) and in_{kernel - 1} = B[c] x[c] the token's,
 *   y[c] = C[c] sum_j conv[c, j] in_j[c],
 * then the state keeps the newest kernel - 1 inputs. The convolution's sum runs in tap order;
 * MLX's may round differently: the result agrees to float32 rounding
 * (tests/runtime/test_cpu_decode_lfm2.py).
 */
#include <stddef.h>
#include <string.h>

#include "short_conv.h"
#include "thread_pool.h"

/* Per-thread scratch (the engine thread runs the passes): the in-projection's rows, y. */
static __thread struct mlxcel_scratch conv_scratch[2];

/* One token: y = C * conv(state, B * x), then the state rolls by one row (B * x its newest). */
static void conv_token(const struct mlxcel_short_conv *S, float *state, const float *bcx, float *y) {
    int hidden = S->hidden, kernel = S->kernel, keep = kernel - 1;
    const float *b = bcx, *c = bcx + hidden, *x = bcx + 2 * (size_t)hidden;
    for (int ch = 0; ch < hidden; ch++) {
        const float *w = S->conv + (size_t)ch * kernel;
        float bx = b[ch] * x[ch], s = 0.0f;
        for (int j = 0; j < keep; j++) s += w[j] * state[(size_t)j * hidden + ch];
        s += w[keep] * bx;
        y[ch] = c[ch] * s;
        for (int j = 0; j + 1 < keep; j++) state[(size_t)j * hidden + ch] = state[(size_t)(j + 1) * hidden + ch];
        state[(size_t)(keep - 1) * hidden + ch] = bx;
    }
}

void mlxcel_short_conv_layer(const struct mlxcel_short_conv *S, int rows, const int *segments, int n_segments,
                             const float *h, float *x, float *const *states, int tiles, const double *scales,
                             int n_adapters) {
    int hidden = S->hidden, units = segments ? n_segments : rows;
    float *bcx = mlxcel_scratch(&conv_scratch[0], sizeof(float) * (size_t)rows * 3 * hidden);
    float *y = mlxcel_scratch(&conv_scratch[1], sizeof(float) * (size_t)rows * hidden);
    mlxcel_pass_product(S->in, rows, h, bcx, 0.0f, tiles, scales, n_adapters);
    for (int u = 0; u < units; u++) {
        int first = segments ? segments[u] : u, last = segments ? segments[u + 1] : u + 1;
        for (int r = first; r < last; r++)
            conv_token(S, states[u], bcx + (size_t)r * 3 * hidden, y + (size_t)r * hidden);
    }
    mlxcel_pass_product(S->out, rows, y, x, 1.0f, tiles, scales, n_adapters);
}
