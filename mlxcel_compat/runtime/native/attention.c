/* The attention kernels of the CPU decode runtime (mlxcel_compat/runtime/cpu_decode.py, through
 * decode_pass.c's layer loop): a decode step's attention for every head of a layer (over a growing
 * cache or a sliding window's ring, or over a cache it may not write, its new key and value kept
 * apart) and a prompt chunk's causal attention, the KV heads spread over the shim's thread pool.
 * The scores and the products by the values are the small-M kernel's (small_m_kernel.h); the
 * softmax is a vectorized power of 2 (vector_math.h), where MLX's CPU exponential is scalar.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "decode_kernels.h"
#include "small_m_kernel.h"
#include "thread_pool.h"
#include "vector_math.h"

/* Weights below 2 ** NEGLIGIBLE of the largest (which is 1) are set to zero: the sum is at least
 * 1, so they are far below float32's resolution of it, and multiplying the values by them could
 * produce denormal numbers, which x86 cores handle in microcode, many times slower. (Not seen on
 * the generated models, whose random weights give flat attention; trained models' is peaky.) */
#define NEGLIGIBLE -64.0f

/* s[t] = 2 ** (s[t] - max s) for t < n, in place (weights below 2 ** NEGLIGIBLE set to zero);
 * returns their sum. The caller normalises (the weights, or the output they give). `sink`:
 * NULL, or one more logit (gpt-oss's learned per-head sink, times log2 e) that takes part in the
 * maximum and the sum but has no value: the weights then sum to less than 1. */
