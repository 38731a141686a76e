/* Products of float32 activations with weights kept in ggml's block formats (the quantized GGUF
 * types, F16 and BF16), on the CPU, without ever expanding a whole weight to float32.
 *
 * The per-type arithmetic is ggml's own: mlxcel_compat/runtime/ggml_cpu.py loads ggml's CPU library
 * (the PyPI wheel libggml-python) and hands over, per type, the function pointers of its public
 * type traits (ggml-cpu.h: vec_dot and the activations' from_float; ggml.h: to_float). This file
 * only decides how a product is cut up and run:
 *
 *   - few rows (decode steps, batched decode): each activation row is quantized once to the
 *     weight type's vec_dot_type (Q8_0, Q8_1, Q8_K, F16 or BF16, as llama.cpp does), then every
 *     output is one vec_dot of a weight row with it; a weight row is read once for all the rows
 *     (it stays in L1 meanwhile), and the weight rows are spread over the shim's thread pool;
 *   - many rows (prompt chunks): where the type has a lane kernel of this library's (Q8_0 rows
 *     stored apart; Q4_1, Q5_0, Q5_1 and MXFP4 rows split at load; Q4_K, Q6_K, Q8_0, Q4_1, Q5_0,
 *     Q5_1 and MXFP4 rows grouped at load: see mlxcel_lanes_take_prompts), the chunk's rows take
 *     it as a decode step's rows do, 16 at a time against each band of 16 weight rows kept in L1: activations quantized to
 *     vec_dot_type, as llama.cpp's prompts are, and every row's result the same bits as a
 *     step's. Otherwise the weight is expanded TILE_VALUES values at a time into one reused
 *     float32 buffer (to_float, rows spread over the pool) and multiplied by the BLAS's own
 *     sgemm, so a prompt chunk runs at the BLAS's float32 speed with no float32 copy of the
 *     weight kept.
 *
 * Row r of the product may be a permuted row of the stored weight (`rows`): llama.cpp stores the
 * query and key rows of llama models permuted for its RoPE, and the model wants them un-permuted;
 * reading the rows in another order costs nothing, where un-permuting the blocks would copy them
 * out of the memory-mapped file.
 *
 * An MLX affine 8-bit weight (an mlx-community directory) is held as Q8_0 blocks (its integers
 * minus 128, its scales) plus a per-group bias (`group_bias`): the product adds, per output,
 * the biases times the sums of the inputs over their groups.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blas_shim.h"
#include "quant_blocks.h"
#include "thread_pool.h"

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };

typedef void (*vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc);
typedef void (*to_float_fn)(const void *x, float *y, int64_t k);
typedef void (*from_float_fn)(const float *x, void *y, int64_t k);

/* Rows of weights times rows of activations by this library's own kernels (quant_rows.c, split_rows.c). */
typedef void (*rows_fn)(int k, const void *w, size_t row_bytes, int n, const void *act, size_t act_bytes, int m,
                        float *out, size_t ldo);
rows_fn mlxcel_rows_kernel(int ggml_type);

/* One block type's kernels (filled by ggml_cpu.py from ggml's type traits). */
struct mlxcel_block_type {
    vec_dot_fn vec_dot;     /* one weight row . one activation row in vec_dot_type */
    from_float_fn quantize; /* float32 activations -> vec_dot_type */
    to_float_fn to_float;   /* a weight row -> float32 */
    long act_block;         /* vec_dot_type: values per block */
    long act_block_bytes;   /* and bytes per block */
    int own_kernel;         /* the ggml type whose rows kernel (quant_rows.c) replaces vec_dot, or -1 */
};

/* A weight of n rows of k values (a linear layer's (out, in) matrix, an embedding table). */
struct mlxcel_block_weight {
    const struct mlxcel_block_type *type;
    const unsigned char *data; /* n rows of row_bytes each */
    long row_bytes;
    const int32_t *rows;      /* output r is stored row rows[r]; NULL: row r */
    const float *group_bias;  /* NULL, or n x (k / bias_group) biases, one per group of inputs */
    int bias_group;
    int n, k;
    int float_prompts; /* prompt chunks by float32 tiles even where the lanes take the
                          type: MLX affine weights held as blocks promise MLX's float32 result */
};

