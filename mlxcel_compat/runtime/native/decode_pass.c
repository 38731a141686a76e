/* A whole forward pass of the CPU decode runtime (mlxcel_compat/runtime/cpu_decode.py) in one call.
 *
 * Why: a decode step is ~15 kernel calls a layer (norms, projections, RoPE, attention, gating).
 * Made from Python through ctypes, each call costs a few microseconds of interpreter work around
 * its kernel: on a small model that was a fifth of the step (12 layers, 2.5 ms a step of which
 * 2.0 ms in the products). Here the layer loop runs in C over a description of the model built
 * once (struct mlxcel_model) and the per-pass state (the rows' KV slots and RoPE angles), calling
 * the same kernels in the same order the Python loop called them: the arithmetic, and so every
 * logit, is unchanged.
 *
 * The products of a linear layer go where BlockWeight.matmul_into sent them: float32 weights to
 * the shim's routed cblas_sgemm (its small-M kernel for up to small_m_max rows, the BLAS beyond),
 * weights in ggml's blocks to mlxcel_block_matmul (vec_dot rows for steps, float32 tiles for
 * prompt chunks), or to ggml's repacked copy or its own mul_mat (ggml_repack.c, reached through the
 * function pointers Python hands over). LoRA adapters served unfused (lora/layers.py) add
 * scale * multiplier * B (A x) per row after their layer's product.
 *
 * The embedding lookup and the caches' bookkeeping (offsets, ring indices) stay in Python.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blas_shim.h"
#include "decode_kernels.h"
#include "delta_net.h"
#include "kv_rows.h"
#include "thread_pool.h"

typedef void (*repacked_fn)(const void *handle, int m, const float *x, long ldx, float *c, long ldc, float beta,
                            int per_row);
typedef void (*prompt_fn)(const void *handle, int m, const float *x, long ldx, float *c, long ldc, float beta);

struct mlxcel_block_weight; /* block_matmul.c */
void mlxcel_block_matmul(const struct mlxcel_block_weight *w, int m, const float *x, long ldx, float *c, long ldc,
                         float beta, int tiles);
void mlxcel_block_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int m, const float *x,
                                long ldx, float *const *cs, const long *ldcs, float beta);
int mlxcel_expert_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int rows, int groups,
                                const int32_t *expert, const int32_t *start, const int32_t *source, int n_x,
                                const float *x, long ldx, float *const *cs, long ldc);

/* One adapter on one projection: out += scale * multiplier * B (A x), scale per row and adapter. */
struct mlxcel_lora {
    const float *a; /* (rank, k) */
    const float *b; /* (n, rank) */
    double multiplier;
    int rank;
    int adapter; /* column of the pass's scales */
};

/* A linear layer, out = x W^T (+ bias): exactly one of w and blocks is set. */
struct mlxcel_linear {
    const float *w;                           /* float32 (n, k) */
    const struct mlxcel_block_weight *blocks; /* ggml's blocks */
    const void *repacked;                     /* ggml's repacked copy (every product goes there), or NULL */
    repacked_fn repacked_matmul;
    const void *prompt; /* ggml's own mul_mat over the blocks (prompt chunks), or NULL */
    prompt_fn prompt_matmul;
    const float *bias; /* (n) or NULL */
    const struct mlxcel_lora *lora;
    int n_lora;
    int n, k;
};

/* A norm's gain as the model applies it (Gemma's 1 + w already added), or w NULL where absent. */
struct mlxcel_norm {
    const float *w;
    float eps;
};

/* A mixture-of-experts layer in place of the MLP (runtime/decode_moe.py): the router's logits,
 * the family's gating, then only the chosen experts' rows of the stacked block tensors
 * (ffn_{gate,up,down}_exps, expert e being rows e * rows .. (e + 1) * rows - 1), SwiGLU between,
 * the outputs summed by the gates' weights; a shared expert (qwen2_moe) behind its sigmoid gate.
 * The gating is the softmax-then-top-k of mlx-lm's qwen3_moe, qwen2_moe and olmoe blocks, or
 * gpt-oss's top-k-then-softmax over the chosen, with its experts' biases and clamped SwiGLU. */