static float exp2_shifted_row_sink(float *s, int n, const float *sink) {
    float top = sink && *sink > s[0] ? *sink : s[0];
    int t0 = 0;
    if (n >= VL) { /* the maximum a vector at a time (the scalar loop was a fifth of a chunk's attention) */
        vf m = loadv(s);
        for (t0 = VL; t0 + VL <= n; t0 += VL) {
            vf v = loadv(s + t0);
            m = vselect(v > m, v, m);
        }
        float lanes[VL];
        memcpy(lanes, &m, sizeof m);
        for (int l = 0; l < VL; l++) top = lanes[l] > top ? lanes[l] : top;
    }
    for (int t = t0; t < n; t++) top = s[t] > top ? s[t] : top;
    vf acc = {0};
    int t = 0;
    for (; t + VL <= n; t += VL) {
        vf x = loadv(s + t) - splat(top);
        vf e = vselect(x < splat(NEGLIGIBLE), splat(0.0f), exp2v(x));
        memcpy(s + t, &e, sizeof e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; t < n; t++) sum += s[t] = s[t] - top < NEGLIGIBLE ? 0.0f : exp2s(s[t] - top);
    if (sink) sum += *sink - top < NEGLIGIBLE ? 0.0f : exp2s(*sink - top);
    return sum;
}

static float exp2_shifted_row(float *s, int n) { return exp2_shifted_row_sink(s, n, NULL); }

struct attention_job {
    const float *q;  /* (Hq, d) queries of one position */
    const float *k_new, *v_new; /* (Hk, d) its key and value, written at slot `write` first */
    float *keys, *values; /* the layer's cache, (Hk, capacity, d) */
    float *k_out, *v_out; /* NULL, or (Hk, d): the new key and value go here, not into the cache
                           * (then read only), and are attended as slot n - 1 */
    float *out;           /* (Hq, d) */
    int group, d;         /* query heads per KV head, head size */
    int write, n;         /* the slot the new key and value go to; keys seen are slots [0, n) */
    size_t head_stride;   /* capacity * d */
    float scale;          /* the softmax scale times log2 e (the exponential is a power of 2) */
    const float *sinks;   /* NULL, or (Hq): each query head's sink logit times log2 e (gpt-oss) */
};

/* KV head h of a decode step: write the new key and value, then for its `group` query heads
 * softmax(q K^T scale) V over slots [0, n). The scores go in one pass over the keys (all the
 * group's queries per key row), the products by the values in one pass over the values. */
static void attend_head(const void *ctx, int h) {
    const struct attention_job *a = ctx;
    int g = a->group, d = a->d, n = a->n;
    float *keys = a->keys + h * a->head_stride, *values = a->values + h * a->head_stride;
    const float *k_new = a->k_new + (size_t)h * d, *v_new = a->v_new + (size_t)h * d;
    int apart = a->k_out != NULL;
    if (apart) {
        memcpy(a->k_out + (size_t)h * d, k_new, d * sizeof(float));
        memcpy(a->v_out + (size_t)h * d, v_new, d * sizeof(float));
    } else {
        memcpy(keys + (size_t)a->write * d, k_new, d * sizeof(float));
        memcpy(values + (size_t)a->write * d, v_new, d * sizeof(float));
    }
    float *q = malloc(((size_t)g * d + (size_t)g * n) * sizeof(float));
    if (!q) abort();
    float *scores = q + (size_t)g * d;
    for (int i = 0; i < g * d; i++) q[i] = a->q[(size_t)h * g * d + i] * a->scale;
    if (apart) { /* each score is its own dot product (hsum4 adds as hsum): the same numbers */
        rows_nt(g, 0, n - 1, d, q, d, keys, d, scores, n, 1.0f, 0.0f);
        rows_nt(g, 0, 1, d, q, d, k_new, d, scores + (n - 1), n, 1.0f, 0.0f);
    } else {
        rows_nt(g, 0, n, d, q, d, keys, d, scores, n, 1.0f, 0.0f);
    }
    float *out = a->out + (size_t)h * g * d;
    for (int i = 0; i < g; i++) {
        float *s = scores + (size_t)i * n;
        float inv = 1.0f / exp2_shifted_row_sink(s, n, a->sinks ? a->sinks + (size_t)h * g + i : NULL);
        for (int t = 0; t < n; t++) s[t] *= inv;
    }
    rows_nn_split(g, 0, d, n, scores, n, values, d, out, d, 1.0f, 0.0f, apart ? v_new : values, apart ? n - 1 : n);
    free(q);
}

/* A decode step's attention for every KV head of one layer, the heads spread over the pool: the
 * new key and value written at slot `write`, the queries attending slots [0, n) of the cache's
 * `capacity`. A growing cache writes at its position and sees everything before it (write = pos,
 * n = pos + 1); a sliding window's ring (mlx-lm's RotatingKVCache) writes over its oldest slot
 * once full and sees every slot, in the ring's order (the softmax does not depend on it).
 * Returns 0, or -1 (and touches nothing) if the slot or the length does not fit the capacity. */
int mlxcel_decode_attention_at(const float *q, const float *k_new, const float *v_new, float *keys,
                               float *values, float *out, int kv_heads, int group, int d, int write, int n,
                               long capacity, float scale) {
    if (write < 0 || write >= capacity || n < 1 || n > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, keys, values, NULL, NULL, out, group, d, write, n, (size_t)capacity * d, scale};
    mlxcel_parallel(kv_heads, attend_head, &a);
    return 0;
}

/* A decode step's attention over a cache it may not write (a prompt-cache entry another sequence
 * shares): slots [0, n_base) of the cache, then the new key and value, which go to k_out and
 * v_out ((Hk, d) each) instead. The same numbers as mlxcel_decode_attention at pos = n_base on a
 * cache holding the same slots. Returns 0, or -1 (touching nothing) if n_base is not in
 * [1, capacity]. */
int mlxcel_decode_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                  const float *values, float *out, float *k_out, float *v_out, int kv_heads,
                                  int group, int d, int n_base, long capacity, float scale) {
    if (n_base < 1 || n_base > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, (float *)keys, (float *)values, k_out, v_out, out, group, d,
                              n_base, n_base + 1, (size_t)capacity * d, scale};
    mlxcel_parallel(kv_heads, attend_head, &a);
    return 0;
}

/* Either of the two above (k_out NULL: mlxcel_decode_attention_at, else _apart at n_base = write)
 * with attention sinks (gpt-oss): `sinks` (Hq) are each query head's sink logit times log2 e,
 * one more term of the softmax's denominator (mlx's scaled_dot_product_attention's `sinks`). */
int mlxcel_decode_attention_sinks(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                                  float *out, float *k_out, float *v_out, int kv_heads, int group, int d, int write,
                                  int n, long capacity, float scale, const float *sinks) {
    if (k_out ? write < 1 || write > capacity : write < 0 || write >= capacity || n < 1 || n > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, keys, values, k_out, v_out, out, group, d, write,
                              k_out ? write + 1 : n, (size_t)capacity * d, scale, sinks};
    mlxcel_parallel(kv_heads, attend_head, &a);
    return 0;
}

/* The growing cache's case of the above: write at `pos`, attend [0, pos] (the caller keeps
 * pos < capacity). */
void mlxcel_decode_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                             float *out, int kv_heads, int group, int d, int pos, long capacity, float scale) {
    mlxcel_decode_attention_at(q, k_new, v_new, keys, values, out, kv_heads, group, d, pos, pos + 1, capacity, scale);
}

