/* The Mamba-2 mixer of the Granite 4.0-H and Nemotron-H hybrids in the decode pass (runtime/decode_mamba.py
 * describes the layers).
 *
 * Why: in MLX's step a Mamba-2 layer is some twenty small operations a token (the split, the conv
 * over a concatenation, softplus and clip, the SSD step's products and exponentials, the gated
 * norm), each scheduled and evaluated on its own. Here one call a layer runs, for every row (or
 * every prompt chunk, its tokens in order): the in-projection (decode_pass.c's products, on the
 * file's blocks), the depthwise causal conv over the rolling conv state (+ bias, SiLU), dt =
 * clip(softplus(dt + dt_bias)), the SSM update and readout in one pass over each state row, the
 * D skip, the gated RMS norm and the out-projection added to the residual stream. The state stays
 * in the sequence's mlx-lm ArraysCache arrays (the conv state and the SSM state), updated in place.
 *
 * The math is mlx-lm's (ssm.py ssm_attn for one token, granitemoehybrid.py, nemotron_h.py): for
 * each head h of group g = h / (heads / groups), with A = -exp(A_log),
 *   dA = exp(dt A), y = (C_g . B_g) dt x + dA (S C_g) + D x,   S = dt x B_g^T + dA S,
 * y read against the state before its update, as mlx-lm's step computes it (the same terms in
 * the same order: its surrogate-attention term first, then the decayed readout of the old state);
 * then out = RMSNorm(silu(z) * y) over groups of norm_group channels, times the gain. The dot
 * products over d_state sum in another order than MLX's: the result agrees to float32 rounding
 * (tests/runtime/test_cpu_decode_mamba.py). A prompt chunk runs the same recurrence token by
 * token where MLX runs its chunked SSD form (the same sums, regrouped): the state agrees to float32
 * rounding too.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "mamba2.h"
#include "decode_kernels.h"
#include "thread_pool.h"
#include "vector_math.h"

/* Per-thread scratch (the engine thread runs the passes). */
static __thread struct mlxcel_scratch mamba_scratch[6];

static void *buffer(int i, size_t bytes) { return mlxcel_scratch(&mamba_scratch[i], bytes ? bytes : 1); }

static float dot(const float *a, const float *b, int n) {
    int vec = n - n % VL;
    vf acc = {0};
    for (int c = 0; c < vec; c += VL) acc += loadv(a + c) * loadv(b + c);
    float s = hsum(acc);
    for (int c = vec; c < n; c++) s += a[c] * b[c];
    return s;
}

/* The conv of one token, channel by channel: xbc[c] = silu(sum_j conv[c, j] in_j[c] + bias[c]) with
 * in_0 .. in_{kernel - 2} the state's rows (oldest first) and in_{kernel - 1} the token's
 * projection; then the state rolls by one row (the projection its newest). */
static void conv_token(const struct mlxcel_mamba *M, int conv_dim, float *state, float *xbc, float *out) {
    int kernel = M->kernel, keep = kernel - 1;
    for (int c = 0; c < conv_dim; c++) {
        const float *w = M->conv + (size_t)c * kernel;
        float s = 0.0f;
        for (int j = 0; j < keep; j++) s += w[j] * state[(size_t)j * conv_dim + c];
        s += w[keep] * xbc[c];
        out[c] = M->conv_bias ? s + M->conv_bias[c] : s;
    }
    if (keep > 0) {
        memmove(state, state + conv_dim, sizeof(float) * (size_t)(keep - 1) * conv_dim);
        memcpy(state + (size_t)(keep - 1) * conv_dim, xbc, sizeof(float) * (size_t)conv_dim);
    }
    for (int c = 0; c < conv_dim; c++) xbc[c] = out[c] * sigmoid(out[c]);
}

/* The recurrence of a pass: part p is head p % heads of unit p / heads (a row, or a prompt chunk
 * whose tokens it takes in order), on that unit's state. */
struct recurrence {
    const struct mlxcel_mamba *M;
    const int *first;     /* units + 1 row offsets */
    float *const *states; /* per unit */
    const float *proj;    /* (rows, width): z, then x B C after the conv, then dt (softplus-ed and clipped) */
    float *y;             /* (rows, heads * head_dim) */
    int width, inner;
};

