/* The element-wise kernels of a decode step: RMS norms (Gemma's on a residual branch too), RoPE
 * and SiLU or GELU-tanh gating.
 *
 * The element-wise parts and the attention (attention.c) of a decode step, for the CPU decode
 * runtime (mlxcel_compat/runtime/cpu_decode.py, through decode_pass.c's layer loop), between the
 * matrix-vector products of the interposed cblas_sgemm (blas_shim.c). Each is one call per layer
 * where MLX runs a chain of small operations, and each uses vectors where MLX's CPU loops are
 * scalar (its exponential).
 */
#include <math.h>
#include <stddef.h>
#include <string.h>

#include "decode_kernels.h"
#include "vector_math.h"

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :] ** 2) + eps) * w for `rows` rows of n (RMSNorm; per head
 * for a model's query and key norms). out may be x. */
float mlxcel_rms_scale(const float *x, int n, float eps) {
    /* MLX's own rounding, bit for bit (mx.fast.rms_norm on the CPU: mean(square(x)), then 1 /
     * sqrt): each square rounded to float32, the squares added one after another from 0, the
     * sum times 1 / n. The next products quantize these rows to 8 bits (ggml's Q8_0 for the
     * split and Q8_0 GEMMs, every vec_dot), and on a coarse grid (a 4- or 5-bit embedding under
     * a norm of ones) a value sits on a rounding tie: an ulp off MLX's norm there moved a
     * prompt chunk's keys and values by 0.4 % (test_rms_norm_is_mlx_s_bit_for_bit). The squares
     * stay vectors; KEEP_IN_REGISTER keeps the compiler from fusing them into the sum. The
     * serial sum costs ~4 cycles a value (5 us on a 4096-wide row). */
    float ss = 0.0f;
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf squares = loadv(x + i) * loadv(x + i);
        KEEP_IN_REGISTER(squares);
        for (int l = 0; l < VL; l++) ss += squares[l];
    }
    for (; i < n; i++) {
        float square = x[i] * x[i];
        KEEP_IN_REGISTER(square);
        ss += square;
    }
    return 1.0f / __builtin_sqrtf(ss * (1.0f / (float)n) + eps);
}

void mlxcel_rms_norm(const float *x, const float *w, float *out, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++, x += n, out += n) {
        float scale = mlxcel_rms_scale(x, n, eps);
        for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
    }
}

/* out[r, :] = (x[r, :] - mean) / sqrt(var + eps) * w (+ bias) for `rows` rows of n: LayerNorm
 * (starcoder2's, with a bias; cohere2's without). Within float32 rounding of mx.fast.layer_norm:
 * the mean and the variance (of x - mean) summed in double. out may be x. */
void mlxcel_layer_norm(const float *x, const float *w, const float *bias, float *out, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++, x += n, out += n) {
        double sum = 0.0, sq = 0.0;
        for (int i = 0; i < n; i++) sum += x[i];
        float mean = (float)(sum / n);
        for (int i = 0; i < n; i++) sq += (double)(x[i] - mean) * (x[i] - mean);
        float scale = 1.0f / sqrtf((float)(sq / n) + eps);
        for (int i = 0; i < n; i++) out[i] = (x[i] - mean) * scale * w[i] + (bias ? bias[i] : 0.0f);
    }
}

/* x = gelu(x) in place, the exact form x (1 + erf(x / sqrt 2)) / 2 (mlx's nn.gelu: starcoder2's MLP). */
void mlxcel_gelu_erf(float *x, int n) {
    for (int i = 0; i < n; i++) x[i] = x[i] * (1.0f + erff(x[i] * 0.70710678118654752f)) / 2.0f;
}

/* x = xIELU(x) in place (Apertus's MLP; mlx-lm's xielu with its softplus-ed parameters given):
 * x > 0: alpha_p x^2 + beta x, else (expm1(min(x, eps)) - x) alpha_n + beta x. */
void mlxcel_xielu(float *x, int n, float alpha_p, float alpha_n, float beta, float eps) {
    for (int i = 0; i < n; i++) {
        float v = x[i];
        x[i] = v > 0.0f ? alpha_p * (v * v) + beta * v : (expm1f(v < eps ? v : eps) - v) * alpha_n + beta * v;
    }
}

/* x[r, :] += RMSNorm(b[r, :]) * w for `rows` rows of n: Gemma's norm of a branch's output (the
 * attention's, the MLP's) before it joins the residual stream, in one pass instead of a norm into
 * a buffer and a sum. */
void mlxcel_rms_norm_add(const float *b, const float *w, float *x, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++, b += n, x += n) {
        float scale = mlxcel_rms_scale(b, n, eps);
        for (int i = 0; i < n; i++) x[i] += b[i] * scale * w[i];
    }
}