struct mlxcel_moe {
    struct mlxcel_linear router;                        /* hidden -> n_expert logits */
    const struct mlxcel_block_weight *gate, *up, *down; /* the stacks */
    struct mlxcel_linear shared_gate, shared_up, shared_down; /* n == 0: no shared expert */
    struct mlxcel_linear shared_scale;                  /* hidden -> 1, its sigmoid scales the shared expert; n == 0: none */
    int n_expert, top_k, rows;                          /* rows: an expert's intermediate width */
    int norm_topk; /* the chosen k weights divided by their sum (norm_topk_prob) */
    /* gpt-oss: each expert's biases ((n_expert, rows), (n_expert, rows), (n_expert, hidden)) or
     * NULL; gating 1: the top k of the router's logits, then a softmax over them (else 0);
     * clamped 1: the clamped SwiGLU (mlxcel_swiglu_oai) with its alpha and limit */
    const float *gate_bias, *up_bias, *down_bias;
    int gating, clamped;
    float alpha, limit;
};

struct mlxcel_layer {
    struct mlxcel_linear q, k, v, o, gate, up, down; /* gate, up, down: n == 0 in an MoE layer */
    struct mlxcel_norm n1, n2;                /* before attention, before the MLP */
    struct mlxcel_norm q_norm, k_norm;        /* per head (qwen3, gemma3) */
    struct mlxcel_norm attn_out, mlp_out;     /* gemma3: each branch's output normed before its sum */
    int rope;                                 /* which angle set (gemma3: sliding layers have their own) */
    const struct mlxcel_moe *moe;             /* the MoE layer in place of the MLP, or NULL */
    const struct mlxcel_delta *delta;         /* a hybrid's gated delta-net in place of attention (delta_net.c), or NULL */
    int gated_q;                              /* qwen3_next's attention: q's projection holds per head d queries, d gates */
    const float *sinks;                       /* gpt-oss: (heads) sink logits times log2 e, or NULL */
};

struct mlxcel_model {
    int n_layers, hidden, heads, kv_heads, head_dim, inter;
    int gelu;       /* Gemma's GELU-tanh gating, else SiLU */
    float scale;    /* the attention's softmax scale times log2 e */
    int angle_sets; /* RoPE angle sets (gemma3: 2, the sliding layers' own base) */
    int prompt_rows_min; /* the fewest rows a prompt chunk multiplies by the prompt products */
    int traditional[2];
    const struct mlxcel_layer *layers;
    struct mlxcel_norm norm;
    struct mlxcel_linear head;
    int qk_norm_whole; /* q_norm and k_norm over the whole projection (olmoe), not per head */
    int rope_dims;     /* the rotated dimensions of a head (a partial RoPE: the hybrids'), 0: all of head_dim */
    int k_type, v_type; /* the KV cache's storage types (MLXCEL_KV_*: -ctk/-ctv) */
    float residual_scale; /* granitemoe's residual_multiplier: x += scale * branch; 0: x += branch */
};

/* A pass's activations, rows contiguous (row widths: hidden, heads * d, kv_heads * d, inter, vocab). */
struct mlxcel_buffers {
    float *x, *h, *branch, *q, *k_new, *v_new, *att, *gate, *up, *logits;
};

/* Where one row (a prompt chunk: the chunk) attends in one layer. A growing cache: write = the
 * position, n = write + 1; a sliding window's ring: its slot and how many slots it sees; a cache
 * the pass may not write (k_out set): n_base = write, the new rows go to k_out and v_out. A
 * prompt chunk on a sliding layer's ring (`window` set, 0 elsewhere): write = the ring's next
 * slot, n = its valid slots (see ring_chunk). The buffers hold rows of the model's k_type and
 * v_type. */
struct mlxcel_kv {
    void *keys, *values, *k_out, *v_out;
    int64_t capacity, write, n, window;
};

/* Per-thread scratch for the adapters' A x, and a sliding layer's chunk laid out in order. */
static __thread struct mlxcel_scratch ring_scratch;
/* Per-thread scratch for the adapters' A x. */
static __thread struct mlxcel_scratch lora_scratch;

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };

/* out += bias, and the adapters' scale * multiplier * B (A x): what follows a layer's product. */
static void extras(const struct mlxcel_linear *l, int m, const float *x, float *out, const double *scales,
                   int n_adapters) {
    if (l->bias)
        for (int i = 0; i < m; i++)
            for (int r = 0; r < l->n; r++) out[(size_t)i * l->n + r] += l->bias[r];
    if (!scales) return;
    for (int j = 0; j < l->n_lora; j++) {
        const struct mlxcel_lora *a = &l->lora[j];
        if (a->adapter >= n_adapters) continue;
        int any = 0;
        for (int i = 0; i < m; i++) any |= scales[(size_t)i * n_adapters + a->adapter] != 0.0;
        if (!any) continue;
        float *t = mlxcel_scratch(&lora_scratch, sizeof(float) * (size_t)m * (size_t)a->rank);
        mlxcel_sgemm(RowMajor, NoTrans, Trans, m, a->rank, l->k, 1.0f, x, l->k, a->a, l->k, 0.0f, t, a->rank);
        for (int i = 0; i < m; i++) {
            float s = (float)(scales[(size_t)i * n_adapters + a->adapter] * a->multiplier);
            for (int r = 0; r < a->rank; r++) t[(size_t)i * a->rank + r] *= s;
        }
        mlxcel_sgemm(RowMajor, NoTrans, Trans, m, l->n, a->rank, 1.0f, t, a->rank, a->b, a->rank, 1.0f, out, l->n);
    }
}

/* out (m, n) = x (m, k) W^T (+ beta out) (+ bias) (+ the adapters). `tiles`: a prompt chunk's path. */
static void product(const struct mlxcel_linear *l, int m, const float *x, float *out, float beta, int tiles,
                    const double *scales, int n_adapters) {
    if (l->repacked) {
        l->repacked_matmul(l->repacked, m, x, l->k, out, l->n, beta, !tiles);
    } else if (l->blocks) {
        if (tiles && l->prompt) l->prompt_matmul(l->prompt, m, x, l->k, out, l->n, beta);
        else mlxcel_block_matmul(l->blocks, m, x, l->k, out, l->n, beta, tiles);
    } else {
        mlxcel_sgemm(RowMajor, NoTrans, Trans, m, l->n, l->k, 1.0f, x, l->k, l->w, l->k, beta, out, l->n);
    }
    extras(l, m, x, out, scales, n_adapters);
}

/* outs[t] = x W_t^T for `count` layers of the same input (q, k, v; gate, up): weights in ggml's
 * blocks on the decode path go through one shared job (the same numbers as one by one). */
static void products(int count, const struct mlxcel_linear *const *ls, int m, const float *x, float *const *outs,
                     int tiles, const double *scales, int n_adapters) {
    int shared = !tiles;
    for (int t = 0; t < count; t++) shared &= ls[t]->blocks && !ls[t]->repacked;
    if (!shared) {
        for (int t = 0; t < count; t++) product(ls[t], m, x, outs[t], 0.0f, tiles, scales, n_adapters);
        return;
    }
    const struct mlxcel_block_weight *ws[3];
    long ldcs[3];
    for (int t = 0; t < count; t++) ws[t] = ls[t]->blocks, ldcs[t] = ls[t]->n;
    mlxcel_block_matmul_shared(count, ws, m, x, ls[0]->k, outs, ldcs, 0.0f);
    for (int t = 0; t < count; t++) extras(ls[t], m, x, outs[t], scales, n_adapters);
}

/* The products for delta_net.c's mixer. */
void mlxcel_pass_product(const struct mlxcel_linear *l, int m, const float *x, float *out, float beta, int tiles,
                         const double *scales, int n_adapters) {
    product(l, m, x, out, beta, tiles, scales, n_adapters);
}

void mlxcel_pass_products(int count, const struct mlxcel_linear *const *ls, int m, const float *x,
                          float *const *outs, int tiles, const double *scales, int n_adapters) {
    products(count, ls, m, x, outs, tiles, scales, n_adapters);
}

/* Per-thread scratch of the hybrids' layers: a gated query projection, its gates, the delta
 * layers' state addresses. */
static __thread struct mlxcel_scratch hybrid_scratch[3];

/* x += the delta-net mixer of layer i (its states where the units' kv entries point). */
static void delta_mixer(const struct mlxcel_model *m, int i, const struct mlxcel_buffers *b, int rows,
                        const int *segments, int n_segments, const struct mlxcel_kv *kv, int tiles,
                        const double *scales, int n_adapters) {
    int units = segments ? n_segments : rows;
    float **states = mlxcel_scratch(&hybrid_scratch[2], sizeof(float *) * 2 * (size_t)units);
    for (int u = 0; u < units; u++) {
        states[u] = kv[(size_t)u * m->n_layers + i].keys;
        states[units + u] = kv[(size_t)u * m->n_layers + i].values;
    }
    mlxcel_delta_layer(m->layers[i].delta, m->hidden, rows, segments, n_segments, b->h, b->x, states, states + units,
                       tiles, scales, n_adapters);
}