/* Values of the weight expanded to float32 at a time for the BLAS (2 MiB). */
#define TILE_VALUES (1 << 19)
#define PARTS_PER_THREAD 4
#define PARALLEL_MIN_VALUES (1 << 15) /* smaller products run on the calling thread */

static inline size_t stored(const struct mlxcel_block_weight *w, int r) { return (size_t)(w->rows ? w->rows[r] : r); }

static inline const unsigned char *stored_row(const struct mlxcel_block_weight *w, int r) {
    return w->data + stored(w, r) * (size_t)w->row_bytes;
}

/* The biases of output r's groups (group_bias is laid out like the stored rows). */
static inline const float *row_bias(const struct mlxcel_block_weight *w, int r) {
    return w->group_bias + stored(w, r) * (size_t)(w->k / w->bias_group);
}

/* A buffer per thread, grown as needed and kept: products come from the engine thread. */

static __thread struct mlxcel_scratch tile_scratch;

static int parts_for(int units) {
    int parts = mlxcel_threads() * PARTS_PER_THREAD;
    return parts < units ? parts : units;
}

/* ------------------------------------------------------------------------------- few rows */

/* Weights multiplied by the same activation rows in one job (a layer's q, k and v; gate and up):
 * the rows are quantized once per activation type and the weights' rows, taken together, are
 * spread over the pool, so the pool starts once and waits once for all of them. */
#define SHARED_MAX 3

struct vec_dot_target {
    const struct mlxcel_block_weight *w;
    const unsigned char *act; /* m activation rows in w's vec_dot_type */
    size_t act_bytes;         /* bytes of one of them */
    const float *sums;        /* m x (k / bias_group) input sums, with group_bias */
    float *c;
    long ldc;
};

struct vec_dot_job {
    struct vec_dot_target t[SHARED_MAX];
    int first[SHARED_MAX + 1]; /* target i has rows first[i] .. first[i + 1] - 1 of the job */
    int m;
    float beta;
    int parts;
};

static __thread struct mlxcel_scratch rows_scratch;

/* Weight rows [r0, r1) of target t times the job's activation rows: the type's own rows kernel
 * (quant_rows.c) on the whole band where it has one (row by row for permuted rows), else ggml's
 * vec_dot for each pair; then the group biases and beta. */
static void vec_dot_rows(const struct vec_dot_job *j, const struct vec_dot_target *t, int r0, int r1) {
    const struct mlxcel_block_weight *w = t->w;
    const int groups = w->group_bias ? w->k / w->bias_group : 0, n = r1 - r0, m = j->m;
    const float beta = j->beta;
    rows_fn own = w->type->own_kernel >= 0 ? mlxcel_rows_kernel(w->type->own_kernel) : NULL;
    if (own && !w->rows && !groups && beta == 0.0f) { /* straight into the output */
        own(w->k, stored_row(w, r0), (size_t)w->row_bytes, n, t->act, t->act_bytes, m, t->c + r0, (size_t)t->ldc);
        return;
    }
    float *sums = mlxcel_scratch(&rows_scratch, sizeof(float) * (size_t)n * (size_t)m); /* [i * n + r - r0] */
    if (own && !w->rows) {
        own(w->k, stored_row(w, r0), (size_t)w->row_bytes, n, t->act, t->act_bytes, m, sums, (size_t)n);
    } else {
        for (int r = r0; r < r1; r++) {
            const unsigned char *row = stored_row(w, r);
            if (own) {
                own(w->k, row, (size_t)w->row_bytes, 1, t->act, t->act_bytes, m, sums + (r - r0), (size_t)n);
                continue;
            }
            for (int i = 0; i < m; i++)
                w->type->vec_dot(w->k, sums + (size_t)i * n + (r - r0), 0, row, 0, t->act + (size_t)i * t->act_bytes, 0, 1);
        }
    }
    for (int i = 0; i < m; i++) {
        float *restrict s = sums + (size_t)i * n, *restrict out = t->c + (size_t)i * t->ldc + r0;
        if (groups) {
            const float *x = t->sums + (size_t)i * groups;
            for (int r = 0; r < n; r++) {
                const float *b = row_bias(w, r0 + r);
                for (int g = 0; g < groups; g++) s[r] += b[g] * x[g];
            }
        }
        if (beta == 0.0f)
            for (int r = 0; r < n; r++) out[r] = s[r];
        else
            for (int r = 0; r < n; r++) out[r] = s[r] + beta * out[r];
    }
}

