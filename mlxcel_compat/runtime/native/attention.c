/* The decode-step attention kernels of the CPU decode runtime (mlxcel_compat/runtime/cpu_decode.py,
 * through decode_pass.c's layer loop): a step's attention for every head of a layer (over a growing
 * cache or a sliding window's ring, or over a cache it may not write, its new key and value kept
 * apart, or over shared prompt-cache blocks read in place), a sequence's consecutive draft rows,
 * and Gemma 2's capped attention, the KV heads (and where they are few, their query heads or rows)
 * spread over the shim's thread pool. A prompt chunk's attention is chunk_attention.c's.
 * The scores and the products by the values are the small-M kernel's (small_m_kernel.h); the
 * softmax is a vectorized power of 2 (softmax_rows.h), where MLX's CPU exponential is scalar.
 * The cache's keys and values are float32, f16 or bf16 rows, or ggml's q8_0 or q4_0 blocks
 * (-ctk/-ctv: kv_rows.h): new rows are rounded (quantized) to the type when written; a step's
 * products widen 16-bit rows in registers as they read them, and over blocks dequantize each key
 * row for its dots with the float32 queries (kv_rows.h: kv_block_scores says why not ggml's q8_0
 * query) and add each dequantized value row (as ggml's CPU flash attention does).
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
struct attention_job {
    const float *q;  /* (Hq, d) queries of one position */
    const float *k_new, *v_new; /* (Hk, d) its key and value, written at slot `write` first */
    void *keys, *values;  /* the layer's cache, (Hk, capacity, d) of k_type and v_type */
    void *k_out, *v_out;  /* NULL, or (Hk, d): the new key and value go here, not into the cache
                           * (then read only), and are attended as slot n - 1 */
    float *out;           /* (Hq, d) */
    int group, d;         /* query heads per KV head, head size */
    int write, n;         /* the slot the new key and value go to; keys seen are slots [0, n) */
    size_t head_stride;   /* capacity * d */
    float scale;          /* the softmax scale times log2 e (the exponential is a power of 2) */
    int k_type, v_type;   /* MLXCEL_KV_*: the cache's storage types */
    const float *sinks;   /* NULL, or (Hq): each query head's sink logit times log2 e (gpt-oss) */
    const struct kv_blocks *paged; /* NULL, or the shared blocks before the cache: then the cache
                                    * holds positions from paged->n_blocked on (kv_rows.h) */
    float softcap;        /* Gemma 2's attention soft-cap (soft_cap_row; then `scale` is the plain scale), 0: none */
    int parts;            /* each KV head's query heads in this many parts (attend_heads sets it) */
};

/* Where KV head h's new key (which 0) or value (1) goes: the cache's slot `write` (past the shared
 * blocks' positions), or the row kept apart. */
static char *new_row(const struct attention_job *a, int h, int which) {
    int type = which ? a->v_type : a->k_type, nb = a->paged ? a->paged->n_blocked : 0;
    size_t row = kv_row_bytes(type, a->d);
    void *apart = which ? a->v_out : a->k_out;
    if (apart) return (char *)apart + (size_t)h * row;
    return (char *)(which ? a->values : a->keys) + h * a->head_stride / a->d * row + (size_t)(a->write - nb) * row;
}

/* Part p of a step's attention: KV head p / parts, its query heads [i0, i1) (the group split
 * evenly over the parts). Each query's scores, softmax and value sum are its own, whatever the
 * queries beside it (the row kernels' contract), so a part gives the numbers the whole head would. */
struct head_part {
    int h, i0, n_q;
};

static struct head_part head_part(const struct attention_job *a, int p) {
    int parts = a->parts > 1 ? a->parts : 1, h = p / parts, s = p % parts;
    int i0 = a->group * s / parts, i1 = a->group * (s + 1) / parts;
    return (struct head_part){h, i0, i1 - i0};
}

/* A part's softmax over its queries' score rows (n slots, ldn apart), soft-capped first for
 * Gemma 2, and normalised. */
static void head_softmax(const struct attention_job *a, struct head_part hp, float *scores, int n, size_t ldn) {
    for (int i = 0; i < hp.n_q; i++) {
        float *s = scores + (size_t)i * ldn;
        soft_cap_row(s, n, a->softcap);
        float inv = 1.0f / exp2_shifted_row_sink(s, n, a->sinks ? a->sinks + (size_t)hp.h * a->group + hp.i0 + i : NULL);
        for (int t = 0; t < n; t++) s[t] *= inv;
    }
}

