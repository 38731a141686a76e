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
#include "decode_pass.h"
#include "delta_net.h"
#include "kv_rows.h"
#include "mamba2.h"
#include "short_conv.h"
#include "mla_attention.h"
#include "thread_pool.h"

/* A norm's gain as the model applies it (Gemma's 1 + w already added), or w NULL where absent. */
struct mlxcel_norm {
    const float *w;
    float eps;
    const float *bias; /* a LayerNorm's bias, or NULL */
    int layer;         /* a LayerNorm (starcoder2, cohere2), else an RMS norm */
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
    /* phi3's q, k and v in one projection, and phi3's and glm4's gate and up in one (n == 0: none;
     * then q, k, v or gate, up have n == 0) */
    struct mlxcel_linear qkv, gate_up;
    float xielu[4]; /* Apertus's xIELU: alpha_p, alpha_n (softplus-ed as mlx-lm does), beta, eps */
    const struct mlxcel_mamba *mamba; /* a Mamba-2 mixer in place of attention (mamba2.c), or NULL */
    const struct mlxcel_short_conv *conv; /* LFM2's short convolution in place of attention (short_conv.c), or NULL */
    const struct mlxcel_mla *mla; /* DeepSeek's latent attention in place of attention (mla_attention.c), or NULL */
};

struct mlxcel_model {
    int n_layers, hidden, heads, kv_heads, head_dim, inter;
    int act;        /* the MLP's activation: MLXCEL_ACT_* */
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
    int q_scaled;         /* ministral3: each row's queries times its q_scale after RoPE (Llama 4's temperature) */
    int parallel;         /* cohere2: attention and MLP both read the layer's one norm, x += attn + mlp */
    float softcap;        /* Gemma 2's attention logit soft-cap (then `scale` is the plain scale: attention.c's
                           * _capped kernels multiply by log2 e after the cap), 0: none */
};

/* The MLP's activation (struct mlxcel_model's act): gated SiLU (SwiGLU), Gemma's gated GELU-tanh,
 * and the ungated ones of an MLP without a gate (up, act, down): exact GELU (starcoder2), xIELU
 * (Apertus). */
enum { MLXCEL_ACT_SWIGLU = 0, MLXCEL_ACT_GELU_TANH_GATE = 1, MLXCEL_ACT_GELU_ERF = 2, MLXCEL_ACT_XIELU = 3 };
/* Nemotron-H's MLP without a gate: relu(x)^2 (mamba2.c's mlxcel_relu2). */
enum { MLXCEL_ACT_RELU2 = 4 };

/* A pass's activations, rows contiguous (row widths: hidden, heads * d, kv_heads * d, inter, vocab). */
struct mlxcel_buffers {
    float *x, *h, *branch, *q, *k_new, *v_new, *att, *gate, *up, *logits;
    float *q_scale; /* (rows): the queries' factor by position (q_scaled), filled by the caller each pass */
};

/* Where one row (a prompt chunk: the chunk) attends in one layer. A growing cache: write = the
 * position, n = write + 1; a sliding window's ring: its slot and how many slots it sees; a cache
 * the pass may not write (k_out set): n_base = write, the new rows go to k_out and v_out. A
 * prompt chunk on a sliding layer's ring (`window` set, 0 elsewhere): write = the ring's next
 * slot, n = its valid slots (see ring_chunk). The buffers hold rows of the model's k_type and
 * v_type. A cache that starts with shared prompt-cache blocks read in place (n_blocked > 0:
 * docs/prompt-cache.md, "The CPU decode runtime reads the blocks in place"): positions
 * [0, n_blocked) are in `blocks` (n_blocked / block_tokens blocks' keys, then their values), the
 * buffers hold the positions from n_blocked on; write and n stay positions. */
struct mlxcel_kv {
    void *keys, *values, *k_out, *v_out;
    int64_t capacity, write, n, window;
    const void *const *blocks;
    int64_t n_blocked, block_tokens;
};

