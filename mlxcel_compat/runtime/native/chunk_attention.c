/* The CPU decode runtime's prompt-chunk attention (CpuDecoder.prefill, through decode_pass.c):
 * a chunk's causal attention over the cache (a growing cache, a sliding window's, a cache it may
 * not write with the chunk's rows kept apart, shared prompt-cache blocks read in place; sinks and
 * Gemma 2's soft-cap), each KV head's keys transposed once, both products vectorized over their
 * outputs, the parts (KV head, query block) spread over the shim's thread pool. A decode step's
 * attention is attention.c's. The cache's rows of any storage type (-ctk/-ctv: kv_rows.h) are
 * written rounded to it and widened (dequantized) once per head into float32 scratch.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "decode_kernels.h"
#include "kv_rows.h"
#include "small_m_kernel.h"
#include "softmax_rows.h"
#include "thread_pool.h"
#include "vector_math.h"

/* ------------------------------------------------------------------------- prompt-chunk attention
 * A short prompt chunk fed through the CPU decode runtime (a cache hit's rest, CpuDecoder.prefill):
 * `rows` consecutive positions of one sequence, from `pos` on. Row by row the decode kernel (attention.c)
 * would read every key and value once per row; here each KV head's keys are read once per block of
 * CHUNK_QUERY_BLOCK queries, both products vectorized over their output columns (the keys
 * transposed once per head), and the parts (KV head, query block) spread over the pool. */

#define CHUNK_QUERY_BLOCK 16

struct chunk_attention_job {
    const float *q;        /* (rows, Hq * d), RoPE applied */
    const float *k_new, *v_new; /* (rows, Hk * d) */
    void *keys, *values;   /* the layer's cache, (Hk, capacity, d) of k_type and v_type */
    float *keys_t;         /* scratch: (Hk, d, ldk), each head's keys transposed, zeros after pos + rows */
    int ldk;               /* pos + rows rounded up to whole vectors, off multiples of 4 KiB */
    float *out;            /* (rows, Hq * d) */
    void *k_out, *v_out;   /* NULL, or (Hk, rows, d): the rows' keys and values go here, not into
                            * the cache (then read only, slots [0, pos) valid) */
    int rows, kv_heads, group, d, pos, blocks;
    int window;            /* a sliding window's length (row r sees its last `window` positions), 0: none */
    size_t head_stride;    /* capacity * d */
    float scale;           /* the softmax scale times log2 e */
    int k_type, v_type;    /* MLXCEL_KV_*: the cache's storage types */
    float *values_f;       /* 16-bit values: scratch (Hk, pos + rows, d), each head's widened; else NULL */
    const float *sinks;    /* NULL, or (Hq) sink logits times log2 e (gpt-oss) */
    const struct kv_blocks *paged; /* NULL, or the shared blocks before the cache (then values_f is set) */
    float softcap;         /* Gemma 2's attention soft-cap (soft_cap_row; then `scale` is the plain scale), 0: none */
};

/* KV head h: write the chunk's keys and values into the cache (or apart), then transpose the
 * head's keys. */