/* Part p of a decode step over float32 keys and values (the new rows already written: attend_heads):
 * for its query heads softmax(q K^T scale) V over slots [0, n). The scores go in one pass over the
 * keys (all the part's queries per key row), the products by the values in one pass over the values. */
static void attend_head(const void *ctx, int p) {
    static __thread struct mlxcel_scratch scratch;
    const struct attention_job *a = ctx;
    struct head_part hp = head_part(a, p);
    int g = hp.n_q, d = a->d, n = a->n, h = hp.h;
    if (g == 0) return;
    float *keys = (float *)a->keys + h * a->head_stride, *values = (float *)a->values + h * a->head_stride;
    const float *k_new = a->k_new + (size_t)h * d, *v_new = a->v_new + (size_t)h * d;
    int apart = a->k_out != NULL;
    float *q = mlxcel_scratch(&scratch, ((size_t)g * d + (size_t)g * n) * sizeof(float));
    float *scores = q + (size_t)g * d;
    const float *q_in = a->q + ((size_t)h * a->group + hp.i0) * d;
    for (int i = 0; i < g * d; i++) q[i] = q_in[i] * a->scale;
    if (apart) { /* each score is its own dot product (hsum4 adds as hsum): the same numbers */
        rows_nt(g, 0, n - 1, d, q, d, keys, d, scores, n, 1.0f, 0.0f);
        rows_nt(g, 0, 1, d, q, d, k_new, d, scores + (n - 1), n, 1.0f, 0.0f);
    } else {
        rows_nt(g, 0, n, d, q, d, keys, d, scores, n, 1.0f, 0.0f);
    }
    head_softmax(a, hp, scores, n, n);
    float *out = a->out + ((size_t)h * a->group + hp.i0) * d;
    rows_nn_split(g, 0, d, n, scores, n, values, d, out, d, 1.0f, 0.0f, apart ? v_new : values, apart ? n - 1 : n);
}

/* A KV head's scores, M scaled float32 queries against key rows [0, n) of any storage type
 * (ldc apart), and its value sum: M rows of weights (ldp apart) over value rows [0, n), those
 * from K1 on read from v2. Each score is its own dot product, and each output sums its rows in
 * order, whatever M: the row kernels' contract (small_m_kernel.h, kv_rows.h). */
static void head_scores(int k_type, int M, int n, int d, const float *q, const void *keys, float *scores, size_t ldc) {
    if (kv_blocks(k_type)) kv_block_scores(k_type, M, n, d, q, (const uint8_t *)keys, scores, ldc);
    else if (k_type == MLXCEL_KV_F32) rows_nt(M, 0, n, d, q, d, (const float *)keys, d, scores, ldc, 1.0f, 0.0f);
    else kv_scores(k_type, M, n, d, q, (const uint16_t *)keys, scores, ldc);
}

static void head_weighted(int v_type, int M, int d, int n, const float *p, size_t ldp, const void *values,
                          const void *v2, int K1, float *out) {
    if (kv_blocks(v_type))
        kv_block_weighted(v_type, M, d, n, p, ldp, (const uint8_t *)values, (const uint8_t *)v2, K1, out);
    else if (v_type == MLXCEL_KV_F32)
        rows_nn_split(M, 0, d, n, p, ldp, (const float *)values, d, out, d, 1.0f, 0.0f, (const float *)v2, K1);
    else
        kv_weighted(v_type, M, d, n, p, ldp, (const uint16_t *)values, (const uint16_t *)v2, K1, out);
}

/* attend_head over 16-bit keys or values (or blocks): the same scores, softmax and products, the
 * 16-bit rows widened in registers as the products read them (kv_rows.h). A step on a cache it may
 * not write reads its new rows apart and gives the same numbers as on its own (each score its own
 * dot product; the values' rows summed in order, the last one from the row kept apart). */
