/* Gemma 4's decode steps on the CPU decode runtime (mlxcel_compat/runtime/decode_gemma4.py), one call a pass.
 *
 * Why its own loop beside decode_pass.c's: a Gemma 4 layer differs from the other families' in
 * more than a switch each. Its sliding and full layers have their own head sizes (and, in the
 * 26B-style files, their own KV head counts), the last num_kv_shared_layers layers read an earlier
 * layer's KV and write none, values get a norm without a gain, and the per-layer embeddings (PLE)
 * add a gated branch after the MLP whose inputs are computed per token beside the main embedding;
 * every layer ends scaled by its layer_scalar. The kernels are decode_pass.c's (products, norms,
 * RoPE, the decode attention), called in mlx-lm's order (models/gemma4_text.py), so each row's
 * arithmetic is what MLX's step does to float32 rounding, and a row's is the same whatever rows
 * share the pass.
 *
 * KV sharing: a KV-sharing layer's queries attend over its source layer's cache (the same struct
 * mlxcel_kv, filled by Python) with the source's new key and value rows, kept from earlier in the
 * pass: the attention kernel writes them into the cache again at the same slot (the same bytes:
 * the same input rounded the same way) before it reads, so the source's cache is left as the
 * source left it and the sharing layer sees exactly what mlx-lm hands it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "decode_kernels.h"
#include "decode_pass.h"

/* decode_pass.c's struct mlxcel_kv, as Python's table lays it out (decode_pass.KV_FIELDS, sequence_kv.py):
 * the fields this pass reads are the first seven. */
struct gemma4_kv {
    void *keys, *values, *k_out, *v_out;
    int64_t capacity, write, n, window;
    const void *const *blocks;
    int64_t n_blocked, block_tokens;
};

/* One Gemma 4 layer. Norm gains are mlx-lm's nn.RMSNorm weights (w, not Gemma 3's 1 + w); v_norm
 * is ones (RMSNormNoScale). */
struct mlxcel_gemma4_layer {
    struct mlxcel_linear q, k, v, o, gate, up, down; /* k.n == 0: a KV-sharing layer; v.n == 0: values = keys' projection */
    struct mlxcel_linear ple_gate, ple_proj;         /* the per-layer input's gate and projection (n == 0: none) */
    const float *n_in, *attn_out, *mlp_in, *mlp_out; /* input, post-attention, pre- and post-feedforward norms */
    const float *q_norm, *k_norm, *v_norm, *ple_norm;
    int heads, kv_heads, head_dim;
    int rope;   /* which angle set: 0 the sliding layers', 1 the full layers' (proportional RoPE) */
    int source; /* the layer whose new key and value rows this one attends with (itself unless KV-sharing) */
    float layer_scalar;
};

struct mlxcel_gemma4 {
    int n_layers, hidden, ple_dim; /* ple_dim 0: no per-layer embeddings */
    float eps, scale;              /* scale: the softmax's (1.0) times log2 e */
    int k_type, v_type;
    int traditional[2];
    int kv_width; /* the widest layer's kv_heads * head_dim: a layer's rows in kv_rows */
    const struct mlxcel_gemma4_layer *layers;
    struct mlxcel_linear ple_model_proj; /* hidden -> n_layers * ple_dim */
    const float *ple_proj_norm;          /* (ple_dim) */
    float ple_proj_scale, ple_input_scale;
    const float *norm;
    struct mlxcel_linear head;
};

/* A pass's activations, rows contiguous. ple holds on entry each row's per-layer embedding rows
 * (n_layers * ple_dim, already times sqrt(ple_dim)); kv_rows each layer's new keys then values
 * (n_layers x rows x 2 x kv_width). */
struct mlxcel_gemma4_buffers {
    float *x, *h, *branch, *q, *kv_rows, *att, *gate, *up, *logits, *ple, *ple_proj, *ple_gate, *ple_in;
};

/* The per-layer inputs, in mlx-lm's order: (norm(P(x) * proj_scale) + ple) * input_scale, the norm
 * over each layer's slice; x is the scaled embedding. */
static void per_layer_inputs(const struct mlxcel_gemma4 *m, const struct mlxcel_gemma4_buffers *b, int rows,
                             const double *scales, int n_adapters) {
    size_t n = (size_t)rows * m->n_layers * m->ple_dim;
    mlxcel_pass_product(&m->ple_model_proj, rows, b->x, b->ple_proj, 0.0f, 0, scales, n_adapters);
    for (size_t j = 0; j < n; j++) b->ple_proj[j] *= m->ple_proj_scale;
    mlxcel_rms_norm(b->ple_proj, m->ple_proj_norm, b->ple_proj, rows * m->n_layers, m->ple_dim, m->eps);
    for (size_t j = 0; j < n; j++) b->ple[j] = (b->ple_proj[j] + b->ple[j]) * m->ple_input_scale;
}

/* One decode pass of `rows` rows, each its own position and cache (kv: rows x layers, a KV-sharing
 * layer's entry its source's; angles: rows x 2 angle sets x (cos, sin)). b->x holds the rows'
 * embeddings times sqrt(hidden). Returns 0, or 1 + the layer whose attention did not fit. */