static void chunk_write_head(const void *ctx, int h) {
    static __thread struct mlxcel_scratch widened, run_scratch;
    const struct chunk_attention_job *a = ctx;
    int d = a->d, hk = a->kv_heads, n = a->pos + a->rows, nb = a->paged ? a->paged->n_blocked : 0;
    size_t k_row = kv_row_bytes(a->k_type, d), v_row = kv_row_bytes(a->v_type, d);
    char *keys = (char *)a->keys + h * a->head_stride / d * k_row;
    char *values = (char *)a->values + h * a->head_stride / d * v_row;
    char *k_rows = a->k_out ? (char *)a->k_out + (size_t)h * a->rows * k_row : keys + (size_t)(a->pos - nb) * k_row;
    char *v_rows = a->v_out ? (char *)a->v_out + (size_t)h * a->rows * v_row : values + (size_t)(a->pos - nb) * v_row;
    for (int r = 0; r < a->rows; r++) {
        kv_narrow(a->k_type, k_rows + (size_t)r * k_row, a->k_new + ((size_t)r * hk + h) * d, d);
        kv_narrow(a->v_type, v_rows + (size_t)r * v_row, a->v_new + ((size_t)r * hk + h) * d, d);
    }
    /* slots [0, pos): the blocks and the own rows; then the chunk's rows, in the cache or apart */
    int own_n = a->k_out ? a->pos - nb : n - nb, apart_n = a->k_out ? a->rows : 0;
    struct kv_run *runs = mlxcel_scratch(&run_scratch, sizeof(struct kv_run) * (size_t)(nb / (a->paged ? a->paged->block_tokens : 1) + 2));
    int n_runs = kv_head_runs(runs, a->paged, 0, k_row, h, keys, own_n, k_rows, apart_n);
    int ldk = a->ldk;
    float *kt = a->keys_t + (size_t)h * d * ldk;
    float *row = a->k_type == MLXCEL_KV_F32 ? NULL : mlxcel_scratch(&widened, (size_t)d * sizeof(float));
    for (int r = 0, t = 0; r < n_runs; r++)
        for (int j = 0; j < runs[r].n; j++, t++) {
            const char *stored = runs[r].rows + (size_t)j * k_row;
            const float *key = (const float *)stored;
            if (row) kv_widen(a->k_type, stored, row, d), key = row;
            for (int i = 0; i < d; i++) kt[(size_t)i * ldk + t] = key[i];
        }
    for (int i = 0; i < d; i++) memset(kt + (size_t)i * ldk + n, 0, (size_t)(ldk - n) * sizeof(float));
    if (a->values_f) {
        n_runs = kv_head_runs(runs, a->paged, 1, v_row, h, values, own_n, v_rows, apart_n);
        kv_span_widen(a->v_type, runs, n_runs, d, a->values_f + (size_t)h * n * d);
    }
}

/* Part p = (KV head, query block): the block's queries of the head's group against the keys up to
 * the block's last position, causally masked (and to the window's length: row r sees slots
 * [pos + r + 1 - window, pos + r]), softmax (shifted by the row's maximum), times the values; the
 * output normalised by each row's sum. Scores and products start at the block's first visible
 * slot, rounded down to a whole vector: slots before it are never read. */
static void chunk_attend_part(const void *ctx, int p) {
    static __thread struct mlxcel_scratch scratch;
    const struct chunk_attention_job *a = ctx;
    int h = p / a->blocks, j0 = (p % a->blocks) * CHUNK_QUERY_BLOCK;
    int nb = a->rows - j0 < CHUNK_QUERY_BLOCK ? a->rows - j0 : CHUNK_QUERY_BLOCK;
    int g = a->group, d = a->d, hq = a->kv_heads * g, seen = a->pos + j0 + nb;
    int first = a->window && a->pos + j0 + 1 > a->window ? a->pos + j0 + 1 - a->window : 0;
    first = first / VL * VL; /* the keys_t columns are aligned on whole vectors */
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
    rows_nn(m, first, ls, d, qb, d, a->keys_t + (size_t)h * d * a->ldk, a->ldk, s, ls, 1.0f, 0.0f);
    for (int r = 0; r < m; r++) {
        float *row = s + (size_t)r * ls;
        int visible = a->pos + j0 + r % nb + 1; /* keys [lo, visible): causal, within the window */
        int lo = a->window && visible > a->window ? visible - a->window : 0;
        const float *sink = a->sinks ? a->sinks + (size_t)h * g + r / nb : NULL; /* row r: query head r / nb */
        soft_cap_row(row + lo, visible - lo, a->softcap);
        inv[r] = 1.0f / exp2_shifted_row_sink(row + lo, visible - lo, sink);
        memset(row + first, 0, (size_t)(lo - first) * sizeof(float));
        memset(row + visible, 0, (size_t)(seen - visible) * sizeof(float));
    }
    const float *values, *v_rows; /* slots from pos on: the rows, apart or not */
    if (a->values_f) {
        values = v_rows = a->values_f + (size_t)h * (a->pos + a->rows) * d;
        v_rows += (size_t)a->pos * d;
    } else {
        values = (const float *)a->values + h * a->head_stride;
        v_rows = a->v_out ? (const float *)a->v_out + (size_t)h * a->rows * d : values + (size_t)a->pos * d;
    }
    if (first < a->pos)
        rows_nn_split(m, 0, d, seen - first, s + first, ls, values + (size_t)first * d, d, tmp, d, 1.0f, 0.0f, v_rows,
                      a->pos - first);
    else
        rows_nn(m, 0, d, seen - first, s + first, ls, v_rows + (size_t)(first - a->pos) * d, d, tmp, d, 1.0f, 0.0f);
    for (int gi = 0; gi < g; gi++)
        for (int jj = 0; jj < nb; jj++) {
            int r = gi * nb + jj;
            float *dst = a->out + (size_t)(j0 + jj) * hq * d + (size_t)(h * g + gi) * d;
            for (int i = 0; i < d; i++) dst[i] = tmp[(size_t)r * d + i] * inv[r];
        }
}