/* Weight rows a part takes are a multiple of this: the lane kernels (quant_rows.c's Q8_0,
 * split_rows.c's Q4_1) take 16 rows a pass, and a part ending mid-pass pays for a whole one. */
#define PART_ROWS 16

static void vec_dot_part(const void *ctx, int p) {
    const struct vec_dot_job *j = ctx;
    int total = j->first[SHARED_MAX];
    int per = ((total + j->parts - 1) / j->parts + PART_ROWS - 1) / PART_ROWS * PART_ROWS;
    int r0 = p * per, r1 = r0 + per < total ? r0 + per : total;
    for (int i = 0; i < SHARED_MAX && r0 < r1; i++) {
        const int end = j->t[i].w ? j->first[i] + j->t[i].w->n : j->first[i]; /* first[i + 1] less the padding */
        int a = r0 > j->first[i] ? r0 : j->first[i], b = r1 < end ? r1 : end;
        if (a < b) vec_dot_rows(j, &j->t[i], a - j->first[i], b - j->first[i]);
    }
}

static __thread struct mlxcel_scratch shared_act_scratch[SHARED_MAX], shared_sums_scratch[SHARED_MAX];

/* Activation rows quantized to a weight's vec_dot_type, rows spread over the pool: a prompt
 * chunk's hundreds of rows (a decode step's few are quantized on the calling thread). */
#define QUANTIZE_PARALLEL_ROWS 32

struct quantize_job {
    const struct mlxcel_block_weight *w;
    const float *x;
    long ldx;
    unsigned char *act;
    size_t act_bytes;
    int m, parts;
};

static void quantize_part(const void *ctx, int p) {
    const struct quantize_job *j = ctx;
    int per = (j->m + j->parts - 1) / j->parts;
    for (int i = p * per; i < j->m && i < (p + 1) * per; i++)
        j->w->type->quantize(j->x + (size_t)i * j->ldx, j->act + (size_t)i * j->act_bytes, j->w->k);
}

static void quantize_rows(const struct mlxcel_block_weight *w, int m, const float *x, long ldx, unsigned char *act,
                          size_t act_bytes) {
    if (m < QUANTIZE_PARALLEL_ROWS) {
        for (int i = 0; i < m; i++) w->type->quantize(x + (size_t)i * ldx, act + (size_t)i * act_bytes, w->k);
        return;
    }
    struct quantize_job j = {w, x, ldx, act, act_bytes, m, parts_for(m)};
    mlxcel_parallel(j.parts, quantize_part, &j);
}

