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
#include "kv_rows.h"
#include "thread_pool.h"

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
    /* The 26B-A4B layout's experts beside the MLP (n_expert 0: none): the router (its input normed
     * by scale * hidden^-0.5), the k largest logits' softmax times each chosen expert's scale, the
     * fused gate-up stack (an expert's gate rows, then its up rows) and the down stack in ggml's
     * blocks, and the three norms around the two branches. */
    struct mlxcel_linear router;
    const float *router_norm, *expert_scale;
    const struct mlxcel_block_weight *gate_up_exps, *down_exps;
    const float *mlp_out_1, *moe_in, *moe_out;
    int n_expert, top_k, expert_rows;
    int ring_slot; /* a sliding layer's prompt-chunk layout kept for the KV-sharing layers that read it (1 + its
                    * index), or 0; a sharing layer names its source's */
    /* a directory's experts as float32 stacks in place of gate_up_exps and down_exps (then NULL):
     * (n_expert, 2 * expert_rows, hidden), each expert's gate rows then its up rows, and
     * (n_expert, hidden, expert_rows); expert_f32.c's grouped product */
    const float *gate_up_f32, *down_f32;
};

/* Sliding layers whose prompt-chunk layout a KV-sharing layer reads (one a kind in mlx-lm's
 * wiring), times the segments of a pass. */
#define MLXCEL_GEMMA4_KEPT_MAX 64

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
    int prompt_rows_min; /* the fewest rows of a prompt chunk the prompt products take (cpu_decode.PROMPT_ROWS_MIN) */
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
                             int tiles, const double *scales, int n_adapters) {
    size_t n = (size_t)rows * m->n_layers * m->ple_dim;
    mlxcel_pass_product(&m->ple_model_proj, rows, b->x, b->ple_proj, 0.0f, tiles, scales, n_adapters);
    for (size_t j = 0; j < n; j++) b->ple_proj[j] *= m->ple_proj_scale;
    mlxcel_rms_norm(b->ple_proj, m->ple_proj_norm, b->ple_proj, rows * m->n_layers, m->ple_dim, m->eps);
    for (size_t j = 0; j < n; j++) b->ple[j] = (b->ple_proj[j] + b->ple[j]) * m->ple_input_scale;
}

/* Per-thread scratch of the experts' branch (the engine thread runs the passes). */
static __thread struct mlxcel_scratch gemma4_scratch[9];

static void *gemma4_buffer(int i, size_t bytes) { return mlxcel_scratch(&gemma4_scratch[i], bytes ? bytes : 1); }

/* out (rows x hidden) = the experts' branch of x (the residual after attention), before its
 * post-norm, as mlx-lm's Router and Experts compute it: route on rms_norm(x, router_norm), each
 * chosen (row, expert) pair sorted by expert (ggml's mul_mat_id grouping), gate and up of every pair
 * in one grouped product from rms_norm(x, moe_in), gelu_tanh(gate) * up, down, the weighted sum.
 * Returns 0, or -1 where the grouped product refused the stacks. */