static void attend_head_kv(const void *ctx, int p) {
    static __thread struct mlxcel_scratch scratch;
    const struct attention_job *a = ctx;
    struct head_part hp = head_part(a, p);
    int g = hp.n_q, d = a->d, n = a->n, h = hp.h, apart = a->k_out != NULL;
    if (g == 0) return;
    char *keys = (char *)a->keys + h * a->head_stride / d * kv_row_bytes(a->k_type, d);
    char *values = (char *)a->values + h * a->head_stride / d * kv_row_bytes(a->v_type, d);
    char *k_dst = new_row(a, h, 0), *v_dst = new_row(a, h, 1);
    float *q = mlxcel_scratch(&scratch, ((size_t)g * d + (size_t)g * n) * sizeof(float));
    float *scores = q + (size_t)g * d;
    const float *q_in = a->q + ((size_t)h * a->group + hp.i0) * d;
    for (int i = 0; i < g * d; i++) q[i] = q_in[i] * a->scale;
    int shared = apart ? n - 1 : n; /* slots read from the cache; the last one apart after them */
    head_scores(a->k_type, g, shared, d, q, keys, scores, n); /* block keys: each row dequantized */
    if (apart) head_scores(a->k_type, g, 1, d, q, k_dst, scores + n - 1, n);
    head_softmax(a, hp, scores, n, n);
    head_weighted(a->v_type, g, d, n, scores, n, values, v_dst, shared, a->out + ((size_t)h * a->group + hp.i0) * d);
}

/* attend_head over a span (kv_rows.h): the shared blocks read in place, then the cache's own rows
 * (position t at row t - n_blocked), then the row kept apart; any storage type (block keys and
 * values as attend_head_kv reads them: each key row dequantized for the float32 queries, the
 * value rows dequantized in order). The same scores, softmax and products, so the same numbers as
 * over one buffer holding the same rows. */
static void attend_head_span(const void *ctx, int p) {
    static __thread struct mlxcel_scratch scratch;
    const struct attention_job *a = ctx;
    const struct kv_blocks *b = a->paged;
    struct head_part hp = head_part(a, p);
    int g = hp.n_q, d = a->d, n = a->n, h = hp.h, nb = b->n_blocked, apart = a->k_out != NULL;
    if (g == 0) return;
    size_t k_row = kv_row_bytes(a->k_type, d), v_row = kv_row_bytes(a->v_type, d);
    char *keys = (char *)a->keys + h * a->head_stride / d * k_row;
    char *values = (char *)a->values + h * a->head_stride / d * v_row;
    char *k_dst = new_row(a, h, 0), *v_dst = new_row(a, h, 1);
    size_t run_bytes = ((size_t)(nb / b->block_tokens + 2) * sizeof(struct kv_run) + 63) / 64 * 64;
    char *mem = mlxcel_scratch(&scratch, run_bytes + ((size_t)g * d + (size_t)g * n) * sizeof(float));
    struct kv_run *runs = (struct kv_run *)mem;
    float *q = (float *)(mem + run_bytes), *scores = q + (size_t)g * d;
    const float *q_in = a->q + ((size_t)h * a->group + hp.i0) * d;
    for (int i = 0; i < g * d; i++) q[i] = q_in[i] * a->scale;
    int own_n = (apart ? n - 1 : n) - nb;
    int n_runs = kv_head_runs(runs, b, 0, k_row, h, keys, own_n, k_dst, apart);
    if (kv_blocks(a->k_type)) /* block keys: each row dequantized, the scaled float32 queries */
        kv_span_block_scores(a->k_type, g, d, runs, n_runs, q, scores, n);
    else
        kv_span_scores(a->k_type, g, d, runs, n_runs, q, scores, n);
    head_softmax(a, hp, scores, n, n);
    float *out = a->out + ((size_t)h * a->group + hp.i0) * d;
    n_runs = kv_head_runs(runs, b, 1, v_row, h, values, own_n, v_dst, apart);
    if (kv_blocks(a->v_type))
        kv_span_block_weighted(a->v_type, g, d, runs, n_runs, scores, n, out);
    else
        kv_span_weighted(a->v_type, g, d, runs, n_runs, scores, n, out);
}

/* How many parts to cut each of `heads` KV heads' work into (a power of two, at most `most`) on
 * `threads` threads, the pool's threads claiming parts as they free up. Each doubling must cut the
 * busiest thread's work, ceil(heads x parts / threads) / parts of a head, by a quarter or more,
 * because each part reads its head's keys and values again: SmolLM2's 3 heads on 2 threads go in
 * 6 parts (a thread's work 2 heads -> 1.5), Gemma 3's 1 in 2, 8 on 16 threads in 16, but 8 on 12
 * threads stay 8 (16 parts leave a thread a whole head's work all the same). */