/* c[i] = x W[i]^T (+ beta c[i]) for `count` weights of k inputs each. */
static void by_vec_dot(int count, const struct mlxcel_block_weight *const *ws, int m, const float *x, long ldx,
                       float *const *cs, const long *ldcs, float beta) {
    struct vec_dot_job j = {0};
    j.m = m;
    j.beta = beta;
    long macs = 0;
    for (int t = 0; t < count; t++) {
        const struct mlxcel_block_weight *w = ws[t];
        struct vec_dot_target *target = &j.t[t];
        target->w = w;
        target->c = cs[t];
        target->ldc = ldcs[t];
        target->act_bytes = (size_t)(w->k / w->type->act_block) * (size_t)w->type->act_block_bytes;
        for (int u = 0; u < t && !target->act; u++) /* the same activation type: the same rows */
            if (ws[u]->type->quantize == w->type->quantize && ws[u]->k == w->k) target->act = j.t[u].act;
        if (!target->act) {
            unsigned char *act = mlxcel_scratch(&shared_act_scratch[t], target->act_bytes * (size_t)m);
            quantize_rows(w, m, x, ldx, act, target->act_bytes);
            target->act = act;
        }
        if (w->group_bias) {
            int groups = w->k / w->bias_group;
            float *sums = mlxcel_scratch(&shared_sums_scratch[t], sizeof(float) * (size_t)m * (size_t)groups);
            for (int i = 0; i < m; i++)
                for (int g = 0; g < groups; g++) {
                    float s = 0.0f;
                    for (int u = 0; u < w->bias_group; u++) s += x[(size_t)i * ldx + (size_t)g * w->bias_group + u];
                    sums[(size_t)i * groups + g] = s;
                }
            target->sums = sums;
        }
        /* each weight's rows start a part's run of PART_ROWS: grouped rows (GROUPED_TYPE) are read
         * a whole group of 16 at a time, from a group's first row */
        j.first[t + 1] = (j.first[t] + w->n + PART_ROWS - 1) / PART_ROWS * PART_ROWS;
        macs += (long)w->n * w->k * m;
    }
    for (int t = count; t < SHARED_MAX; t++) j.first[t + 1] = j.first[t];
    j.parts = macs >= PARALLEL_MIN_VALUES ? parts_for(j.first[SHARED_MAX]) : 1;
    mlxcel_parallel(j.parts, vec_dot_part, &j);
}

/* ------------------------------------------------------------------------------ many rows */

struct expand_job {
    const struct mlxcel_block_weight *w;
    int r0, count; /* stored rows r0 .. r0 + count - 1 of the product */
    float *tile;   /* count x k */
    int parts;
};

static void expand_part(const void *ctx, int p) {
    const struct expand_job *j = ctx;
    const struct mlxcel_block_weight *w = j->w;
    int per = (j->count + j->parts - 1) / j->parts;
    int a = p * per, b = a + per < j->count ? a + per : j->count;
    int groups = w->group_bias ? w->k / w->bias_group : 0;
    for (int t = a; t < b; t++) {
        float *out = j->tile + (size_t)t * w->k;
        w->type->to_float(stored_row(w, j->r0 + t), out, w->k);
        if (groups) {
            const float *bias = row_bias(w, j->r0 + t);
            for (int i = 0; i < w->k; i++) out[i] += bias[i / w->bias_group];
        }
    }
}

static void by_tiles(const struct mlxcel_block_weight *w, int m, const float *x, long ldx, float *c, long ldc,
                     float beta) {
    int per_tile = TILE_VALUES / w->k > 16 ? TILE_VALUES / w->k : 16;
    if (per_tile > w->n) per_tile = w->n;
    float *tile = mlxcel_scratch(&tile_scratch, sizeof(float) * (size_t)per_tile * (size_t)w->k);
    for (int r0 = 0; r0 < w->n; r0 += per_tile) {
        int count = r0 + per_tile < w->n ? per_tile : w->n - r0;
        struct expand_job j = {w, r0, count, tile, parts_for(count)};
        mlxcel_parallel(j.parts, expand_part, &j);
        mlxcel_blas_sgemm(RowMajor, NoTrans, Trans, m, count, w->k, 1.0f, x, (int)ldx, tile, w->k, beta, c + r0,
                          (int)ldc);
    }
}

/* ------------------------------------------------------------------------------ interface */

/* Whether prompt chunks of a weight whose own rows kernel is `own_kernel` (a ggml type, or a split
 * or grouped code) take that kernel, as decode rows do, instead of float32 tiles: the lane
 * kernels, which take 16 activation rows a pass with each weight block unpacked once for all of
 * them. Measured against the float32 tiles and the GEMMs they replaced (this library's own
 * 8-bit-activation GEMMs for Q8_0 and the split types, until 2026-12-07): 1.8-2.2x faster on
 * 512-row chunks of 2048 x 640 to 11008 x 4096 weights, MXFP4 3x the tiles
 * (docs/benchmarks/quantized.md). The row-by-row kernels over rows stored apart (Q4_K and Q6_K
 * not grouped) keep ggml's mul_mat or the tiles. */