static void chunk_attention(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                            float *out, void *k_out, void *v_out, int rows, int kv_heads, int group, int d,
                            int pos, long capacity, float scale, int k_type, int v_type, int window,
                            const float *sinks, const struct kv_blocks *paged, float softcap) {
    static __thread struct mlxcel_scratch keys_t, values_f;
    int blocks = (rows + CHUNK_QUERY_BLOCK - 1) / CHUNK_QUERY_BLOCK;
    int ldk = (pos + rows + VL - 1) / VL * VL;
    if (ldk % 1024 == 0) ldk += VL; /* rows 4 KiB apart share cache sets */
    float *kt = mlxcel_scratch(&keys_t, (size_t)kv_heads * d * ldk * sizeof(float));
    float *vf = v_type == MLXCEL_KV_F32 && !paged ? NULL /* a span's values: laid out in order once */
        : mlxcel_scratch(&values_f, (size_t)kv_heads * (pos + rows) * d * sizeof(float));
    struct chunk_attention_job a = {q, k_new, v_new, keys, values, kt, ldk, out, k_out, v_out, rows, kv_heads,
                                    group, d, pos, blocks, window, (size_t)capacity * d, scale, k_type, v_type, vf, sinks,
                                    paged, softcap};
    mlxcel_parallel(kv_heads, chunk_write_head, &a);
    mlxcel_parallel(kv_heads * blocks, chunk_attend_part, &a);
}

/* Causal attention of `rows` consecutive positions from `pos` on: their keys and values written at
 * slots [pos, pos + rows) of the cache first, row r attending slots [0, pos + r]. Returns 0, or -1
 * (touching nothing) if the rows do not fit the capacity. */
int mlxcel_chunk_attention(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                           float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                           float scale, int k_type, int v_type) {
    if (rows < 1 || pos < 0 || pos + rows > capacity) return -1;
    chunk_attention(q, k_new, v_new, keys, values, out, NULL, NULL, rows, kv_heads, group, d, pos, capacity, scale,
                    k_type, v_type, 0, NULL, NULL, 0.0f);
    return 0;
}

/* The same within a sliding window (gemma3's and gpt-oss's sliding layers, as mlx-lm's windowed
 * causal mask has it) and with attention sinks (gpt-oss): row r attends slots
 * [max(0, pos + r + 1 - window), pos + r] (window 0: all of [0, pos + r], a full layer with sinks),
 * its query head's sink logit (`sinks`, times log2 e; NULL: none) one more term of the softmax's
 * denominator. The slots are positions in order (the caller lays a ring's newest slots out before
 * the chunk's: decode_pass.c's ring_chunk, ring_chunks.py). */