/* ------------------------------------------------------------------------- MoE layers */

/* Per-thread scratch of the MoE layer (the engine thread runs the passes). */
static __thread struct mlxcel_scratch moe_scratch[10];

static void *moe_buffer(int i, size_t bytes) { return mlxcel_scratch(&moe_scratch[i], bytes ? bytes : 1); }

/* The k largest of l[0 .. n), largest first (ties: the lower index first): their indices and values. */
static void moe_top_k(const float *l, int n, int k, int32_t *chosen, float *value) {
    for (int j = 0; j < k; j++) { /* k passes of an arg-max over the experts not chosen yet (k is a few) */
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int t = 0; t < j && !taken; t++) taken = chosen[t] == i;
            if (!taken && (best < 0 || l[i] > l[best])) best = i;
        }
        chosen[j] = best;
        value[j] = l[best];
    }
}

/* out[s] += bias[expert of s] for the sorted pairs s of each group (an expert's bias on its rows). */
static void moe_bias(float *out, const float *bias, int width, int groups, const int32_t *experts,
                     const int32_t *start) {
    if (!bias) return;
    for (int gi = 0; gi < groups; gi++) {
        const float *b = bias + (size_t)experts[gi] * width;
        for (int s = start[gi]; s < start[gi + 1]; s++)
            for (int c = 0; c < width; c++) out[(size_t)s * width + c] += b[c];
    }
}

/* Row r's chosen experts and their weights from its router logits `l` (n_expert of them), as
 * mlx-lm's qwen3_moe, qwen2_moe and olmoe blocks compute them: a softmax over every expert in float32,
 * the k largest (ties: the lower expert first), renormalised to sum 1 where norm_topk says so. */
static void moe_route(const struct mlxcel_moe *e, float *l, int32_t *chosen, float *weight) {
    int n = e->n_expert, k = e->top_k;
    if (e->gating == 1) { /* gpt-oss: the k largest logits, then a softmax over those k */
        moe_top_k(l, n, k, chosen, weight);
        float top = weight[0], sum = 0.0f; /* the largest comes first */
        for (int j = 0; j < k; j++) sum += weight[j] = expf(weight[j] - top);
        for (int j = 0; j < k; j++) weight[j] /= sum;
        return;
    }
    float top = l[0], sum = 0.0f;
    for (int i = 1; i < n; i++) top = l[i] > top ? l[i] : top;
    for (int i = 0; i < n; i++) sum += l[i] = expf(l[i] - top);
    for (int i = 0; i < n; i++) l[i] /= sum;
    moe_top_k(l, n, k, chosen, weight);
    if (e->norm_topk) {
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += weight[j];
        for (int j = 0; j < k; j++) weight[j] /= total;
    }
}

/* x += the MoE layer of h (rows x hidden): route every row, sort the (row, expert) pairs by
 * expert (a counting sort: ggml's mul_mat_id's grouping), gate and up of every pair in one
 * grouped call (each row quantized once), SwiGLU, down, then each row's weighted sum of its
 * experts' outputs, plus the shared expert. Every product of a pair takes the decode path of the
 * block kernels, whose result for a row does not depend on the other rows: a row's output is
 * the same alone, batched or in a prompt chunk. `gate`, `up` and `branch` are the pass's
 * buffers (the shared expert's). Returns 0, or -1 where the grouped product refused the stacks. */
