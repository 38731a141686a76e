/* The Qwen3.5 / Qwen3-Next hybrid's layers in the decode pass (delta_net.c): the gated delta-net
 * mixer, and what its attention layers add to the plain one (an output gate, partial RoPE). */
#ifndef MLXCEL_DELTA_NET_H
#define MLXCEL_DELTA_NET_H

#include <stdint.h>

#include "decode_pass.h" /* struct mlxcel_linear, the products */

/* A gated delta-net mixer (runtime/decode_delta.py describes it), as mlx-lm's qwen3_5 and
 * qwen3_next GatedDeltaNets compute it. Its state per sequence is where the row's struct
 * mlxcel_kv points: keys = the conv state ((kernel - 1) x conv_dim, the last inputs), values =
 * the delta rule's state (v_heads x v_dim x k_dim), both float32 and updated in place.
 * The in-projections give, per row, the layout [q | k | v | z | b | a] (q and k: k_heads x k_dim,
 * v and z: v_heads x v_dim, b and a: v_heads): qwen3_5's four (in_proj_qkv, z, b, a) are that
 * layout as they are (in_order NULL); qwen3_next's fused ones (its qkvz stored as parts, its ba)
 * interleave it per key head, and in_order says where each column of the layout comes from. */
struct mlxcel_delta {
    const struct mlxcel_linear *in[4]; /* the in-projections (n_in of them) */
    const struct mlxcel_linear *out;   /* the out-projection */
    const int32_t *in_order;  /* (2, layout width): the input and its column of each layout column, or NULL */
    int n_in, in_width[4];    /* the in-projections' output widths */
    const float *conv;        /* (conv_dim, kernel): the depthwise causal conv's taps, oldest first */
    const float *decay;       /* (v_heads): -exp(A_log) */
    const float *dt_bias;     /* (v_heads) */
    const float *norm;        /* (v_dim): the gated RMS norm's gain */
    const int32_t *out_order; /* (v_heads * v_dim): the out-projection's input j is o[out_order[j]], or NULL */
    float eps;                /* the gated norm's */
    int k_heads, v_heads, k_dim, v_dim, kernel;
};

/* x += the mixer of h (rows x hidden): row r alone on conv_states[r] and states[r], or, given
 * `segments`, chunk j (rows segments[j] .. segments[j + 1] - 1, consecutive tokens of one
 * sequence) on conv_states[j] and states[j], its tokens in order. */
void mlxcel_delta_layer(const struct mlxcel_delta *D, int hidden, int rows, const int *segments, int n_segments,
                        const float *h, float *x, float *const *conv_states, float *const *states, int tiles,
                        const double *scales, int n_adapters);

/* qwen3_next's query projection: per head d queries then d gates; q and gate get them apart. */
void mlxcel_split_gated_q(const float *qg, float *q, float *gate, int rows, int heads, int d);

/* att *= sigmoid(gate), n values. */
void mlxcel_sigmoid_gate(float *att, const float *gate, int n);

#endif