/* ------------------------------------------------------------------------- prompt-chunk attention
 * A short prompt chunk fed through the CPU decode runtime (a cache hit's rest, CpuDecoder.prefill):
 * `rows` consecutive positions of one sequence, from `pos` on. Row by row the decode kernel above
 * would read every key and value once per row; here each KV head's keys are read once per block of
 * CHUNK_QUERY_BLOCK queries, both products vectorized over their output columns (the keys
 * transposed once per head), and the parts (KV head, query block) spread over the pool. */

#define CHUNK_QUERY_BLOCK 16

struct chunk_attention_job {
    const float *q;        /* (rows, Hq * d), RoPE applied */
    const float *k_new, *v_new; /* (rows, Hk * d) */
    float *keys, *values;  /* the layer's cache, (Hk, capacity, d) */
    float *keys_t;         /* scratch: (Hk, d, ldk), each head's keys transposed, zeros after pos + rows */
    int ldk;               /* pos + rows rounded up to whole vectors, off multiples of 4 KiB */
    float *out;            /* (rows, Hq * d) */
    float *k_out, *v_out;  /* NULL, or (Hk, rows, d): the rows' keys and values go here, not into
                            * the cache (then read only, slots [0, pos) valid) */
    int rows, kv_heads, group, d, pos, blocks;
    size_t head_stride;    /* capacity * d */
    float scale;           /* the softmax scale times log2 e */
    int window;            /* 0, or a sliding window: row at slot p attends [p - window + 1, p] only */
    const float *sinks;    /* NULL, or (Hq) sink logits times log2 e (gpt-oss) */
};

/* KV head h: write the chunk's keys and values into the cache (or apart), then transpose the
 * head's keys. */
static void chunk_write_head(const void *ctx, int h) {
    const struct chunk_attention_job *a = ctx;
    int d = a->d, hk = a->kv_heads, n = a->pos + a->rows;
    float *keys = a->keys + h * a->head_stride, *values = a->values + h * a->head_stride;
    float *k_rows = a->k_out ? a->k_out + (size_t)h * a->rows * d : keys + (size_t)a->pos * d;
    float *v_rows = a->v_out ? a->v_out + (size_t)h * a->rows * d : values + (size_t)a->pos * d;
    for (int r = 0; r < a->rows; r++) {
        memcpy(k_rows + (size_t)r * d, a->k_new + ((size_t)r * hk + h) * d, d * sizeof(float));
        memcpy(v_rows + (size_t)r * d, a->v_new + ((size_t)r * hk + h) * d, d * sizeof(float));
    }
    int ldk = a->ldk;
    float *kt = a->keys_t + (size_t)h * d * ldk;
    for (int t = 0; t < n; t++) {
        const float *key = t < a->pos ? keys + (size_t)t * d : k_rows + (size_t)(t - a->pos) * d;
        for (int i = 0; i < d; i++) kt[(size_t)i * ldk + t] = key[i];
    }
    for (int i = 0; i < d; i++) memset(kt + (size_t)i * ldk + n, 0, (size_t)(ldk - n) * sizeof(float));
}

/* Part p = (KV head, query block): the block's queries of the head's group against the keys up to
 * the block's last position, causally masked, softmax (shifted by the row's maximum), times the
 * values; the output normalised by each row's sum. */
static void chunk_attend_part(const void *ctx, int p) {
    static __thread struct mlxcel_scratch scratch;
    const struct chunk_attention_job *a = ctx;
    int h = p / a->blocks, j0 = (p % a->blocks) * CHUNK_QUERY_BLOCK;
    int nb = a->rows - j0 < CHUNK_QUERY_BLOCK ? a->rows - j0 : CHUNK_QUERY_BLOCK;
    int g = a->group, d = a->d, hq = a->kv_heads * g, seen = a->pos + j0 + nb;
    int ls = (seen + VL - 1) / VL * VL; /* scores a row: whole vectors (the keys' zero padding) */
    int m = g * nb; /* block rows, query head major: row gi * nb + jj */
    float *qb = mlxcel_scratch(&scratch, ((size_t)m * d * 2 + (size_t)m * ls + m) * sizeof(float));
    float *tmp = qb + (size_t)m * d, *s = tmp + (size_t)m * d, *inv = s + (size_t)m * ls;
    for (int gi = 0; gi < g; gi++)
        for (int jj = 0; jj < nb; jj++) {
            const float *src = a->q + (size_t)(j0 + jj) * hq * d + (size_t)(h * g + gi) * d;
            float *dst = qb + (size_t)(gi * nb + jj) * d;
            for (int i = 0; i < d; i++) dst[i] = src[i] * a->scale;
        }
    rows_nn(m, 0, ls, d, qb, d, a->keys_t + (size_t)h * d * a->ldk, a->ldk, s, ls, 1.0f, 0.0f);
    for (int r = 0; r < m; r++) {
        float *row = s + (size_t)r * ls;
        int visible = a->pos + j0 + r % nb + 1; /* keys [0, visible): causal */
        int first = a->window && visible > a->window ? visible - a->window : 0; /* the window's start */
        const float *sink = a->sinks ? a->sinks + (size_t)h * g + r / nb : NULL;
        inv[r] = 1.0f / exp2_shifted_row_sink(row + first, visible - first, sink);
        memset(row, 0, (size_t)first * sizeof(float));
        memset(row + visible, 0, (size_t)(seen - visible) * sizeof(float));
    }
    const float *values = a->values + h * a->head_stride; /* slots from pos on: the rows, apart or not */
    const float *v_rows = a->v_out ? a->v_out + (size_t)h * a->rows * d : values + (size_t)a->pos * d;
    rows_nn_split(m, 0, d, seen, s, ls, values, d, tmp, d, 1.0f, 0.0f, v_rows, a->pos);
    for (int gi = 0; gi < g; gi++)
        for (int jj = 0; jj < nb; jj++) {
            int r = gi * nb + jj;
            float *dst = a->out + (size_t)(j0 + jj) * hq * d + (size_t)(h * g + gi) * d;
            for (int i = 0; i < d; i++) dst[i] = tmp[(size_t)r * d + i] * inv[r];
        }
}