static int moe_layer(const struct mlxcel_moe *e, int rows, int hidden, const float *h, float *x, float *gate,
                     float *up, float *branch, int tiles, const double *scales, int n_adapters, float residual_scale) {
    int n = e->n_expert, k = e->top_k, inter = e->rows, pairs = rows * k;
    float *logits = moe_buffer(0, sizeof(float) * (size_t)rows * n);
    int32_t *chosen = moe_buffer(1, sizeof(int32_t) * (size_t)pairs);
    float *weight = moe_buffer(2, sizeof(float) * (size_t)pairs);
    int32_t *count = moe_buffer(3, sizeof(int32_t) * (size_t)(2 * n + 1));
    int32_t *experts = moe_buffer(4, sizeof(int32_t) * (size_t)n);
    int32_t *source = moe_buffer(5, sizeof(int32_t) * (size_t)pairs);
    int32_t *slot = moe_buffer(6, sizeof(int32_t) * (size_t)pairs);
    float *g = moe_buffer(7, sizeof(float) * (size_t)pairs * inter);
    float *u = moe_buffer(8, sizeof(float) * (size_t)pairs * inter);
    float *down = moe_buffer(9, sizeof(float) * (size_t)pairs * hidden);
    int32_t *start = count + n; /* n + 1 group starts */
    product(&e->router, rows, h, logits, 0.0f, tiles, scales, n_adapters);
    for (int r = 0; r < rows; r++) moe_route(e, logits + (size_t)r * n, chosen + (size_t)r * k, weight + (size_t)r * k);
    memset(count, 0, sizeof(int32_t) * (size_t)n);
    for (int p = 0; p < pairs; p++) count[chosen[p]]++;
    int groups = 0;
    start[0] = 0;
    for (int i = 0; i < n; i++) {
        if (!count[i]) continue;
        experts[groups] = i;
        start[groups + 1] = start[groups] + count[i];
        count[i] = start[groups]; /* from here: the expert's next free sorted slot */
        groups++;
    }
    for (int p = 0; p < pairs; p++) { /* rows in order within each expert's group */
        int s = count[chosen[p]]++;
        slot[p] = s;
        source[s] = p / k;
    }
    const struct mlxcel_block_weight *gate_up[2] = {e->gate, e->up};
    float *gate_up_out[2] = {g, u};
    if (mlxcel_expert_matmul_shared(2, gate_up, inter, groups, experts, start, source, rows, h, hidden, gate_up_out,
                                    inter))
        return -1;
    moe_bias(g, e->gate_bias, inter, groups, experts, start);
    moe_bias(u, e->up_bias, inter, groups, experts, start);
    if (e->clamped) mlxcel_swiglu_oai(g, u, pairs * inter, e->alpha, e->limit);
    else mlxcel_swiglu(g, u, pairs * inter);
    float *down_out[1] = {down};
    if (mlxcel_expert_matmul_shared(1, &e->down, hidden, groups, experts, start, NULL, pairs, g, inter, down_out,
                                    hidden))
        return -1;
    moe_bias(down, e->down_bias, hidden, groups, experts, start);
    float *out = moe_buffer(0, sizeof(float) * (size_t)rows * (hidden > n ? hidden : n)); /* the logits are spent */
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)r * hidden;
        const float *d0 = down + (size_t)slot[(size_t)r * k] * hidden;
        float w0 = weight[(size_t)r * k];
        for (int c = 0; c < hidden; c++) o[c] = w0 * d0[c];
        for (int j = 1; j < k; j++) {
            const float *d = down + (size_t)slot[(size_t)r * k + j] * hidden;
            float w = weight[(size_t)r * k + j];
            for (int c = 0; c < hidden; c++) o[c] += w * d[c];
        }
    }
    if (e->shared_gate.n) {
        const struct mlxcel_linear *shared[2] = {&e->shared_gate, &e->shared_up};
        float *shared_out[2] = {gate, up};
        products(2, shared, rows, h, shared_out, tiles, scales, n_adapters);
        mlxcel_swiglu(gate, up, rows * e->shared_gate.n);
        product(&e->shared_down, rows, gate, branch, 0.0f, tiles, scales, n_adapters);
        float *s = up; /* the shared expert's gate logit, one per row */
        if (e->shared_scale.n) product(&e->shared_scale, rows, h, s, 0.0f, tiles, scales, n_adapters);
        for (int r = 0; r < rows; r++) {
            float scale = e->shared_scale.n ? 1.0f / (1.0f + expf(-s[r])) : 1.0f;
            float *o = out + (size_t)r * hidden;
            const float *b = branch + (size_t)r * hidden;
            for (int c = 0; c < hidden; c++) o[c] += scale * b[c];
        }
    }
    if (residual_scale != 0.0f)
        for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += out[i] * residual_scale;
    else
        for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += out[i];
    return 0;
}