/* Per-thread scratch for the adapters' A x, and a sliding layer's chunk laid out in order. */
static __thread struct mlxcel_scratch ring_scratch;
/* Per-thread scratch for the adapters' A x. */
static __thread struct mlxcel_scratch lora_scratch;

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };

/* How many decode rows from row r on are consecutive positions of one sequence on layer i's own
 * buffer (a speculative draft's, a prompt's short rest: the same cache, each row one slot after
 * the one before), for mlxcel_decode_attention_rows; 1 where a row needs the single-row kernels
 * (a ring's slot, shared blocks, rows kept apart, sinks, a soft-cap). */
static int same_sequence_rows(const struct mlxcel_model *m, const struct mlxcel_layer *L, const struct mlxcel_kv *kv,
                              int i, int r, int rows) {
    const struct mlxcel_kv *s = &kv[(size_t)r * m->n_layers + i];
    if (m->softcap || L->sinks || s->k_out || s->n_blocked || s->window || s->n != s->write + 1) return 1;
    int run = 1;
    while (r + run < rows) {
        const struct mlxcel_kv *t = &kv[(size_t)(r + run) * m->n_layers + i];
        if (t->keys != s->keys || t->k_out || t->n_blocked || t->window || t->write != s->write + run ||
            t->n != s->n + run)
            break;
        run++;
    }
    return run;
}

/* rows of n values, row t times factors[t] (ministral3's queries: Llama 4's attention temperature,
 * applied after RoPE as mlx-lm applies it). */
static void scale_rows(float *x, int rows, int n, const float *factors) {
    for (int t = 0; t < rows; t++)
        for (int j = 0; j < n; j++) x[(size_t)t * n + j] *= factors[t];
}

/* h = a branch's input: x normed by n, or x itself where the layer has no norm before the branch
 * (OLMo 2 norms each branch's output instead: attn_out, mlp_out). */
static void pre_norm(const struct mlxcel_norm *n, const float *x, float *h, int rows, int hidden) {
    if (n->w && n->layer) mlxcel_layer_norm(x, n->w, n->bias, h, rows, hidden, n->eps);
    else if (n->w) mlxcel_rms_norm(x, n->w, h, rows, hidden, n->eps);
    else memcpy(h, x, sizeof(float) * (size_t)rows * hidden);
}

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
 * blocks on the decode path, or a prompt chunk's whose lanes take prompts, go through one shared
 * job (the same numbers as one by one; the activations quantized once). */
