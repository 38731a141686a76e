/* The gated delta-net mixer of the Qwen3.5 / Qwen3-Next hybrids in the decode pass, and what the
 * hybrids' attention layers add to the plain one (runtime/decode_delta.py describes the layers).
 *
 * Why: in MLX's step a delta-net layer is a dozen small operations a token over its 1 MiB state
 * (mlx-lm's gated_delta_ops on the CPU), and a prompt is a Python loop over its tokens; on a
 * Qwen3.5-0.8B-shaped file those layers took 12 of a 19.7 ms step. Here one call a layer runs,
 * for every row (or every prompt chunk, its tokens in order): the in-projections (decode_pass.c's
 * products on the blocks), the depthwise causal conv over the rolling conv state, SiLU, the q/k L2
 * norms, the gates, the delta rule's update and readout in one pass over each state row, the
 * gated RMS norm and the out-projection added to the residual stream. The state stays in the
 * sequence's mlx-lm ArraysCache arrays (the conv state and the delta state), updated in place.
 *
 * The math is mlx-lm's (qwen3_5.py GatedDeltaNet, gated_delta.py): for each value head h with its
 * key head h / (v_heads / k_heads),
 *   g = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b),
 *   S = g S; delta = (v - S k) beta; S = S + delta k^T; y = S q,
 * q and k L2-normed (eps 1e-6 on the sum of squares), q also scaled by 1 / k_dim, then
 * out = silu(z) * RMSNorm(y) per head. Sums run in another order than MLX's: the result agrees
 * to float32 rounding (tests/runtime/test_cpu_decode_hybrid.py).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "delta_net.h"
#include "decode_kernels.h"
#include "thread_pool.h"
#include "vector_math.h"

/* Per-thread scratch (the engine thread runs the passes). */
static __thread struct mlxcel_scratch delta_scratch[11]; /* 6 .. 9: in_projections' parts; 10: the units' states */

static void *buffer(int i, size_t bytes) { return mlxcel_scratch(&delta_scratch[i], bytes ? bytes : 1); }

/* The conv of one token, channel by channel: out = silu(sum_j conv[c, j] in_j[c]) with in_0 ..
 * in_{kernel - 2} the state's rows (oldest first) and in_{kernel - 1} the token's projection `in`;
 * then the state rolls by one row (the token's projection its newest). `in` becomes the output. */
static void conv_token(const struct mlxcel_delta *D, int conv_dim, float *state, float *in, float *out) {
    int kernel = D->kernel, keep = kernel - 1;
    for (int c = 0; c < conv_dim; c++) {
        const float *w = D->conv + (size_t)c * kernel;
        float s = 0.0f;
        for (int j = 0; j < keep; j++) s += w[j] * state[(size_t)j * conv_dim + c];
        s += w[keep] * in[c];
        out[c] = s;
    }
    if (keep > 0) {
        memmove(state, state + conv_dim, sizeof(float) * (size_t)(keep - 1) * conv_dim);
        memcpy(state + (size_t)(keep - 1) * conv_dim, in, sizeof(float) * (size_t)conv_dim);
    }
    for (int c = 0; c < conv_dim; c++) in[c] = out[c] * sigmoid(out[c]);
}

/* One value head's delta rule for one token: S (v_dim x k_dim) decays by g, each row's memory
 * S_i . k is replaced toward v_i by beta, then read out against q. One pass over each state row
 * (k and q in registers for k_dim up to a few vectors). */