static int thread_parts(int heads, int most, int threads) {
    int parts = 1;
    while (2 * parts <= most) {
        long now = ((long)heads * parts + threads - 1) / threads, next = (2L * heads * parts + threads - 1) / threads;
        if (2 * next > 3 * now) break; /* next / (2 parts) > 3/4 of now / parts */
        parts *= 2;
    }
    return parts;
}

/* Every KV head's new key and value written (rounded to their types) on the calling thread, then
 * the parts spread over the pool (thread_parts). Why the parts: with fewer KV heads than a whole number of
 * threads' worth (SmolLM2's 3 on 2 threads, Gemma 3's 1) the heads alone left a thread idle for a
 * third to half of every layer's attention; each head's queries are then split in two (or more),
 * each part reading the head's keys and values for its own queries. */
static void attend_heads(struct attention_job *a, int kv_heads) {
    for (int h = 0; h < kv_heads; h++) {
        kv_narrow(a->k_type, new_row(a, h, 0), a->k_new + (size_t)h * a->d, a->d);
        kv_narrow(a->v_type, new_row(a, h, 1), a->v_new + (size_t)h * a->d, a->d);
    }
    a->parts = thread_parts(kv_heads, a->group, mlxcel_threads());
    int plain = a->k_type == MLXCEL_KV_F32 && a->v_type == MLXCEL_KV_F32;
    mlxcel_parallel(kv_heads * a->parts, a->paged ? attend_head_span : plain ? attend_head : attend_head_kv, a);
}

/* A decode step's attention for every KV head of one layer, the heads spread over the pool: the
 * new key and value written at slot `write`, the queries attending slots [0, n) of the cache's
 * `capacity`. A growing cache writes at its position and sees everything before it (write = pos,
 * n = pos + 1); a sliding window's ring (mlx-lm's RotatingKVCache) writes over its oldest slot
 * once full and sees every slot, in the ring's order (the softmax does not depend on it).
 * Returns 0, or -1 (and touches nothing) if the slot or the length does not fit the capacity. */
int mlxcel_decode_attention_at(const float *q, const float *k_new, const float *v_new, void *keys,
                               void *values, float *out, int kv_heads, int group, int d, int write, int n,
                               long capacity, float scale, int k_type, int v_type) {
    if (write < 0 || write >= capacity || n < 1 || n > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, keys, values, NULL, NULL, out, group, d, write, n, (size_t)capacity * d, scale,
                              k_type, v_type};
    attend_heads(&a, kv_heads);
    return 0;
}

/* Consecutive decode rows of one sequence on one layer (a speculative draft's, a prompt's short
 * rest: CpuDecoder.step_tokens): row j writes its key and value at slot write + j and attends
 * slots [0, n + j). Each KV head's keys are read once for all the rows' queries (a row alone read
 * them all again), and every row gets its single step's numbers: each score is its own dot
 * product whatever the rows beside it, and each row's softmax and value sum take its own slots
 * in their order (the values are read row by row). The cache's own buffer, no sinks or soft-cap. */
struct rows_job {
    struct attention_job a; /* row 0's q, k_new, v_new, out, write and n */
    int rows, hq;           /* rows; query heads (a row's stride in q and out: hq * d; in k_new: hq / group * d) */
    int blocks;             /* each head's rows in this many parts (part p: head p / blocks) */
};

/* KV head h's new keys and values, rounded to their types, into the cache (before any part reads:
 * on the calling thread, a few thousand values, cheaper than waking the pool for them). */
static void write_head_rows(const struct rows_job *job, int h) {
    const struct attention_job *a = &job->a;
    int d = a->d, hk = job->hq / a->group;
    size_t k_row = kv_row_bytes(a->k_type, d), v_row = kv_row_bytes(a->v_type, d);
    char *keys = (char *)a->keys + h * a->head_stride / d * k_row;
    char *values = (char *)a->values + h * a->head_stride / d * v_row;
    for (int j = 0; j < job->rows; j++) {
        kv_narrow(a->k_type, keys + (size_t)(a->write + j) * k_row, a->k_new + ((size_t)j * hk + h) * d, d);
        kv_narrow(a->v_type, values + (size_t)(a->write + j) * v_row, a->v_new + ((size_t)j * hk + h) * d, d);
    }
}