/* RoPE of `heads` rows of d in place, with the angles' cosines and sines (d / 2 each) of one
 * position: rotating halves (x[i], x[i + d/2]), or neighbours (x[2i], x[2i + 1]) if
 * `traditional`, as mx.fast.rope computes them. */
void mlxcel_rope(float *x, int heads, int d, const float *cos, const float *sin, int traditional) {
    mlxcel_rope_part(x, heads, d, d, cos, sin, traditional);
}

/* RoPE of the first `dims` of each of `heads` heads of d (a partial rotary embedding, the hybrids',
 * phi3's, glm4's: the rest pass unchanged), angles dims / 2 each, as mx.fast.rope with dims <= d. */
void mlxcel_rope_part(float *x, int heads, int d, int dims, const float *cos, const float *sin, int traditional) {
    int half = dims / 2;
    for (int h = 0; h < heads; h++, x += d)
        for (int i = 0; i < half; i++) {
            int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : i + half;
            float x1 = x[a], x2 = x[b];
            x[a] = x1 * cos[i] - x2 * sin[i];
            x[b] = x1 * sin[i] + x2 * cos[i];
        }
}

/* RoPE of `rows` rows of `heads` heads of d (rows contiguous), row r with the angles at cos and sin
 * + r * d / 2 (consecutive positions). */
void mlxcel_rope_rows(float *x, int rows, int heads, int d, const float *cos, const float *sin, int traditional) {
    for (int r = 0; r < rows; r++)
        mlxcel_rope(x + (size_t)r * heads * d, heads, d, cos + (size_t)r * (d / 2), sin + (size_t)r * (d / 2),
                    traditional);
}

/* gate = silu(gate) * up = gate * up / (1 + 2 ** (-gate log2 e)), in place: the same formula as
 * the MLX lever (runtime/cpu_fusion.py). */
void mlxcel_swiglu(float *gate, const float *up, int n) {
    const float m = -1.4426950408889634f;
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf g = loadv(gate + i);
        vf r = g * loadv(up + i) / (splat(1.0f) + exp2v(g * splat(m)));
        memcpy(gate + i, &r, sizeof r);
    }
    for (; i < n; i++) gate[i] = gate[i] * up[i] / (1.0f + exp2s(gate[i] * m));
}

/* gate = gelu_tanh(gate) * up in place, gelu_tanh(x) = 0.5 x (1 + tanh(u)) with
 * u = sqrt(2 / pi) (x + 0.044715 x^3) (mlx's nn.gelu_approx, Gemma's "gelu_pytorch_tanh"),
 * computed as x / (1 + e^(-2u)), the same value (0.5 (1 + tanh u) = 1 / (1 + e^(-2u))), with the
 * power of 2 of the gating kernel above: no tanh, and no cancellation in 1 + tanh(u) where tanh is
 * near -1 (mlx's form rounds there to a multiple of 2^-24, which this one does not). */
void mlxcel_gelu_tanh_gate(float *gate, const float *up, int n) {
    const float c = 0.7978845608028654f * -2.0f * 1.4426950408889634f; /* -2 sqrt(2 / pi) log2 e */
    const float cubic = 0.044715f;
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf x = loadv(gate + i);
        vf r = x * loadv(up + i) / (splat(1.0f) + exp2v((x + splat(cubic) * x * x * x) * splat(c)));
        memcpy(gate + i, &r, sizeof r);
    }
    for (; i < n; i++) {
        float x = gate[i];
        gate[i] = x * up[i] / (1.0f + exp2s((x + cubic * x * x * x) * c));
    }
}

/* gpt-oss's clamped SwiGLU (mlx-lm's swiglu_oai), gate = (clip(up, -limit, limit) + 1) *
 * g sigmoid(alpha g) with g = min(gate, limit), in place; the sigmoid by the power of 2 of
 * mlxcel_swiglu. */
void mlxcel_swiglu_oai(float *gate, const float *up, int n, float alpha, float limit) {
    const float m = -1.4426950408889634f * alpha;
    int i = 0;
    for (; i + VL <= n; i += VL) {
        vf g = loadv(gate + i), u = loadv(up + i);
        g = vselect(g > splat(limit), splat(limit), g);
        u = vselect(u > splat(limit), splat(limit), vselect(u < splat(-limit), splat(-limit), u));
        vf r = (u + splat(1.0f)) * (g / (splat(1.0f) + exp2v(g * splat(m))));
        memcpy(gate + i, &r, sizeof r);
    }
    for (; i < n; i++) {
        float g = gate[i] > limit ? limit : gate[i];
        float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        gate[i] = (u + 1.0f) * (g / (1.0f + exp2s(g * m)));
    }
}
