/* LFM2's short-convolution layer in the decode pass (short_conv.c; runtime/decode_conv.py
 * describes it). */
#ifndef MLXCEL_SHORT_CONV_H
#define MLXCEL_SHORT_CONV_H

#include "decode_pass.h" /* struct mlxcel_linear, the products */

/* A short convolution as mlx-lm's lfm2 ShortConv computes it: B, C, x = in(h) in thirds,
 * y = C * conv(B * x), out(y). Its state per sequence is where the row's struct mlxcel_kv keys
 * point: the last kernel - 1 values of B * x ((kernel - 1) x hidden, oldest first), float32,
 * updated in place. */
struct mlxcel_short_conv {
    const struct mlxcel_linear *in;  /* hidden -> 3 hidden: B, C, x */
    const struct mlxcel_linear *out; /* hidden -> hidden */
    const float *conv;               /* (hidden, kernel): each channel's taps, oldest input first */
    int hidden, kernel;
};

/* x += the layer of h (rows x hidden): row r alone on states[r], or, given `segments`, chunk j
 * (rows segments[j] .. segments[j + 1] - 1, consecutive tokens of one sequence) on states[j], its
 * tokens in order. */
void mlxcel_short_conv_layer(const struct mlxcel_short_conv *S, int rows, const int *segments, int n_segments,
                             const float *h, float *x, float *const *states, int tiles, const double *scales,
                             int n_adapters);

#endif