int mlxcel_chunk_attention_window(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                                  float scale, int k_type, int v_type, int window, const float *sinks) {
    if (rows < 1 || pos < 0 || pos + rows > capacity || window < 0) return -1;
    chunk_attention(q, k_new, v_new, keys, values, out, NULL, NULL, rows, kv_heads, group, d, pos, capacity, scale,
                    k_type, v_type, window, sinks, NULL, 0.0f);
    return 0;
}

/* The same over a cache it may not write (a prompt-cache entry another sequence shares): slots
 * [0, pos) of the cache, then the rows, whose keys and values go to k_out and v_out ((Hk, rows, d)
 * each) instead. The same numbers as mlxcel_chunk_attention on a cache holding the same slots.
 * Returns 0, or -1 (touching nothing) if pos is not in [1, capacity]. */
int mlxcel_chunk_attention_apart(const float *q, const float *k_new, const float *v_new, const void *keys,
                                 const void *values, float *out, void *k_out, void *v_out, int rows,
                                 int kv_heads, int group, int d, int pos, long capacity, float scale, int k_type,
                                 int v_type) {
    if (rows < 1 || pos < 1 || pos > capacity) return -1;
    chunk_attention(q, k_new, v_new, (void *)keys, (void *)values, out, k_out, v_out, rows, kv_heads, group, d,
                    pos, capacity, scale, k_type, v_type, 0, NULL, NULL, 0.0f);
    return 0;
}

/* Causal attention of `rows` positions from `pos` on, on a cache that starts with shared blocks
 * (as mlxcel_decode_attention_paged): their keys and values written at rows pos - n_blocked on of
 * the cache, row r attending [0, pos + r] (window and sinks as mlxcel_chunk_attention_window's;
 * 0 and NULL: none). Returns 0, or -1 (touching nothing) if the rows do not fit. */
int mlxcel_chunk_attention_paged(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                 float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                                 float scale, int k_type, int v_type, int window, const float *sinks,
                                 const void *const *blocks, int n_blocked, int block_tokens) {
    if (rows < 1 || block_tokens < 1 || n_blocked < 0 || n_blocked % block_tokens || (n_blocked && !blocks) ||
        pos < n_blocked || pos - n_blocked + rows > capacity || window < 0)
        return -1;
    struct kv_blocks b = {blocks, n_blocked, block_tokens};
    chunk_attention(q, k_new, v_new, keys, values, out, NULL, NULL, rows, kv_heads, group, d, pos, capacity, scale,
                    k_type, v_type, window, sinks, &b, 0.0f);
    return 0;
}

/* Gemma 2's capped attention for a prompt chunk (attention.c says what the cap does, with the
 * decode step's entry). */
/* A prompt chunk: as mlxcel_chunk_attention_paged (n_blocked > 0), else _apart (k_out set), else
 * _window (window 0: causal over everything); `sinks` NULL or as _window's. Returns 0, or -1
 * (touching nothing). */
int mlxcel_chunk_attention_capped(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, void *k_out, void *v_out, int rows, int kv_heads, int group, int d,
                                  int pos, long capacity, float scale, int k_type, int v_type, int window,
                                  const float *sinks, const void *const *blocks, int n_blocked, int block_tokens,
                                  float softcap) {
    struct kv_blocks b = {blocks, n_blocked, block_tokens};
    if (rows < 1 || window < 0) return -1;
    if (n_blocked > 0) {
        if (block_tokens < 1 || n_blocked % block_tokens || !blocks || k_out || pos < n_blocked ||
            pos - n_blocked + rows > capacity)
            return -1;
    } else if (k_out ? pos < 1 || pos > capacity : pos < 0 || pos + rows > capacity) {
        return -1;
    }
    chunk_attention(q, k_new, v_new, keys, values, out, k_out, v_out, rows, kv_heads, group, d, pos, capacity, scale,
                    k_type, v_type, window, sinks, n_blocked > 0 ? &b : NULL, softcap);
    return 0;
}