int mlxcel_lanes_take_prompts(int own_kernel) {
    return own_kernel == TYPE_Q8_0 || IS_GROUPED_TYPE(own_kernel) ||
           (own_kernel >= SPLIT_TYPE_BASE && own_kernel < GROUPED_TYPE_BASE);
}

/* Whether w's prompt chunks take its lane kernel: not MLX affine weights held as blocks, whose
 * group biases and promise of MLX's float32 result keep the tiles. */
int mlxcel_block_prompt_lanes(const struct mlxcel_block_weight *w) {
    return w->type->own_kernel >= 0 && !w->group_bias && !w->float_prompts &&
           mlxcel_lanes_take_prompts(w->type->own_kernel);
}

/* c[i, r] = x[i, :] . W[r, :] (+ beta * c[i, r]) for i < m, r < n: the (m, k) activations by the
 * weight's (n, k) rows, x and c row-major with leading dimensions ldx and ldc; by vec_dot or the
 * type's own kernel, or if `tiles` (a prompt chunk) by float32 tiles and the BLAS where the lanes
 * do not take prompts. The caller decides: a row's result must not depend on how many rows share
 * the call, so a prompt chunk and a decode step each always take one path. */
void mlxcel_block_matmul(const struct mlxcel_block_weight *w, int m, const float *x, long ldx, float *c, long ldc,
                         float beta, int tiles) {
    if (m <= 0) return;
    if (tiles && !mlxcel_block_prompt_lanes(w)) by_tiles(w, m, x, ldx, c, ldc, beta);
    else by_vec_dot(1, &w, m, x, ldx, &c, &ldc, beta);
}

/* The decode path of mlxcel_block_matmul for up to 3 weights over the same activations (x, k
 * columns each): c[t][i, :] = x[i, :] . W_t (+ beta c[t][i, :]), in one job. Each output is
 * computed exactly as mlxcel_block_matmul(..., tiles = 0) computes it. */
void mlxcel_block_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int m, const float *x,
                                long ldx, float *const *cs, const long *ldcs, float beta) {
    if (m <= 0 || count <= 0 || count > SHARED_MAX) return;
    by_vec_dot(count, ws, m, x, ldx, cs, ldcs, beta);
}

/* out[i, :] = W[ids[i], :] as float32 for i < count: an embedding lookup. */
void mlxcel_block_rows(const struct mlxcel_block_weight *w, const int32_t *ids, int count, float *out) {
    for (int i = 0; i < count; i++) {
        float *row = out + (size_t)i * w->k;
        w->type->to_float(stored_row(w, ids[i]), row, w->k);
        if (w->group_bias) {
            const float *bias = row_bias(w, ids[i]);
            for (int t = 0; t < w->k; t++) row[t] += bias[t / w->bias_group];
        }
    }
}

/* ------------------------------------------------------------------------- expert stacks */

/* An MoE layer's stacked experts (ggml's `[n_expert, rows, k]`, a `_exps` tensor) are one weight
 * of n_expert * rows rows: expert e's matrix is the contiguous run of rows e * rows .. (e + 1) *
 * rows - 1. A call multiplies groups of activation rows, each by one expert's rows (what ggml's
 * mul_mat_id does): the caller has sorted the (token, chosen expert) pairs by expert, so group g
 * is the pairs start[g] .. start[g + 1] - 1, all for expert[g], and each chosen expert's weight is
 * read once for every token that chose it. Only the chosen experts are read.
 *
 * Pair i reads activation row source[i] of x (row i where source is NULL): a token that chose
 * eight experts is quantized to vec_dot_type once, not eight times, and its quantized row is
 * copied to each of its pairs. Up to EXPERT_SHARED_MAX stacks over the same pairs (a SwitchGLU's
 * gate and up) share that one sort and quantization and run in one pool job.
 *
 * Every row takes the decode path of mlxcel_block_matmul (activations quantized to vec_dot_type,
 * this library's rows kernel or ggml's vec_dot), whose result for a row does not depend on the
 * other rows of its group: a token's expert outputs are the same whatever else shares the chunk,
 * a prompt's tokens and a decode step's alike. */