int mlxcel_gemma4_pass(const struct mlxcel_gemma4 *m, const struct mlxcel_gemma4_buffers *b, int rows, int head,
                       const struct gemma4_kv *kv, const float *const *angles, const double *scales,
                       int n_adapters) {
    int hidden = m->hidden, W = m->kv_width, P = m->ple_dim, nl = m->n_layers;
    if (P) per_layer_inputs(m, b, rows, scales, n_adapters);
    for (int i = 0; i < nl; i++) {
        const struct mlxcel_gemma4_layer *L = &m->layers[i];
        int hq = L->heads, hk = L->kv_heads, d = L->head_dim, group = hq / hk;
        mlxcel_rms_norm(b->x, L->n_in, b->h, rows, hidden, m->eps);
        float *kn = b->kv_rows + (size_t)L->source * rows * 2 * W, *vn = kn + (size_t)rows * W;
        if (L->k.n) {
            const struct mlxcel_linear *qkv[3] = {&L->q, &L->k, &L->v};
            float *outs[3] = {b->q, kn, vn};
            mlxcel_pass_products(L->v.n ? 3 : 2, qkv, rows, b->h, outs, 0, scales, n_adapters);
            /* rows of kv_heads * d, laid out at kv_width apart */
            if (W != hk * d)
                for (int r = rows - 1; r > 0; r--) memmove(kn + (size_t)r * W, kn + (size_t)r * hk * d, sizeof(float) * hk * d);
            if (L->v.n && W != hk * d)
                for (int r = rows - 1; r > 0; r--) memmove(vn + (size_t)r * W, vn + (size_t)r * hk * d, sizeof(float) * hk * d);
            if (!L->v.n) memcpy(vn, kn, sizeof(float) * (size_t)rows * W); /* attention_k_eq_v: before k_norm */
            for (int r = 0; r < rows; r++) {
                mlxcel_rms_norm(kn + (size_t)r * W, L->k_norm, kn + (size_t)r * W, hk, d, m->eps);
                mlxcel_rms_norm(vn + (size_t)r * W, L->v_norm, vn + (size_t)r * W, hk, d, m->eps);
            }
        } else {
            mlxcel_pass_product(&L->q, rows, b->h, b->q, 0.0f, 0, scales, n_adapters);
        }
        mlxcel_rms_norm(b->q, L->q_norm, b->q, rows * hq, d, m->eps);
        int trad = m->traditional[L->rope];
        for (int r = 0; r < rows; r++) {
            const float *const *a = angles + (size_t)r * 4;
            const float *cos = a[2 * L->rope], *sin = a[2 * L->rope + 1];
            float *q = b->q + (size_t)r * hq * d, *kr = kn + (size_t)r * W, *vr = vn + (size_t)r * W;
            mlxcel_rope(q, hq, d, cos, sin, trad);
            if (L->k.n) mlxcel_rope(kr, hk, d, cos, sin, trad);
            const struct gemma4_kv *s = &kv[(size_t)r * nl + i];
            if (mlxcel_decode_attention_at(q, kr, vr, s->keys, s->values, b->att + (size_t)r * hq * d, hk, group, d,
                                           (int)s->write, (int)s->n, s->capacity, m->scale, m->k_type, m->v_type))
                return i + 1;
        }
        mlxcel_pass_product(&L->o, rows, b->att, b->branch, 0.0f, 0, scales, n_adapters);
        mlxcel_rms_norm_add(b->branch, L->attn_out, b->x, rows, hidden, m->eps);
        mlxcel_rms_norm(b->x, L->mlp_in, b->h, rows, hidden, m->eps);
        int ffn = L->gate.n;
        const struct mlxcel_linear *gate_up[2] = {&L->gate, &L->up};
        float *gate_up_out[2] = {b->gate, b->up};
        mlxcel_pass_products(2, gate_up, rows, b->h, gate_up_out, 0, scales, n_adapters);
        mlxcel_gelu_tanh_gate(b->gate, b->up, rows * ffn);
        mlxcel_pass_product(&L->down, rows, b->gate, b->branch, 0.0f, 0, scales, n_adapters);
        mlxcel_rms_norm_add(b->branch, L->mlp_out, b->x, rows, hidden, m->eps);
        if (P && L->ple_gate.n) {
            mlxcel_pass_product(&L->ple_gate, rows, b->x, b->ple_gate, 0.0f, 0, scales, n_adapters);
            for (int r = 0; r < rows; r++)
                memcpy(b->ple_in + (size_t)r * P, b->ple + ((size_t)r * nl + i) * P, sizeof(float) * P);
            mlxcel_gelu_tanh_gate(b->ple_gate, b->ple_in, rows * P);
            mlxcel_pass_product(&L->ple_proj, rows, b->ple_gate, b->branch, 0.0f, 0, scales, n_adapters);
            mlxcel_rms_norm_add(b->branch, L->ple_norm, b->x, rows, hidden, m->eps);
        }
        for (size_t j = 0; j < (size_t)rows * hidden; j++) b->x[j] *= L->layer_scalar;
    }
    if (!head) return 0;
    mlxcel_rms_norm(b->x, m->norm, b->h, rows, hidden, m->eps);
    mlxcel_pass_product(&m->head, rows, b->h, b->logits, 0.0f, 0, scales, n_adapters);
    return 0;
}