static int experts(const struct mlxcel_gemma4 *m, const struct mlxcel_gemma4_layer *L, const float *x, float *out,
                   int rows, int tiles, const double *scales, int n_adapters) {
    int hidden = m->hidden, n = L->n_expert, k = L->top_k, inter = L->expert_rows, pairs = rows * k;
    float *normed = gemma4_buffer(0, sizeof(float) * (size_t)rows * hidden);
    float *logits = gemma4_buffer(1, sizeof(float) * (size_t)rows * n);
    int32_t *chosen = gemma4_buffer(2, sizeof(int32_t) * (size_t)pairs);
    float *weight = gemma4_buffer(3, sizeof(float) * (size_t)pairs);
    int32_t *count = gemma4_buffer(4, sizeof(int32_t) * (size_t)(3 * n + 1)), *start = count + n, *groups_of = start + n + 1;
    int32_t *source = gemma4_buffer(5, sizeof(int32_t) * (size_t)pairs), *slot = gemma4_buffer(6, sizeof(int32_t) * (size_t)pairs);
    float *gu = gemma4_buffer(7, sizeof(float) * (size_t)pairs * 2 * inter);
    float *down = gemma4_buffer(8, sizeof(float) * (size_t)pairs * (hidden > 2 * inter ? hidden : 2 * inter));
    mlxcel_rms_norm(x, L->router_norm, normed, rows, hidden, m->eps);
    mlxcel_pass_product(&L->router, rows, normed, logits, 0.0f, tiles, scales, n_adapters);
    for (int r = 0; r < rows; r++) { /* softmax over the chosen k, times each one's scale */
        int32_t *c = chosen + (size_t)r * k;
        float *w = weight + (size_t)r * k, *l = logits + (size_t)r * n;
        mlxcel_moe_top_k(l, n, k, c, NULL);
        float top = l[c[0]], sum = 0.0f;
        for (int j = 0; j < k; j++) sum += w[j] = expf(l[c[j]] - top);
        for (int j = 0; j < k; j++) w[j] = w[j] / sum * L->expert_scale[c[j]];
    }
    int groups = mlxcel_moe_group(chosen, pairs, k, n, count, start, groups_of, slot, source);
    mlxcel_rms_norm(x, L->moe_in, normed, rows, hidden, m->eps);
    float *gu_out[1] = {gu};
    if (L->gate_up_f32) {
        if (mlxcel_expert_matmul_f32(1, &L->gate_up_f32, n, 2 * inter, hidden, groups, groups_of, start, source, normed,
                                     hidden, gu_out, 2 * inter))
            return -1;
    } else if (mlxcel_expert_matmul_shared(1, &L->gate_up_exps, 2 * inter, groups, groups_of, start, source, rows,
                                           normed, hidden, gu_out, 2 * inter))
        return -1;
    for (int p = 0; p < pairs; p++) { /* gate half, up half of each pair's row: gelu(gate) * up, packed */
        memcpy(down + (size_t)p * inter, gu + (size_t)p * 2 * inter + inter, sizeof(float) * inter);
        memmove(gu + (size_t)p * inter, gu + (size_t)p * 2 * inter, sizeof(float) * inter);
    }
    mlxcel_gelu_tanh_gate(gu, down, pairs * inter);
    float *down_out[1] = {down};
    if (L->down_f32) {
        if (mlxcel_expert_matmul_f32(1, &L->down_f32, n, hidden, inter, groups, groups_of, start, NULL, gu, inter,
                                     down_out, hidden))
            return -1;
    } else if (mlxcel_expert_matmul_shared(1, &L->down_exps, hidden, groups, groups_of, start, NULL, pairs, gu, inter,
                                           down_out, hidden))
        return -1;
    mlxcel_moe_weighted_sum(out, down, slot, weight, rows, k, hidden);
    return 0;
}

/* Per-thread scratch of the sliding layers' prompt chunks: [0] a layer's, used at once; then one per
 * (kept layer, segment) whose layout a KV-sharing layer reads again later in the pass. */
static __thread struct mlxcel_scratch ring_scratch[1 + MLXCEL_GEMMA4_KEPT_MAX];

/* A prompt chunk's attention on a sliding layer's ring, as decode_pass.c's ring_chunk lays it out:
 * the ring's newest min(window - 1, n) slots in order, then the chunk's rows, in the scratch `k`
 * (mlx-lm's _update_concat); the windowed chunk attention over it; then (unless `shared`: the
 * source layer did it, and the ring holds its result) the newest min(window, kept + rows) slots
 * back into the ring in order from slot 0. A KV-sharing layer passes its source's scratch, so it
 * attends over exactly what the source attended over. Returns 0, or -1. */
static int ring_chunk(const struct gemma4_kv *s, const float *q, const float *kn, const float *vn, float *att,
                      int rows, int hk, int group, int d, float scale, int k_type, int v_type,
                      struct mlxcel_scratch *scratch, int shared) {
    int w = (int)s->window, cap = (int)s->capacity, n = (int)s->n, kept = n < w - 1 ? n : w - 1, total = kept + rows;
    int back = total < w ? total : w;
    if (cap > w || back > cap || n > cap || s->write < 0 || s->write >= cap) return -1;
    size_t kb = kv_row_bytes(k_type, d), vb = kv_row_bytes(v_type, d);
    char *k = mlxcel_scratch(scratch, (kb + vb) * hk * total), *v = k + kb * hk * total;
    const char *keys = s->keys, *values = s->values;
    if (!shared)
        for (int h = 0; h < hk; h++)
            for (int t = 0; t < kept; t++) {
                size_t slot = (size_t)((s->write - kept + t + cap) % cap);
                memcpy(k + ((size_t)h * total + t) * kb, keys + ((size_t)h * cap + slot) * kb, kb);
                memcpy(v + ((size_t)h * total + t) * vb, values + ((size_t)h * cap + slot) * vb, vb);
            }
    if (mlxcel_chunk_attention_window(q, kn, vn, k, v, att, rows, hk, group, d, kept, total, scale, k_type, v_type, w,
                                      NULL))
        return -1;
    if (!shared)
        for (int h = 0; h < hk; h++) {
            memcpy((char *)s->keys + (size_t)h * cap * kb, k + ((size_t)h * total + total - back) * kb, kb * back);
            memcpy((char *)s->values + (size_t)h * cap * vb, v + ((size_t)h * total + total - back) * vb, vb * back);
        }
    return 0;
}