#define EXPERT_SHARED_MAX 2

struct expert_target {
    const struct mlxcel_block_weight *w;
    const unsigned char *act; /* one activation row per pair in w's vec_dot_type */
    size_t act_bytes;
    float *c;
};

struct expert_job {
    struct expert_target t[EXPERT_SHARED_MAX];
    int count;
    int rows;                   /* per expert */
    const int32_t *expert;      /* per group */
    const int32_t *start;       /* groups + 1 */
    const int32_t *source;      /* per pair: its row of x; NULL: row i */
    const float *x;
    long ldx;
    int n_x;                    /* rows of x */
    unsigned char *unique_act;  /* n_x rows in vec_dot_type, before they are copied to the pairs */
    long ldc;
    int groups, band, bands, parts;
};

static void expert_quantize_part(const void *ctx, int p) {
    const struct expert_job *j = ctx;
    for (int t = 0; t < j->count; t++) {
        const struct expert_target *target = &j->t[t];
        if (t > 0 && target->act == j->t[0].act) continue; /* the same activation type: the same rows */
        unsigned char *dest = j->source ? j->unique_act : (unsigned char *)target->act;
        int per = (j->n_x + j->parts - 1) / j->parts;
        for (int i = p * per; i < j->n_x && i < (p + 1) * per; i++)
            target->w->type->quantize(j->x + (size_t)i * j->ldx, dest + (size_t)i * target->act_bytes, target->w->k);
    }
}

/* Band b of group g of target t: expert[g]'s rows [b * band, (b + 1) * band) times the group's rows. */
static void expert_unit(const struct expert_job *j, const struct expert_target *t, int g, int b) {
    const struct mlxcel_block_weight *w = t->w;
    int r0 = b * j->band, r1 = r0 + j->band < j->rows ? r0 + j->band : j->rows;
    int i0 = j->start[g], m = j->start[g + 1] - i0;
    if (r0 >= r1 || m <= 0) return;
    const unsigned char *first = w->data + ((size_t)j->expert[g] * j->rows + r0) * (size_t)w->row_bytes;
    const unsigned char *act = t->act + (size_t)i0 * t->act_bytes;
    float *c = t->c + (size_t)i0 * j->ldc + r0;
    rows_fn own = w->type->own_kernel >= 0 ? mlxcel_rows_kernel(w->type->own_kernel) : NULL;
    if (own) {
        own(w->k, first, (size_t)w->row_bytes, r1 - r0, act, t->act_bytes, m, c, (size_t)j->ldc);
        return;
    }
    for (int r = 0; r < r1 - r0; r++)
        for (int i = 0; i < m; i++)
            w->type->vec_dot(w->k, c + (size_t)i * j->ldc + r, 0, first + (size_t)r * w->row_bytes, 0,
                             act + (size_t)i * t->act_bytes, 0, 1);
}

static void expert_part(const void *ctx, int p) {
    const struct expert_job *j = ctx;
    int per_target = j->groups * j->bands, units = j->count * per_target, per = (units + j->parts - 1) / j->parts;
    for (int u = p * per; u < units && u < (p + 1) * per; u++) {
        int v = u % per_target;
        expert_unit(j, &j->t[u / per_target], v / j->bands, v % j->bands);
    }
}

static __thread struct mlxcel_scratch expert_act_scratch[EXPERT_SHARED_MAX], expert_unique_scratch;