/* A prompt chunk's attention on a sliding layer's ring (s->capacity slots, at most the window: a
 * ring shorter than the window holds every position so far; s->n of them valid, the oldest at
 * s->write once full): the ring's newest min(window - 1, n) slots in order, then the chunk's rows,
 * in a scratch buffer, as mlx-lm's chunk lays them out (_update_concat); the windowed chunk
 * attention over it; then the newest min(window, kept + rows) slots back into the ring in order
 * from slot 0 (the caller sets _idx there, and made the ring that long). Returns 0, or -1. */
static int ring_chunk(const struct mlxcel_kv *s, const float *q, const float *kn, const float *vn, float *att, int rows,
                      int hk, int group, int d, float scale, int k_type, int v_type, const float *sinks) {
    int w = (int)s->window, cap = (int)s->capacity, n = (int)s->n, kept = n < w - 1 ? n : w - 1, total = kept + rows;
    int back = total < w ? total : w;
    if (cap > w || back > cap || n > cap || s->write < 0 || s->write >= cap) return -1;
    size_t kb = kv_row_bytes(k_type, d), vb = kv_row_bytes(v_type, d); /* a row's bytes */
    char *k = mlxcel_scratch(&ring_scratch, (kb + vb) * hk * total), *v = k + kb * hk * total;
    const char *keys = s->keys, *values = s->values;
    for (int h = 0; h < hk; h++)
        for (int t = 0; t < kept; t++) {
            size_t slot = (size_t)((s->write - kept + t + cap) % cap);
            memcpy(k + ((size_t)h * total + t) * kb, keys + ((size_t)h * cap + slot) * kb, kb);
            memcpy(v + ((size_t)h * total + t) * vb, values + ((size_t)h * cap + slot) * vb, vb);
        }
    if (mlxcel_chunk_attention_window(q, kn, vn, k, v, att, rows, hk, group, d, kept, total, scale, k_type, v_type, w,
                                      sinks))
        return -1;
    for (int h = 0; h < hk; h++) {
        memcpy((char *)s->keys + (size_t)h * cap * kb, k + ((size_t)h * total + total - back) * kb, kb * back);
        memcpy((char *)s->values + (size_t)h * cap * vb, v + ((size_t)h * total + total - back) * vb, vb * back);
    }
    return 0;
}

/* One forward pass of `rows` rows: each its own position (and cache: kv is rows x layers, angles
 * rows x angle sets x (cos, sin)), or, given `segments`, prompt chunks: segment j is rows
 * segments[j] .. segments[j + 1] - 1, consecutive positions of one sequence (kv is
 * n_segments x layers, angles n_segments x angle sets x (cos, sin) of every row's position), its
 * attention one call a layer, and the logits are the last row's only (one segment). The residual
 * stream b->x holds the rows' embeddings on entry. `head`: compute the logits. `scales`:
 * rows x n_adapters LoRA scales, or NULL. Returns 0, or 1 + the layer whose attention did not fit
 * its cache (nothing of that layer's KV written, for that row or segment and the ones after), or
 * -(1 + the layer) whose expert stacks the grouped product refused. */