static void delta_head(float *S, int dv, int dk, const float *q, const float *k, const float *v, float g, float beta,
                       float *y) {
    int vec = dk - dk % VL;
    for (int i = 0; i < dv; i++) {
        float *s = S + (size_t)i * dk;
        vf acc = {0};
        float mem = 0.0f;
        for (int c = 0; c < vec; c += VL) {
            vf sv = loadv(s + c) * splat(g);
            memcpy(s + c, &sv, sizeof sv);
            acc += sv * loadv(k + c);
        }
        mem = hsum(acc);
        for (int c = vec; c < dk; c++) {
            s[c] *= g;
            mem += s[c] * k[c];
        }
        float delta = (v[i] - mem) * beta;
        vf out = {0};
        for (int c = 0; c < vec; c += VL) {
            vf sv = loadv(s + c) + loadv(k + c) * splat(delta);
            memcpy(s + c, &sv, sizeof sv);
            out += sv * loadv(q + c);
        }
        float o = hsum(out);
        for (int c = vec; c < dk; c++) {
            s[c] += k[c] * delta;
            o += s[c] * q[c];
        }
        y[i] = o;
    }
}

/* The in-projections of `rows` rows into the layout's four parts `dst` (widths `width`): directly
 * (qwen3_5), or each projection into its own buffer, then every layout column gathered from the
 * projection and column in_order names (qwen3_next). */
static void in_projections(const struct mlxcel_delta *D, int rows, const float *h, float *const dst[4],
                           const int width[4], int tiles, const double *scales, int n_adapters) {
    if (!D->in_order) {
        mlxcel_pass_products(2, D->in, rows, h, dst, tiles, scales, n_adapters);
        mlxcel_pass_products(2, D->in + 2, rows, h, dst + 2, tiles, scales, n_adapters);
        return;
    }
    float *parts[4];
    for (int j = 0; j < D->n_in; j++) parts[j] = buffer(6 + j, sizeof(float) * (size_t)rows * D->in_width[j]);
    mlxcel_pass_products(D->n_in, D->in, rows, h, parts, tiles, scales, n_adapters);
    int total = width[0] + width[1] + width[2] + width[3];
    const int32_t *part = D->in_order, *column = D->in_order + total;
    for (int k = 0, d0 = 0; k < 4; d0 += width[k], k++)
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < width[k]; c++) {
                int d = d0 + c, j = part[d];
                dst[k][(size_t)r * width[k] + c] = parts[j][(size_t)r * D->in_width[j] + column[d]];
            }
}

/* The recurrence of a pass: part p is value head p % v_heads of unit p / v_heads (a row, or a
 * prompt chunk whose tokens it takes in order), on that unit's state. */
struct recurrence {
    const struct mlxcel_delta *D;
    const int *first;       /* units + 1 row offsets */
    float *const *states;   /* per unit */
    const float *mixed;     /* (rows, conv_dim): q, k, v after the conv, q and k normed */
    const float *g, *beta;  /* (rows, v_heads) */
    float *y;               /* (rows, v_heads * v_dim) */
    int conv_dim, key_dim;
};

static void recurrence_part(const void *ctx, int part) {
    const struct recurrence *R = ctx;
    const struct mlxcel_delta *D = R->D;
    int hv = D->v_heads, unit = part / hv, h = part % hv, hk = h / (hv / D->k_heads);
    int dk = D->k_dim, dv = D->v_dim;
    float *S = R->states[unit] + (size_t)h * dv * dk;
    for (int r = R->first[unit]; r < R->first[unit + 1]; r++) {
        const float *row = R->mixed + (size_t)r * R->conv_dim;
        const float *q = row + (size_t)hk * dk, *k = row + R->key_dim + (size_t)hk * dk;
        const float *v = row + 2 * (size_t)R->key_dim + (size_t)h * dv;
        delta_head(S, dv, dk, q, k, v, R->g[(size_t)r * hv + h], R->beta[(size_t)r * hv + h],
                   R->y + ((size_t)r * hv + h) * dv);
    }
}