/* Part p: KV head p / blocks, its rows [r0, r1) (the rows split evenly over the blocks). */
static void attend_head_rows(const void *ctx, int part) {
    static __thread struct mlxcel_scratch scratch;
    const struct rows_job *job = ctx;
    const struct attention_job *a = &job->a;
    int h = part / job->blocks, blk = part % job->blocks;
    int r0 = job->rows * blk / job->blocks, r1 = job->rows * (blk + 1) / job->blocks;
    int g = a->group, d = a->d, R = r1 - r0, hq = job->hq, span = a->n + r1 - 1;
    size_t k_row = kv_row_bytes(a->k_type, d), v_row = kv_row_bytes(a->v_type, d);
    char *keys = (char *)a->keys + h * a->head_stride / d * k_row;
    char *values = (char *)a->values + h * a->head_stride / d * v_row;
    if (R == 0) return;
    float *q = mlxcel_scratch(&scratch, ((size_t)g * R * d + (size_t)g * R * span) * sizeof(float));
    float *scores = q + (size_t)g * R * d;
    for (int j = 0; j < R; j++)
        for (int i = 0; i < g * d; i++)
            q[(size_t)j * g * d + i] = a->q[(size_t)(r0 + j) * hq * d + (size_t)h * g * d + i] * a->scale;
    head_scores(a->k_type, g * R, span, d, q, keys, scores, span);
    for (int j = 0; j < R; j++) {
        int n = a->n + r0 + j;
        float *p = scores + (size_t)j * g * span, *out = a->out + (size_t)(r0 + j) * hq * d + (size_t)h * g * d;
        for (int i = 0; i < g; i++) {
            float *s = p + (size_t)i * span;
            float inv = 1.0f / exp2_shifted_row_sink(s, n, NULL);
            for (int t = 0; t < n; t++) s[t] *= inv;
        }
        head_weighted(a->v_type, g, d, n, p, span, values, values, n, out);
    }
}

/* The attention of `rows` consecutive decode rows of one sequence (attend_head_rows): q and out
 * (rows, Hq * d), k_new and v_new (rows, Hk * d), row j writing slot write + j and attending
 * slots [0, n + j). Returns 0, or -1 (touching nothing) if the last row does not fit. */
int mlxcel_decode_attention_rows(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                 float *out, int rows, int kv_heads, int group, int d, int write, int n, long capacity,
                                 float scale, int k_type, int v_type) {
    if (rows < 1 || write < 0 || write + rows > capacity || n < 1 || n + rows - 1 > capacity) return -1;
    /* Few KV heads for the threads (SmolLM2's 3 on 2 threads left one idle a third of the time):
     * each head's rows in parts too (thread_parts), at least 2 rows a part. A part reads its
     * head's keys for its own rows' slots only; a row's numbers do not depend on the parts. */
    int blocks = thread_parts(kv_heads, rows / 2, mlxcel_threads());
    struct rows_job job = {{q, k_new, v_new, keys, values, NULL, NULL, out, group, d, write, n, (size_t)capacity * d,
                            scale, k_type, v_type}, rows, kv_heads * group, blocks};
    for (int h = 0; h < kv_heads; h++) write_head_rows(&job, h);
    mlxcel_parallel(kv_heads * blocks, attend_head_rows, &job);
    return 0;
}

/* A decode step's attention over a cache it may not write (a prompt-cache entry another sequence
 * shares): slots [0, n_base) of the cache, then the new key and value, which go to k_out and
 * v_out ((Hk, d) each) instead. The same numbers as mlxcel_decode_attention at pos = n_base on a
 * cache holding the same slots. Returns 0, or -1 (touching nothing) if n_base is not in
 * [1, capacity]. */
int mlxcel_decode_attention_apart(const float *q, const float *k_new, const float *v_new, const void *keys,
                                  const void *values, float *out, void *k_out, void *v_out, int kv_heads,
                                  int group, int d, int n_base, long capacity, float scale, int k_type, int v_type) {
    if (n_base < 1 || n_base > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, (void *)keys, (void *)values, k_out, v_out, out, group, d,
                              n_base, n_base + 1, (size_t)capacity * d, scale, k_type, v_type};
    attend_heads(&a, kv_heads);
    return 0;
}

/* Either of the two above (k_out NULL: mlxcel_decode_attention_at, else _apart at n_base = write)
 * with attention sinks (gpt-oss): `sinks` (Hq) are each query head's sink logit times log2 e,
 * one more term of the softmax's denominator (mlx's scaled_dot_product_attention's `sinks`); keys and
 * values of k_type and v_type as the others'. */
