/* The Mamba-2 mixer of the Granite 4.0-H and Nemotron-H hybrids in the decode pass (mamba2.c;
 * runtime/decode_mamba.py describes it). */
#ifndef MLXCEL_MAMBA2_H
#define MLXCEL_MAMBA2_H

#include "decode_pass.h" /* struct mlxcel_linear, the products */

/* A Mamba-2 mixer as mlx-lm's GraniteMoeHybridMamba2Mixer and NemotronHMamba2Mixer compute it.
 * Its state per sequence is where the row's struct mlxcel_kv points: keys = the conv state
 * ((kernel - 1) x conv_dim, the last in-projections of x, B and C), values = the SSM state
 * (heads x head_dim x d_state), both float32 and updated in place. The in-projection gives, per
 * row, [z (heads * head_dim) | x B C (conv_dim) | dt (heads)], conv_dim = heads * head_dim +
 * 2 * groups * d_state. */
struct mlxcel_mamba {
    struct mlxcel_linear in, out; /* hidden -> the layout above; heads * head_dim -> hidden */
    const float *conv;            /* (conv_dim, kernel): the depthwise causal conv's taps, oldest first */
    const float *conv_bias;       /* (conv_dim), or NULL */
    const float *decay;           /* (heads): A = -exp(A_log), as MLX computes it */
    const float *dt_bias;         /* (heads) */
    const float *skip;            /* (heads): D */
    const float *norm;            /* (heads * head_dim): the gated RMS norm's gain */
    float eps, dt_min, dt_max;    /* the norm's epsilon; dt clipped to [dt_min, dt_max] (time_step_limit) */
    int heads, head_dim, d_state, groups, kernel;
    int norm_group;               /* the gated norm's group width (Granite: heads * head_dim; Nemotron-H: / groups) */
};

/* x += residual_scale * (the mixer of h) (rows x hidden; residual_scale 0: x += it): row r alone on
 * conv_states[r] and states[r], or, given `segments`, chunk j (rows segments[j] ..
 * segments[j + 1] - 1, consecutive tokens of one sequence) on conv_states[j] and states[j], its
 * tokens in order. */
void mlxcel_mamba_layer(const struct mlxcel_mamba *M, int rows, const int *segments, int n_segments, const float *h,
                        float *x, float *const *conv_states, float *const *states, int tiles, const double *scales,
                        int n_adapters, float residual_scale);

/* x = max(x, 0)^2, n values (Nemotron-H's MLP: mlx-lm's nn.relu2). */
void mlxcel_relu2(float *x, int n);

#endif