void mlxcel_delta_layer(const struct mlxcel_delta *D, int hidden, int rows, const int *segments, int n_segments,
                        const float *h, float *x, float *const *conv_states, float *const *states, int tiles,
                        const double *scales, int n_adapters) {
    (void)hidden;
    int hk = D->k_heads, hv = D->v_heads, dk = D->k_dim, dv = D->v_dim;
    int key_dim = hk * dk, value_dim = hv * dv, conv_dim = 2 * key_dim + value_dim;
    int units = segments ? n_segments : rows;
    float *mixed = buffer(0, sizeof(float) * (size_t)rows * conv_dim);
    float *z = buffer(1, sizeof(float) * (size_t)rows * value_dim);
    float *gb = buffer(2, sizeof(float) * (size_t)rows * 2 * hv); /* b, then a; then beta, g */
    float *y = buffer(3, sizeof(float) * (size_t)rows * value_dim);
    float *conv_out = buffer(4, sizeof(float) * (size_t)conv_dim);
    int *first = buffer(5, sizeof(int) * (size_t)(units + 1));
    float *b = gb, *a = gb + (size_t)rows * hv;
    in_projections(D, rows, h, (float *[4]){mixed, z, b, a}, (int[4]){conv_dim, value_dim, hv, hv}, tiles, scales,
                   n_adapters);
    for (int u = 0; u <= units; u++) first[u] = segments ? segments[u] : u;
    /* the conv, token by token in each unit's order (its state rolls), then the norms and gates */
    float inv_scale = 1.0f / sqrtf((float)dk), l2_eps = 1e-6f * inv_scale * inv_scale;
    for (int u = 0; u < units; u++)
        for (int r = first[u]; r < first[u + 1]; r++) {
            float *row = mixed + (size_t)r * conv_dim;
            conv_token(D, conv_dim, conv_states[u], row, conv_out);
            for (int j = 0; j < hk; j++) {
                float *q = row + (size_t)j * dk, *k = row + key_dim + (size_t)j * dk;
                float sq = mlxcel_rms_scale(q, dk, l2_eps), sk = mlxcel_rms_scale(k, dk, l2_eps);
                for (int c = 0; c < dk; c++) {
                    q[c] = inv_scale * inv_scale * (q[c] * sq);
                    k[c] = inv_scale * (k[c] * sk);
                }
            }
        }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < hv; j++) {
            size_t i = (size_t)r * hv + j;
            float g = expf(D->decay[j] * softplus(a[i] + D->dt_bias[j]));
            b[i] = sigmoid(b[i]);
            a[i] = g;
        }
    float **unit_states = buffer(10, sizeof(float *) * (size_t)units);
    units = mlxcel_state_units(units, first, states, unit_states);
    struct recurrence R = {D, first, unit_states, mixed, a, b, y, conv_dim, key_dim};
    mlxcel_parallel(units * hv, recurrence_part, &R);
    /* the gated norm: out = silu(z) * RMSNorm(y) per value head, into y */
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < hv; j++) {
            float *yh = y + ((size_t)r * hv + j) * dv;
            const float *zh = z + ((size_t)r * hv + j) * dv;
            float s = mlxcel_rms_scale(yh, dv, D->eps);
            for (int c = 0; c < dv; c++) {
                float normed = yh[c] * s * D->norm[c];
                yh[c] = zh[c] * sigmoid(zh[c]) * normed;
            }
        }
    if (D->out_order) { /* the out-projection's columns in the file's order: gather into z */
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < value_dim; c++)
                z[(size_t)r * value_dim + c] = y[(size_t)r * value_dim + D->out_order[c]];
        y = z;
    }
    mlxcel_pass_product(D->out, rows, y, x, 1.0f, tiles, scales, n_adapters);
}


void mlxcel_split_gated_q(const float *qg, float *q, float *gate, int rows, int heads, int d) {
    for (int r = 0; r < rows * heads; r++) {
        memcpy(q + (size_t)r * d, qg + (size_t)r * 2 * d, sizeof(float) * (size_t)d);
        memcpy(gate + (size_t)r * d, qg + (size_t)r * 2 * d + d, sizeof(float) * (size_t)d);
    }
}

void mlxcel_sigmoid_gate(float *att, const float *gate, int n) {
    for (int i = 0; i < n; i++) att[i] *= sigmoid(gate[i]);
}