int mlxcel_decode_attention_sinks(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, void *k_out, void *v_out, int kv_heads, int group, int d, int write,
                                  int n, long capacity, float scale, const float *sinks, int k_type, int v_type) {
    if (k_out ? write < 1 || write > capacity : write < 0 || write >= capacity || n < 1 || n > capacity) return -1;
    struct attention_job a = {q, k_new, v_new, keys, values, k_out, v_out, out, group, d, write,
                              k_out ? write + 1 : n, (size_t)capacity * d, scale, k_type, v_type, sinks};
    attend_heads(&a, kv_heads);
    return 0;
}

/* The growing cache's case of the above: write at `pos`, attend [0, pos] (the caller keeps
 * pos < capacity). */
void mlxcel_decode_attention(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                             float *out, int kv_heads, int group, int d, int pos, long capacity, float scale,
                             int k_type, int v_type) {
    mlxcel_decode_attention_at(q, k_new, v_new, keys, values, out, kv_heads, group, d, pos, pos + 1, capacity, scale,
                               k_type, v_type);
}

/* A decode step's attention on a cache that starts with shared blocks (a prompt-cache hit read in
 * place: kv_rows.h's struct kv_blocks): positions [0, n_blocked) from `blocks` (n_blocked /
 * block_tokens blocks' keys, then as many blocks' values), the cache holding positions from
 * n_blocked on; the new key and value written at position `pos` (row pos - n_blocked), attending
 * [0, pos]. `sinks` as in mlxcel_decode_attention_sinks (NULL: none). Returns 0, or -1 (touching
 * nothing) if the positions do not fit. */
int mlxcel_decode_attention_paged(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, int kv_heads, int group, int d, int pos, long capacity, float scale,
                                  int k_type, int v_type, const float *sinks, const void *const *blocks,
                                  int n_blocked, int block_tokens) {
    if (block_tokens < 1 || n_blocked < 0 || n_blocked % block_tokens || (n_blocked && !blocks) || pos < n_blocked ||
        pos - n_blocked >= capacity)
        return -1;
    struct kv_blocks b = {blocks, n_blocked, block_tokens};
    struct attention_job a = {q, k_new, v_new, keys, values, NULL, NULL, out, group, d, pos, pos + 1,
                              (size_t)capacity * d, scale, k_type, v_type, sinks, &b};
    attend_heads(&a, kv_heads);
    return 0;
}

/* ------------------------------------------------------------------ attention logit soft-capping
 * Gemma 2's attention (mlx-lm's gemma2.py): the queries times the plain softmax `scale`, each
 * score q.k then tanh(score / softcap) * softcap before the mask and the softmax. One entry for a
 * decode step and one for a prompt chunk (chunk_attention.c), each taking every form the others take (a cache it may
 * not write: k_out set; shared blocks: n_blocked > 0; a sliding window; sinks), so the decode pass
 * has one call for a capped model whatever its cache. softcap 0 gives the others' numbers only
 * with `scale` times log2 e, as theirs. */

/* A decode step: as mlxcel_decode_attention_paged (n_blocked > 0), else _apart at n_base = write
 * (k_out set), else _at; `sinks` NULL or as _sinks's. Returns 0, or -1 (touching nothing). */
int mlxcel_decode_attention_capped(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                   float *out, void *k_out, void *v_out, int kv_heads, int group, int d, int write,
                                   int n, long capacity, float scale, int k_type, int v_type, const float *sinks,
                                   const void *const *blocks, int n_blocked, int block_tokens, float softcap) {
    struct kv_blocks b = {blocks, n_blocked, block_tokens};
    if (n_blocked > 0) {
        if (block_tokens < 1 || n_blocked % block_tokens || !blocks || k_out || write < n_blocked ||
            write - n_blocked >= capacity)
            return -1;
        n = write + 1;
    } else if (k_out ? write < 1 || write > capacity : write < 0 || write >= capacity || n < 1 || n > capacity) {
        return -1;
    }
    struct attention_job a = {q, k_new, v_new, keys, values, k_out, v_out, out, group, d, write,
                              k_out ? write + 1 : n, (size_t)capacity * d, scale, k_type, v_type, sinks,
                              n_blocked > 0 ? &b : NULL, softcap};
    attend_heads(&a, kv_heads);
    return 0;
}