int mlxcel_decode_pass(const struct mlxcel_model *m, const struct mlxcel_buffers *b, int rows, const int *segments,
                       int n_segments, int head, const struct mlxcel_kv *kv, const float *const *angles,
                       const double *scales, int n_adapters) {
    int hidden = m->hidden, hq = m->heads, hk = m->kv_heads, d = m->head_dim, group = hq / hk;
    int kinds = m->angle_sets, chunk = segments != NULL;
    /* Prompt chunks of prompt_rows_min rows or more take the prompt products (ggml's tiled
     * kernels, its repacked GEMM, float32 tiles); shorter ones take the decode rows' kernels: a
     * graph of ggml's for a handful of rows cost ~0.2 ms a weight in set-up (a 13-token prompt
     * 24 -> 13 ms on the small Q6_K). Both compute a row the same whatever rows share the pass,
     * and the rule depends on each chunk's own length (the caller passes chunks of one kind
     * together: CpuDecoder.prefill_rows), so a chunk's KV is the same alone or batched, cold or
     * after an aligned hit. */
    int tiles = chunk && rows > 1;
    for (int j = 0; chunk && j < n_segments; j++) tiles &= segments[j + 1] - segments[j] >= m->prompt_rows_min;
    for (int i = 0; i < m->n_layers; i++) {
        const struct mlxcel_layer *L = &m->layers[i];
        mlxcel_rms_norm(b->x, L->n1.w, b->h, rows, hidden, L->n1.eps);
        if (L->delta) {
            delta_mixer(m, i, b, rows, segments, n_segments, kv, tiles, scales, n_adapters);
            goto mlp;
        }
        const struct mlxcel_linear *qkv[3] = {&L->q, &L->k, &L->v};
        float *q_gated = L->gated_q ? mlxcel_scratch(&hybrid_scratch[0], sizeof(float) * (size_t)rows * 2 * hq * d) : NULL;
        float *qkv_out[3] = {q_gated ? q_gated : b->q, b->k_new, b->v_new};
        products(3, qkv, rows, b->h, qkv_out, tiles, scales, n_adapters);
        float *q_gate = q_gated ? mlxcel_scratch(&hybrid_scratch[1], sizeof(float) * (size_t)rows * hq * d) : NULL;
        if (q_gated) mlxcel_split_gated_q(q_gated, b->q, q_gate, rows, hq, d);
        if (L->q_norm.w && m->qk_norm_whole) {
            mlxcel_rms_norm(b->q, L->q_norm.w, b->q, rows, hq * d, L->q_norm.eps);
            mlxcel_rms_norm(b->k_new, L->k_norm.w, b->k_new, rows, hk * d, L->k_norm.eps);
        } else if (L->q_norm.w) {
            mlxcel_rms_norm(b->q, L->q_norm.w, b->q, rows * hq, d, L->q_norm.eps);
            mlxcel_rms_norm(b->k_new, L->k_norm.w, b->k_new, rows * hk, d, L->k_norm.eps);
        }
        int trad = m->traditional[L->rope];
        if (chunk) {
            for (int j = 0; j < n_segments; j++) {
                int r0 = segments[j], n = segments[j + 1] - r0;
                const float *const *a = angles + (size_t)j * kinds * 2;
                const float *cos = a[2 * L->rope], *sin = a[2 * L->rope + 1];
                const struct mlxcel_kv *s = &kv[(size_t)j * m->n_layers + i];
                float *q = b->q + (size_t)r0 * hq * d, *kn = b->k_new + (size_t)r0 * hk * d;
                float *vn = b->v_new + (size_t)r0 * hk * d, *att = b->att + (size_t)r0 * hq * d;
                if (m->rope_dims) {
                    for (int t = 0; t < n; t++) {
                        size_t at = (size_t)t * (m->rope_dims / 2);
                        mlxcel_rope_part(q + (size_t)t * hq * d, hq, d, m->rope_dims, cos + at, sin + at, trad);
                        mlxcel_rope_part(kn + (size_t)t * hk * d, hk, d, m->rope_dims, cos + at, sin + at, trad);
                    }
                } else {
                    mlxcel_rope_rows(q, n, hq, d, cos, sin, trad);
                    mlxcel_rope_rows(kn, n, hk, d, cos, sin, trad);
                }
                int failed = L->sinks && !s->window
                    ? (s->k_out ? -1 /* a full layer with sinks: never borrowed (KvLayout.borrow: a model with rings) */
                                : mlxcel_chunk_attention_window(q, kn, vn, s->keys, s->values, att, n, hk, group, d,
                                                                (int)s->write, s->capacity, m->scale, m->k_type,
                                                                m->v_type, 0, L->sinks))
                    : s->k_out
                    ? mlxcel_chunk_attention_apart(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, n, hk, group,
                                                   d, (int)s->write, s->capacity, m->scale, m->k_type, m->v_type)
                    : s->window
                    ? ring_chunk(s, q, kn, vn, att, n, hk, group, d, m->scale, m->k_type, m->v_type, L->sinks)
                    : mlxcel_chunk_attention(q, kn, vn, s->keys, s->values, att, n, hk, group, d, (int)s->write,
                                             s->capacity, m->scale, m->k_type, m->v_type);
                if (failed) return i + 1;
            }
        } else {
            for (int r = 0; r < rows; r++) {
                const struct mlxcel_kv *s = &kv[(size_t)r * m->n_layers + i];
                const float *const *a = angles + (size_t)r * kinds * 2;
                float *q = b->q + (size_t)r * hq * d, *kn = b->k_new + (size_t)r * hk * d;
                float *vn = b->v_new + (size_t)r * hk * d, *att = b->att + (size_t)r * hq * d;
                if (m->rope_dims) {
                    mlxcel_rope_part(q, hq, d, m->rope_dims, a[2 * L->rope], a[2 * L->rope + 1], trad);
                    mlxcel_rope_part(kn, hk, d, m->rope_dims, a[2 * L->rope], a[2 * L->rope + 1], trad);
                } else {
                    mlxcel_rope(q, hq, d, a[2 * L->rope], a[2 * L->rope + 1], trad);
                    mlxcel_rope(kn, hk, d, a[2 * L->rope], a[2 * L->rope + 1], trad);
                }
                int failed = L->sinks
                    ? mlxcel_decode_attention_sinks(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, hk, group, d,
                                                    (int)s->write, (int)s->n, s->capacity, m->scale, L->sinks,
                                                    m->k_type, m->v_type)
                    : s->k_out
                    ? mlxcel_decode_attention_apart(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, hk, group,
                                                    d, (int)s->write, s->capacity, m->scale, m->k_type, m->v_type)
                    : mlxcel_decode_attention_at(q, kn, vn, s->keys, s->values, att, hk, group, d, (int)s->write,
                                                 (int)s->n, s->capacity, m->scale, m->k_type, m->v_type);
                if (failed) return i + 1;
            }
        }
        if (q_gate) mlxcel_sigmoid_gate(b->att, q_gate, rows * hq * d);
        if (L->attn_out.w) {
            product(&L->o, rows, b->att, b->branch, 0.0f, tiles, scales, n_adapters);
            mlxcel_rms_norm_add(b->branch, L->attn_out.w, b->x, rows, hidden, L->attn_out.eps);
        } else if (m->residual_scale != 0.0f) { /* granitemoe: the branch scaled before its sum */
            product(&L->o, rows, b->att, b->branch, 0.0f, tiles, scales, n_adapters);
            for (size_t j = 0; j < (size_t)rows * hidden; j++) b->x[j] += b->branch[j] * m->residual_scale;
        } else {
            product(&L->o, rows, b->att, b->x, 1.0f, tiles, scales, n_adapters);
        }
    mlp:
        mlxcel_rms_norm(b->x, L->n2.w, b->h, rows, hidden, L->n2.eps);
        if (L->moe) {
            if (moe_layer(L->moe, rows, hidden, b->h, b->x, b->gate, b->up, b->branch, tiles, scales, n_adapters,
                          m->residual_scale))
                return -(i + 1);
            continue;
        }
        const struct mlxcel_linear *gate_up[2] = {&L->gate, &L->up};
        float *gate_up_out[2] = {b->gate, b->up};
        products(2, gate_up, rows, b->h, gate_up_out, tiles, scales, n_adapters);
        if (m->gelu) mlxcel_gelu_tanh_gate(b->gate, b->up, rows * L->gate.n);
        else mlxcel_swiglu(b->gate, b->up, rows * L->gate.n);
        if (L->mlp_out.w) {
            product(&L->down, rows, b->gate, b->branch, 0.0f, tiles, scales, n_adapters);
            mlxcel_rms_norm_add(b->branch, L->mlp_out.w, b->x, rows, hidden, L->mlp_out.eps);
        } else if (m->residual_scale != 0.0f) {
            product(&L->down, rows, b->gate, b->branch, 0.0f, tiles, scales, n_adapters);
            for (size_t j = 0; j < (size_t)rows * hidden; j++) b->x[j] += b->branch[j] * m->residual_scale;
        } else {
            product(&L->down, rows, b->gate, b->x, 1.0f, tiles, scales, n_adapters);
        }
    }
    if (!head) return 0;
    if (chunk) { /* the last row only: its norm into the first row of h, the head on that row */
        mlxcel_rms_norm(b->x + (size_t)(rows - 1) * hidden, m->norm.w, b->h, 1, hidden, m->norm.eps);
        product(&m->head, 1, b->h, b->logits, 0.0f, 0, scales ? scales + (size_t)(rows - 1) * n_adapters : NULL,
                n_adapters);
    } else {
        mlxcel_rms_norm(b->x, m->norm.w, b->h, rows, hidden, m->norm.eps);
        product(&m->head, rows, b->h, b->logits, 0.0f, 0, scales, n_adapters);
    }
    return 0;
}