static void chunk_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                            float *out, float *k_out, float *v_out, int rows, int kv_heads, int group, int d,
                            int pos, long capacity, float scale, int window, const float *sinks) {
    static __thread struct mlxcel_scratch keys_t;
    int blocks = (rows + CHUNK_QUERY_BLOCK - 1) / CHUNK_QUERY_BLOCK;
    int ldk = (pos + rows + VL - 1) / VL * VL;
    if (ldk % 1024 == 0) ldk += VL; /* rows 4 KiB apart share cache sets */
    float *kt = mlxcel_scratch(&keys_t, (size_t)kv_heads * d * ldk * sizeof(float));
    struct chunk_attention_job a = {q, k_new, v_new, keys, values, kt, ldk, out, k_out, v_out, rows, kv_heads,
                                    group, d, pos, blocks, (size_t)capacity * d, scale, window, sinks};
    mlxcel_parallel(kv_heads, chunk_write_head, &a);
    mlxcel_parallel(kv_heads * blocks, chunk_attend_part, &a);
}

/* Causal attention of `rows` consecutive positions from `pos` on: their keys and values written at
 * slots [pos, pos + rows) of the cache first, row r attending slots [0, pos + r]. Returns 0, or -1
 * (touching nothing) if the rows do not fit the capacity. */
int mlxcel_chunk_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                           float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                           float scale) {
    if (rows < 1 || pos < 0 || pos + rows > capacity) return -1;
    chunk_attention(q, k_new, v_new, keys, values, out, NULL, NULL, rows, kv_heads, group, d, pos, capacity, scale, 0,
                    NULL);
    return 0;
}

/* mlxcel_chunk_attention with a sliding window and attention sinks (gpt-oss): row r, at slot
 * pos + r, attends slots [pos + r - window + 1, pos + r] (all before it where window is 0), its
 * query head's sink logit (`sinks`, times log2 e; NULL: none) one more term of the denominator.
 * A window layer's buffer is mlx-lm's RotatingKVCache's after a multi-token update: the newest
 * window - 1 positions in order (pos of them), then the rows (runtime/window_chunks.py). */
int mlxcel_chunk_attention_window(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                                  float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                                  float scale, int window, const float *sinks) {
    if (rows < 1 || pos < 0 || pos + rows > capacity || window < 0) return -1;
    chunk_attention(q, k_new, v_new, keys, values, out, NULL, NULL, rows, kv_heads, group, d, pos, capacity, scale,
                    window, sinks);
    return 0;
}

/* The same over a cache it may not write (a prompt-cache entry another sequence shares): slots
 * [0, pos) of the cache, then the rows, whose keys and values go to k_out and v_out ((Hk, rows, d)
 * each) instead. The same numbers as mlxcel_chunk_attention on a cache holding the same slots.
 * Returns 0, or -1 (touching nothing) if pos is not in [1, capacity]. */
int mlxcel_chunk_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                 const float *values, float *out, float *k_out, float *v_out, int rows,
                                 int kv_heads, int group, int d, int pos, long capacity, float scale) {
    if (rows < 1 || pos < 1 || pos > capacity) return -1;
    chunk_attention(q, k_new, v_new, (float *)keys, (float *)values, out, k_out, v_out, rows, kv_heads, group, d,
                    pos, capacity, scale, 0, NULL);
    return 0;
}