/* c_t[i, :] = x[source[i], :] . W_t,{expert[g]}^T for each stack t < count and the pairs i of each
 * group g (start[g] <= i < start[g + 1]), W_t,e being rows e * rows .. (e + 1) * rows - 1 of the
 * stack ws[t]; the stacks share rows and k. x is n_x rows (ldx apart); each c_t is start[groups]
 * rows, ldc apart. Returns -1 (and computes nothing) for weights this path does not take
 * (permuted rows, group biases, unequal shapes, an expert out of the stack, a source out of x). */
int mlxcel_expert_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int rows, int groups,
                                const int32_t *expert, const int32_t *start, const int32_t *source, int n_x,
                                const float *x, long ldx, float *const *cs, long ldc) {
    if (count <= 0 || count > EXPERT_SHARED_MAX || rows <= 0) return -1;
    for (int t = 0; t < count; t++) {
        const struct mlxcel_block_weight *w = ws[t];
        if (w->rows || w->group_bias || w->n % rows || w->n != ws[0]->n || w->k != ws[0]->k) return -1;
    }
    for (int g = 0; g < groups; g++)
        if (expert[g] < 0 || expert[g] >= ws[0]->n / rows || start[g + 1] < start[g]) return -1;
    if (groups <= 0) return 0;
    if (start[0] != 0) return -1;
    int m = start[groups];
    if (m <= 0) return 0;
    if (source) {
        for (int i = 0; i < m; i++)
            if (source[i] < 0 || source[i] >= n_x) return -1;
    } else if (n_x != m) {
        return -1;
    }
    struct expert_job j = {0};
    j.count = count;
    j.rows = rows;
    j.expert = expert;
    j.start = start;
    j.source = source;
    j.x = x;
    j.ldx = ldx;
    j.n_x = n_x;
    j.ldc = ldc;
    j.groups = groups;
    size_t unique_bytes = 0;
    for (int t = 0; t < count; t++) {
        struct expert_target *target = &j.t[t];
        const struct mlxcel_block_weight *w = ws[t];
        target->w = w;
        target->c = cs[t];
        target->act_bytes = (size_t)(w->k / w->type->act_block) * (size_t)w->type->act_block_bytes;
        if (t > 0 && w->type->quantize == ws[0]->type->quantize) {
            target->act = j.t[0].act;
            continue;
        }
        target->act = mlxcel_scratch(&expert_act_scratch[t], target->act_bytes * (size_t)m);
        if (target->act_bytes * (size_t)n_x > unique_bytes) unique_bytes = target->act_bytes * (size_t)n_x;
    }
    long values = (long)n_x * ws[0]->k;
    j.parts = values >= PARALLEL_MIN_VALUES ? parts_for(n_x) : 1;
    if (source) {
        /* Each distinct activation type: its rows quantized once, then copied to their pairs. */
        j.unique_act = mlxcel_scratch(&expert_unique_scratch, unique_bytes);
        for (int t = 0; t < count; t++) {
            if (t > 0 && j.t[t].act == j.t[0].act) continue;
            struct expert_job one = j;
            one.count = 1;
            one.t[0] = j.t[t];
            mlxcel_parallel(one.parts, expert_quantize_part, &one);
            for (int i = 0; i < m; i++)
                memcpy((unsigned char *)j.t[t].act + (size_t)i * j.t[t].act_bytes,
                       j.unique_act + (size_t)source[i] * j.t[t].act_bytes, j.t[t].act_bytes);
        }
    } else {
        mlxcel_parallel(j.parts, expert_quantize_part, &j);
    }
    /* Enough units for the pool: each group's rows cut into bands of whole 16-row runs. */
    int want = mlxcel_threads() * PARTS_PER_THREAD;
    int units = groups * count;
    j.bands = units >= want ? 1 : (want + units - 1) / units;
    j.band = (rows + j.bands - 1) / j.bands;
    j.band = (j.band + 15) / 16 * 16;
    j.bands = (rows + j.band - 1) / j.band;
    long macs = (long)count * m * rows * ws[0]->k;
    j.parts = macs >= PARALLEL_MIN_VALUES ? parts_for(count * groups * j.bands) : 1;
    mlxcel_parallel(j.parts, expert_part, &j);
    return 0;
}