static void recurrence_part(const void *ctx, int part) {
    const struct recurrence *R = ctx;
    const struct mlxcel_mamba *M = R->M;
    int heads = M->heads, unit = part / heads, h = part % heads, g = h / (heads / M->groups);
    int dh = M->head_dim, ds = M->d_state, inner = R->inner;
    float *S = R->states[unit] + (size_t)h * dh * ds;
    for (int r = R->first[unit]; r < R->first[unit + 1]; r++) {
        const float *row = R->proj + (size_t)r * R->width;
        const float *xs = row + inner + (size_t)h * dh;
        const float *B = row + 2 * (size_t)inner + (size_t)g * ds;
        const float *C = B + (size_t)M->groups * ds;
        float dt = row[inner + inner + 2 * (size_t)M->groups * ds + h];
        float dA = expf(dt * M->decay[h]), cb = dot(C, B, ds), skip = M->skip[h];
        float *y = R->y + (size_t)r * inner + (size_t)h * dh;
        for (int p = 0; p < dh; p++) {
            float *s = S + (size_t)p * ds;
            float dtx = dt * xs[p];
            float before = dot(s, C, ds);
            for (int n = 0; n < ds; n++) s[n] = dtx * B[n] + dA * s[n];
            float out = cb * dtx + dA * before;
            y[p] = out + xs[p] * skip;
        }
    }
}

void mlxcel_mamba_layer(const struct mlxcel_mamba *M, int rows, const int *segments, int n_segments, const float *h,
                        float *x, float *const *conv_states, float *const *states, int tiles, const double *scales,
                        int n_adapters, float residual_scale) {
    int heads = M->heads, inner = heads * M->head_dim, conv_dim = inner + 2 * M->groups * M->d_state;
    int width = inner + conv_dim + heads, units = segments ? n_segments : rows;
    float *proj = buffer(0, sizeof(float) * (size_t)rows * width);
    float *y = buffer(1, sizeof(float) * (size_t)rows * inner);
    float *conv_out = buffer(2, sizeof(float) * (size_t)conv_dim);
    int *first = buffer(3, sizeof(int) * (size_t)(units + 1));
    mlxcel_pass_product(&M->in, rows, h, proj, 0.0f, tiles, scales, n_adapters);
    for (int u = 0; u <= units; u++) first[u] = segments ? segments[u] : u;
    /* the conv, token by token in each unit's order (its state rolls), and dt */
    for (int u = 0; u < units; u++)
        for (int r = first[u]; r < first[u + 1]; r++) {
            float *row = proj + (size_t)r * width;
            conv_token(M, conv_dim, conv_states[u], row + inner, conv_out);
            float *dt = row + inner + conv_dim;
            for (int j = 0; j < heads; j++) {
                float d = softplus(dt[j] + M->dt_bias[j]);
                dt[j] = d < M->dt_min ? M->dt_min : d > M->dt_max ? M->dt_max : d;
            }
        }
    float **unit_states = buffer(5, sizeof(float *) * (size_t)units);
    units = mlxcel_state_units(units, first, states, unit_states);
    struct recurrence R = {M, first, unit_states, proj, y, width, inner};
    mlxcel_parallel(units * heads, recurrence_part, &R);
    /* the gated norm: RMSNorm(silu(z) * y) over each group of norm_group channels, times the gain */
    int group = M->norm_group;
    for (int r = 0; r < rows; r++) {
        float *yr = y + (size_t)r * inner;
        const float *z = proj + (size_t)r * width;
        for (int c = 0; c < inner; c++) yr[c] = z[c] * sigmoid(z[c]) * yr[c];
        for (int g0 = 0; g0 < inner; g0 += group) {
            float s = mlxcel_rms_scale(yr + g0, group, M->eps);
            for (int c = g0; c < g0 + group; c++) yr[c] = M->norm[c] * (yr[c] * s);
        }
    }
    if (residual_scale == 0.0f) {
        mlxcel_pass_product(&M->out, rows, y, x, 1.0f, tiles, scales, n_adapters);
        return;
    }
    int hidden = M->out.n;
    float *branch = buffer(4, sizeof(float) * (size_t)rows * hidden);
    mlxcel_pass_product(&M->out, rows, y, branch, 0.0f, tiles, scales, n_adapters);
    for (size_t j = 0; j < (size_t)rows * hidden; j++) x[j] += branch[j] * residual_scale;
}

void mlxcel_relu2(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float r = x[i] > 0.0f ? x[i] : 0.0f;
        x[i] = r * r;
    }
}
