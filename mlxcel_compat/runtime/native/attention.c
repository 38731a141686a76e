/* The attention kernels of the CPU decode runtime (mlxcel_compat/runtime/cpu_decode.py, through
 * decode_pass.c's layer loop): a decode step's attention for every head of a layer (over a growing
 * cache or a sliding window's ring, or over a cache it may not write, its new key and value kept
 * apart) and a prompt chunk's causal attention, the KV heads spread over the shim's thread pool.
 * The scores and the products by the values are the small-M kernel's (small_m_kernel.h); the
 * softmax is a vectorized power of 2 (vector_math.h), where MLX's CPU exponential is scalar.
 * The cache's keys and values are float32, f16 or bf16 rows, or ggml's q8_0 or q4_0 blocks
 * (-ctk/-ctv: kv_rows.h): new rows are rounded (quantized) to the type when written; a step's
 * products widen 16-bit rows in registers as they read them, and over blocks dequantize each key
 * row for its dots with the float32 queries (kv_rows.h: kv_block_scores says why not ggml's q8_0
 * query) and add each dequantized value row (as ggml's CPU flash attention does); a prompt chunk
 * widens (dequantizes) each head's rows once into its float32 scratch.
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "decode_kernels.h"
#include "kv_rows.h"
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

/* Gemma 2's attention logit soft-capping, as mlx-lm's gemma2.py computes it: s[t] = tanh(s[t] / cap)
 * * cap for t < n, then times log2 e for the powers of 2 (the kernels given a cap form the scores
 * with the plain softmax scale, so the cap sees the score mlx-lm's does). cap 0: nothing (every
 * other family: the scale already holds log2 e). */
static void soft_cap_row(float *s, int n, float cap) {
    if (cap == 0.0f) return;
    for (int t = 0; t < n; t++) s[t] = tanhf(s[t] / cap) * cap * 1.4426950408889634f;
}

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

/* Every KV head's new key and value written (rounded to their types) on the calling thread, then
 * the parts spread over the pool. Why the parts: with fewer KV heads than a whole number of
 * threads' worth (SmolLM2's 3 on 2 threads, Gemma 3's 1) the heads alone left a thread idle for a
 * third to half of every layer's attention; each head's queries are then split in two (or more),
 * each part reading the head's keys and values for its own queries. */
static void attend_heads(struct attention_job *a, int kv_heads) {
    for (int h = 0; h < kv_heads; h++) {
        kv_narrow(a->k_type, new_row(a, h, 0), a->k_new + (size_t)h * a->d, a->d);
        kv_narrow(a->v_type, new_row(a, h, 1), a->v_new + (size_t)h * a->d, a->d);
    }
    int threads = mlxcel_threads();
    a->parts = 1;
    while ((kv_heads * a->parts) % threads && 2 * a->parts <= a->group) a->parts *= 2;
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
    /* Fewer KV heads than twice the threads (SmolLM2's 3 on 2 threads left one idle half the
     * time): each head's rows in parts too, at least 2 rows a part. A part reads its head's keys
     * for its own rows' slots only; a row's numbers do not depend on the parts. */
    int threads = mlxcel_threads(), blocks = 1;
    while (kv_heads * blocks < 2 * threads && rows / (2 * blocks) >= 2) blocks *= 2;
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
    float softcap;         /* as struct attention_job's, 0: none */
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

/* ------------------------------------------------------------------ attention logit soft-capping
 * Gemma 2's attention (mlx-lm's gemma2.py): the queries times the plain softmax `scale`, each
 * score q.k then tanh(score / softcap) * softcap before the mask and the softmax. One entry for a
 * decode step and one for a prompt chunk, each taking every form the others take (a cache it may
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