static void products(int count, const struct mlxcel_linear *const *ls, int m, const float *x, float *const *outs,
                     int tiles, const double *scales, int n_adapters) {
    int shared = 1;
    for (int t = 0; t < count; t++)
        shared &= ls[t]->blocks && !ls[t]->repacked && (!tiles || (!ls[t]->prompt && mlxcel_block_prompt_lanes(ls[t]->blocks)));
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

/* Per-thread scratch of a fused projection's output. */
static __thread struct mlxcel_scratch fused_scratch;

/* A fused projection (phi3's qkv_proj, gate_up_proj): its product into scratch, then each row's
 * `parts` consecutive column ranges of `widths` copied into outs (the layouts separate
 * projections leave), as mlx-lm splits the fused output. */
static void fused_product(const struct mlxcel_linear *l, int m, const float *x, float *const *outs, const int *widths,
                          int parts, int tiles, const double *scales, int n_adapters) {
    float *all = mlxcel_scratch(&fused_scratch, sizeof(float) * (size_t)m * (size_t)l->n);
    product(l, m, x, all, 0.0f, tiles, scales, n_adapters);
    for (int r = 0; r < m; r++) {
        const float *src = all + (size_t)r * l->n;
        for (int p = 0; p < parts; p++) {
            memcpy(outs[p] + (size_t)r * widths[p], src, sizeof(float) * (size_t)widths[p]);
            src += widths[p];
        }
    }
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

/* x += LFM2's short convolution of layer i (each unit's state where its kv entry's keys point). */
static void conv_mixer(const struct mlxcel_model *m, int i, const struct mlxcel_buffers *b, int rows,
                       const int *segments, int n_segments, const struct mlxcel_kv *kv, int tiles,
                       const double *scales, int n_adapters) {
    int units = segments ? n_segments : rows;
    float **states = mlxcel_scratch(&hybrid_scratch[2], sizeof(float *) * (size_t)units);
    for (int u = 0; u < units; u++) states[u] = kv[(size_t)u * m->n_layers + i].keys;
    mlxcel_short_conv_layer(m->layers[i].conv, rows, segments, n_segments, b->h, b->x, states, tiles, scales,
                            n_adapters);
}

/* A Mamba-2 layer's mixer (mamba2.c) on each row's (or chunk's) conv and SSM state, where its
 * struct mlxcel_kv's keys and values point. */
static void mamba_mixer(const struct mlxcel_model *m, int i, const struct mlxcel_buffers *b, int rows,
                        const int *segments, int n_segments, const struct mlxcel_kv *kv, int tiles,
                        const double *scales, int n_adapters) {
    static __thread struct mlxcel_scratch state_scratch;
    int units = segments ? n_segments : rows;
    float **states = mlxcel_scratch(&state_scratch, sizeof(float *) * 2 * (size_t)units);
    for (int u = 0; u < units; u++) {
        states[u] = kv[(size_t)u * m->n_layers + i].keys;
        states[units + u] = kv[(size_t)u * m->n_layers + i].values;
    }
    mlxcel_mamba_layer(m->layers[i].mamba, rows, segments, n_segments, b->h, b->x, states, states + units, tiles,
                       scales, n_adapters, m->residual_scale);
}

/* Per-thread scratch of an MLA layer's units. */
static __thread struct mlxcel_scratch mla_units;

/* Layer i's MLA attention (mla_attention.c): each row's (or chunk's) KV slots, shared blocks and
 * RoPE angles as struct mlxcel_mla_kv. Returns 0, or -1 for a cache it cannot take (a ring). */
static int mla_mixer(const struct mlxcel_model *m, int i, const struct mlxcel_buffers *b, int rows, const int *segments,
                     int n_segments, const struct mlxcel_kv *kv, const float *const *angles, int tiles,
                     const double *scales, int n_adapters) {
    const struct mlxcel_layer *L = &m->layers[i];
    int units = segments ? n_segments : rows, kinds = m->angle_sets;
    struct mlxcel_mla_kv *u = mlxcel_scratch(&mla_units, sizeof *u * (size_t)units);
    for (int j = 0; j < units; j++) {
        const struct mlxcel_kv *s = &kv[(size_t)j * m->n_layers + i];
        const float *const *a = angles + (size_t)j * kinds * 2;
        if (s->window || (s->n_blocked && (!s->blocks || s->block_tokens <= 0))) return -1;
        u[j] = (struct mlxcel_mla_kv){s->keys, s->values, s->k_out, s->v_out, s->capacity, s->write,
                                      a[2 * L->rope], a[2 * L->rope + 1], s->blocks, s->n_blocked, s->block_tokens};
    }
    return mlxcel_mla_layer(L->mla, m->hidden, rows, segments, n_segments, u, m->k_type, m->v_type,
                            m->traditional[L->rope], tiles, b->h, b->x, scales, n_adapters);
}

/* A prompt chunk's attention on a sliding layer's ring (s->capacity slots, at most the window: a
 * ring shorter than the window holds every position so far; s->n of them valid, the oldest at
 * s->write once full): the ring's newest min(window - 1, n) slots in order, then the chunk's rows,
 * in a scratch buffer, as mlx-lm's chunk lays them out (_update_concat); the windowed chunk
 * attention over it; then the newest min(window, kept + rows) slots back into the ring in order
 * from slot 0 (the caller sets _idx there, and made the ring that long). Returns 0, or -1. */
static int ring_chunk(const struct mlxcel_kv *s, const float *q, const float *kn, const float *vn, float *att, int rows,
                      int hk, int group, int d, float scale, int k_type, int v_type, const float *sinks,
                      float softcap) {
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
    if (softcap ? mlxcel_chunk_attention_capped(q, kn, vn, k, v, att, NULL, NULL, rows, hk, group, d, kept, total, scale,
                                                k_type, v_type, w, sinks, NULL, 0, 1, softcap)
                : mlxcel_chunk_attention_window(q, kn, vn, k, v, att, rows, hk, group, d, kept, total, scale, k_type,
                                                v_type, w, sinks))
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
 * stream b->x holds the rows' embeddings on entry. `head`: compute the logits (0: none; 1: of
 * every row, or of a chunk's last row; 2: of the last row only, a prompt's short rest fed as decode
 * rows, whose earlier rows' logits nobody reads: a 150K-token vocabulary's head is the largest
 * weight of a small model). `scales`:
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
        pre_norm(&L->n1, b->x, b->h, rows, hidden);
        if (L->delta) {
            delta_mixer(m, i, b, rows, segments, n_segments, kv, tiles, scales, n_adapters);
            goto mlp;
        }
        if (L->mamba) {
            mamba_mixer(m, i, b, rows, segments, n_segments, kv, tiles, scales, n_adapters);
            goto mlp;
        }
        if (L->conv) {
            conv_mixer(m, i, b, rows, segments, n_segments, kv, tiles, scales, n_adapters);
            goto mlp;
        }
        if (L->mla) {
            if (mla_mixer(m, i, b, rows, segments, n_segments, kv, angles, tiles, scales, n_adapters)) return i + 1;
            goto mlp;
        }
        const struct mlxcel_linear *qkv[3] = {&L->q, &L->k, &L->v};
        float *q_gated = L->gated_q ? mlxcel_scratch(&hybrid_scratch[0], sizeof(float) * (size_t)rows * 2 * hq * d) : NULL;
        float *qkv_out[3] = {q_gated ? q_gated : b->q, b->k_new, b->v_new};
        if (L->qkv.n) {
            const int widths[3] = {hq * d, hk * d, hk * d};
            fused_product(&L->qkv, rows, b->h, qkv_out, widths, 3, tiles, scales, n_adapters);
        } else {
            products(3, qkv, rows, b->h, qkv_out, tiles, scales, n_adapters);
        }
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
                if (m->q_scaled) scale_rows(q, n, hq * d, b->q_scale + r0);
                int failed = m->softcap && !s->window /* Gemma 2's capped attention: one call for any cache */
                    ? mlxcel_chunk_attention_capped(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, n, hk, group,
                                                    d, (int)s->write, s->capacity, m->scale, m->k_type, m->v_type, 0,
                                                    L->sinks, s->blocks, (int)s->n_blocked, (int)s->block_tokens,
                                                    m->softcap)
                    : s->n_blocked
                    ? mlxcel_chunk_attention_paged(q, kn, vn, s->keys, s->values, att, n, hk, group, d, (int)s->write,
                                                   s->capacity, m->scale, m->k_type, m->v_type, 0, L->sinks,
                                                   s->blocks, (int)s->n_blocked, (int)s->block_tokens)
                    : L->sinks && !s->window
                    ? (s->k_out ? -1 /* a full layer with sinks: never borrowed (KvLayout.borrow: a model with rings) */
                                : mlxcel_chunk_attention_window(q, kn, vn, s->keys, s->values, att, n, hk, group, d,
                                                                (int)s->write, s->capacity, m->scale, m->k_type,
                                                                m->v_type, 0, L->sinks))
                    : s->k_out
                    ? mlxcel_chunk_attention_apart(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, n, hk, group,
                                                   d, (int)s->write, s->capacity, m->scale, m->k_type, m->v_type)
                    : s->window
                    ? ring_chunk(s, q, kn, vn, att, n, hk, group, d, m->scale, m->k_type, m->v_type, L->sinks,
                                 m->softcap)
                    : mlxcel_chunk_attention(q, kn, vn, s->keys, s->values, att, n, hk, group, d, (int)s->write,
                                             s->capacity, m->scale, m->k_type, m->v_type);
                if (failed) return i + 1;
            }
        } else {
            for (int r = 0; r < rows; r++) {
                const struct mlxcel_kv *s = &kv[(size_t)r * m->n_layers + i];
                const float *const *a = angles + (size_t)r * kinds * 2;
                float *q = b->q + (size_t)r * hq * d, *kn = b->k_new + (size_t)r * hk * d;
                if (m->rope_dims) {
                    mlxcel_rope_part(q, hq, d, m->rope_dims, a[2 * L->rope], a[2 * L->rope + 1], trad);
                    mlxcel_rope_part(kn, hk, d, m->rope_dims, a[2 * L->rope], a[2 * L->rope + 1], trad);
                } else {
                    mlxcel_rope(q, hq, d, a[2 * L->rope], a[2 * L->rope + 1], trad);
                    mlxcel_rope(kn, hk, d, a[2 * L->rope], a[2 * L->rope + 1], trad);
                }
                if (m->q_scaled) scale_rows(q, 1, hq * d, b->q_scale + r);
            }
            for (int r = 0; r < rows;) {
                const struct mlxcel_kv *s = &kv[(size_t)r * m->n_layers + i];
                float *q = b->q + (size_t)r * hq * d, *kn = b->k_new + (size_t)r * hk * d;
                float *vn = b->v_new + (size_t)r * hk * d, *att = b->att + (size_t)r * hq * d;
                int run = same_sequence_rows(m, L, kv, i, r, rows);
                if (run > 1) { /* consecutive rows of one sequence: each key read once for all */
                    if (mlxcel_decode_attention_rows(q, kn, vn, s->keys, s->values, att, run, hk, group, d, (int)s->write,
                                                     (int)s->n, s->capacity, m->scale, m->k_type, m->v_type))
                        return i + 1;
                    r += run;
                    continue;
                }
                int failed = m->softcap /* Gemma 2's capped attention: one call for any cache */
                    ? mlxcel_decode_attention_capped(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, hk, group, d,
                                                     (int)s->write, (int)s->n, s->capacity, m->scale, m->k_type,
                                                     m->v_type, L->sinks, s->blocks, (int)s->n_blocked,
                                                     (int)s->block_tokens, m->softcap)
                    : s->n_blocked
                    ? mlxcel_decode_attention_paged(q, kn, vn, s->keys, s->values, att, hk, group, d, (int)s->write,
                                                    s->capacity, m->scale, m->k_type, m->v_type, L->sinks, s->blocks,
                                                    (int)s->n_blocked, (int)s->block_tokens)
                    : L->sinks
                    ? mlxcel_decode_attention_sinks(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, hk, group, d,
                                                    (int)s->write, (int)s->n, s->capacity, m->scale, L->sinks,
                                                    m->k_type, m->v_type)
                    : s->k_out
                    ? mlxcel_decode_attention_apart(q, kn, vn, s->keys, s->values, att, s->k_out, s->v_out, hk, group,
                                                    d, (int)s->write, s->capacity, m->scale, m->k_type, m->v_type)
                    : mlxcel_decode_attention_at(q, kn, vn, s->keys, s->values, att, hk, group, d, (int)s->write,
                                                 (int)s->n, s->capacity, m->scale, m->k_type, m->v_type);
                if (failed) return i + 1;
                r++;
            }
        }
        if (q_gate) mlxcel_sigmoid_gate(b->att, q_gate, rows * hq * d);
        if (L->attn_out.w) {
            product(&L->o, rows, b->att, b->branch, 0.0f, tiles, scales, n_adapters);
            mlxcel_rms_norm_add(b->branch, L->attn_out.w, b->x, rows, hidden, L->attn_out.eps);
        } else if (m->residual_scale != 0.0f) { /* granitemoe: the branch scaled before its sum */
            product(&L->o, rows, b->att, b->branch, 0.0f, tiles, scales, n_adapters);
            for (size_t j = 0; j < (size_t)rows * hidden; j++) b->x[j] += b->branch[j] * m->residual_scale;
        } else if (m->parallel) { /* cohere2: held until the MLP's output joins it */
            product(&L->o, rows, b->att, b->branch, 0.0f, tiles, scales, n_adapters);
        } else {
            product(&L->o, rows, b->att, b->x, 1.0f, tiles, scales, n_adapters);
        }
    mlp:
        if (!L->moe && !L->gate.n && !L->up.n && !L->gate_up.n) continue; /* a layer without an MLP (Nemotron-H's) */
        if (!m->parallel) pre_norm(&L->n2, b->x, b->h, rows, hidden); /* cohere2's MLP reads the same h */
        if (L->moe) {
            if (mlxcel_moe_layer(L->moe, rows, hidden, b->h, b->x, b->gate, b->up, b->branch, tiles, scales, n_adapters,
                          m->residual_scale))
                return -(i + 1);
            continue;
        }
        const struct mlxcel_linear *gate_up[2] = {&L->gate, &L->up};
        float *gate_up_out[2] = {b->gate, b->up};
        int ffn = L->gate_up.n ? L->gate_up.n / 2 : L->gate.n ? L->gate.n : L->up.n;
        if (L->gate_up.n) {
            const int widths[2] = {ffn, ffn};
            fused_product(&L->gate_up, rows, b->h, gate_up_out, widths, 2, tiles, scales, n_adapters);
        } else if (L->gate.n) {
            products(2, gate_up, rows, b->h, gate_up_out, tiles, scales, n_adapters);
        } else { /* no gate: up, the activation, down (from the gate buffer, as the gated forms leave it) */
            product(&L->up, rows, b->h, b->gate, 0.0f, tiles, scales, n_adapters);
        }
        if (m->act == MLXCEL_ACT_GELU_TANH_GATE) mlxcel_gelu_tanh_gate(b->gate, b->up, rows * ffn);
        else if (m->act == MLXCEL_ACT_GELU_ERF) mlxcel_gelu_erf(b->gate, rows * ffn);
        else if (m->act == MLXCEL_ACT_RELU2) mlxcel_relu2(b->gate, rows * ffn);
        else if (m->act == MLXCEL_ACT_XIELU)
            mlxcel_xielu(b->gate, rows * ffn, L->xielu[0], L->xielu[1], L->xielu[2], L->xielu[3]);
        else mlxcel_swiglu(b->gate, b->up, rows * ffn);
        if (L->mlp_out.w) {
            product(&L->down, rows, b->gate, b->branch, 0.0f, tiles, scales, n_adapters);
            mlxcel_rms_norm_add(b->branch, L->mlp_out.w, b->x, rows, hidden, L->mlp_out.eps);
        } else if (m->residual_scale != 0.0f) {
            product(&L->down, rows, b->gate, b->branch, 0.0f, tiles, scales, n_adapters);
            for (size_t j = 0; j < (size_t)rows * hidden; j++) b->x[j] += b->branch[j] * m->residual_scale;
        } else if (m->parallel) { /* x += attention + MLP, summed in mlx-lm's order */
            product(&L->down, rows, b->gate, b->branch, 1.0f, tiles, scales, n_adapters);
            for (size_t j = 0; j < (size_t)rows * hidden; j++) b->x[j] = b->branch[j] + b->x[j];
        } else {
            product(&L->down, rows, b->gate, b->x, 1.0f, tiles, scales, n_adapters);
        }
    }
    if (!head) return 0;
    if (chunk || head == 2) { /* the last row only: its norm into the first row of h, the head on that row */
        pre_norm(&m->norm, b->x + (size_t)(rows - 1) * hidden, b->h, 1, hidden);
        product(&m->head, 1, b->h, b->logits, 0.0f, 0, scales ? scales + (size_t)(rows - 1) * n_adapters : NULL,
                n_adapters);
    } else {
        pre_norm(&m->norm, b->x, b->h, rows, hidden);
        product(&m->head, rows, b->h, b->logits, 0.0f, 0, scales, n_adapters);
    }
    return 0;
}