/* One forward pass of `rows` rows: each its own position and cache (kv: rows x layers, a
 * KV-sharing layer's entry its source's; angles: rows x 2 angle sets x (cos, sin)), or, given
 * `segments`, prompt chunks: segment j is rows segments[j] .. segments[j + 1] - 1, consecutive
 * positions of one sequence (kv and angles per segment, the angles every row's), attended in one
 * call a layer and segment; the logits are then the last row's only (one segment). b->x holds the
 * rows' embeddings times sqrt(hidden). Returns 0, or 1 + the layer whose attention did not fit, or
 * -(1 + the layer) whose expert stacks the grouped product refused. */
int mlxcel_gemma4_pass(const struct mlxcel_gemma4 *m, const struct mlxcel_gemma4_buffers *b, int rows,
                       const int *segments, int n_segments, int head, const struct gemma4_kv *kv,
                       const float *const *angles, const double *scales, int n_adapters) {
    int hidden = m->hidden, W = m->kv_width, P = m->ple_dim, nl = m->n_layers, chunk = segments != NULL;
    /* prompt products for chunks of prompt_rows_min rows or more (decode_pass.c's rule: a chunk's
     * KV is the same alone or batched) */
    int tiles = chunk && rows > 1;
    for (int j = 0; chunk && j < n_segments; j++) tiles &= segments[j + 1] - segments[j] >= m->prompt_rows_min;
    int kept = 0; /* the kept ring layouts a segment needs (gemma4_pass.KEPT_MAX: Python passes few enough segments) */
    for (int i = 0; i < nl; i++) kept = m->layers[i].ring_slot > kept ? m->layers[i].ring_slot : kept;
    if (chunk && kept * n_segments > MLXCEL_GEMMA4_KEPT_MAX) return nl + 1;
    if (P) per_layer_inputs(m, b, rows, tiles, scales, n_adapters);
    for (int i = 0; i < nl; i++) {
        const struct mlxcel_gemma4_layer *L = &m->layers[i];
        int hq = L->heads, hk = L->kv_heads, d = L->head_dim, group = hq / hk;
        mlxcel_rms_norm(b->x, L->n_in, b->h, rows, hidden, m->eps);
        /* the new keys and values, rows of kv_heads * d, in the region of the layer that made them */
        float *kn = b->kv_rows + (size_t)L->source * rows * 2 * W, *vn = kn + (size_t)rows * W;
        if (L->k.n) {
            const struct mlxcel_linear *qkv[3] = {&L->q, &L->k, &L->v};
            float *outs[3] = {b->q, kn, vn};
            mlxcel_pass_products(L->v.n ? 3 : 2, qkv, rows, b->h, outs, tiles, scales, n_adapters);
            if (!L->v.n) memcpy(vn, kn, sizeof(float) * (size_t)rows * hk * d); /* attention_k_eq_v: before k_norm */
            mlxcel_rms_norm(kn, L->k_norm, kn, rows * hk, d, m->eps);
            mlxcel_rms_norm(vn, L->v_norm, vn, rows * hk, d, m->eps);
        } else {
            mlxcel_pass_product(&L->q, rows, b->h, b->q, 0.0f, tiles, scales, n_adapters);
        }
        mlxcel_rms_norm(b->q, L->q_norm, b->q, rows * hq, d, m->eps);
        int trad = m->traditional[L->rope];
        for (int j = 0; j < (chunk ? n_segments : rows); j++) {
            int r0 = chunk ? segments[j] : j, n = chunk ? segments[j + 1] - r0 : 1;
            const float *const *a = angles + (size_t)j * 4;
            const float *cos = a[2 * L->rope], *sin = a[2 * L->rope + 1];
            float *q = b->q + (size_t)r0 * hq * d, *kr = kn + (size_t)r0 * hk * d, *vr = vn + (size_t)r0 * hk * d;
            float *att = b->att + (size_t)r0 * hq * d;
            mlxcel_rope_rows(q, n, hq, d, cos, sin, trad);
            if (L->k.n) mlxcel_rope_rows(kr, n, hk, d, cos, sin, trad);
            const struct gemma4_kv *s = &kv[(size_t)j * nl + i];
            int failed;
            if (!chunk)
                failed = mlxcel_decode_attention_at(q, kr, vr, s->keys, s->values, att, hk, group, d, (int)s->write,
                                                    (int)s->n, s->capacity, m->scale, m->k_type, m->v_type);
            else if (s->window)
                failed = ring_chunk(s, q, kr, vr, att, n, hk, group, d, m->scale, m->k_type, m->v_type,
                                    &ring_scratch[L->ring_slot ? 1 + (L->ring_slot - 1) * n_segments + j : 0],
                                    !L->k.n);
            else
                failed = mlxcel_chunk_attention(q, kr, vr, s->keys, s->values, att, n, hk, group, d, (int)s->write,
                                                s->capacity, m->scale, m->k_type, m->v_type);
            if (failed) return i + 1;
        }
        mlxcel_pass_product(&L->o, rows, b->att, b->branch, 0.0f, tiles, scales, n_adapters);
        mlxcel_rms_norm_add(b->branch, L->attn_out, b->x, rows, hidden, m->eps);
        mlxcel_rms_norm(b->x, L->mlp_in, b->h, rows, hidden, m->eps);
        int ffn = L->gate.n;
        const struct mlxcel_linear *gate_up[2] = {&L->gate, &L->up};
        float *gate_up_out[2] = {b->gate, b->up};
        mlxcel_pass_products(2, gate_up, rows, b->h, gate_up_out, tiles, scales, n_adapters);
        mlxcel_gelu_tanh_gate(b->gate, b->up, rows * ffn);
        mlxcel_pass_product(&L->down, rows, b->gate, b->branch, 0.0f, tiles, scales, n_adapters);
        if (L->n_expert) { /* branch = norm_1(MLP) + norm_2(experts), both from the same residual */
            float *e = b->h; /* the MLP's input is spent */
            if (experts(m, L, b->x, e, rows, tiles, scales, n_adapters)) return -(i + 1);
            mlxcel_rms_norm(b->branch, L->mlp_out_1, b->branch, rows, hidden, m->eps);
            mlxcel_rms_norm(e, L->moe_out, e, rows, hidden, m->eps);
            for (size_t t = 0; t < (size_t)rows * hidden; t++) b->branch[t] = b->branch[t] + e[t];
        }
        mlxcel_rms_norm_add(b->branch, L->mlp_out, b->x, rows, hidden, m->eps);
        if (P && L->ple_gate.n) {
            mlxcel_pass_product(&L->ple_gate, rows, b->x, b->ple_gate, 0.0f, tiles, scales, n_adapters);
            for (int r = 0; r < rows; r++)
                memcpy(b->ple_in + (size_t)r * P, b->ple + ((size_t)r * nl + i) * P, sizeof(float) * P);
            mlxcel_gelu_tanh_gate(b->ple_gate, b->ple_in, rows * P);
            mlxcel_pass_product(&L->ple_proj, rows, b->ple_gate, b->branch, 0.0f, tiles, scales, n_adapters);
            mlxcel_rms_norm_add(b->branch, L->ple_norm, b->x, rows, hidden, m->eps);
        }
        for (size_t t = 0; t < (size_t)rows * hidden; t++) b->x[t] *= L->layer_scalar;
    }
    if (!head) return 0;
    const float *last = chunk ? b->x + (size_t)(rows - 1) * hidden : b->x; /* a chunk: its last row's logits */
    int out_rows = chunk ? 1 : rows;
    mlxcel_rms_norm(last, m->norm, b->h, out_rows, hidden, m->eps);
    mlxcel_pass_product(&m->head, out_rows, b->h, b->logits, 0.0f, 0,
                        scales && chunk ? scales + (size_t)(rows - 1) * n_adapters : scales, n_adapters);
    return 0;
}
