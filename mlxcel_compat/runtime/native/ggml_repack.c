/* Products with weights repacked by ggml into its interleaved layouts (ggml's "CPU_REPACK"
 * buffer type: Q4_0 and Q4_K as 8 rows x 8 interleaved blocks, Q2_K and IQ4_NL likewise on
 * AVX-512, with matching GEMV/GEMM kernels), run on the BLAS shim's threads.
 *
 * Why: on x86 ggml's repacked kernels multiply a Q4_K weight 1.4x faster than its row-by-row
 * vec_dot for one activation row and 3x faster for a prompt chunk (int8 GEMM with VNNI, where
 * block_matmul.c expands float32 tiles for sgemm); llama-server uses them by default. The
 * kernels are reached through ggml's public API only: the weight is a tensor in a buffer of the
 * CPU_REPACK type (ggml-backend.h; setting its data repacks it) and each product is a one-node
 * graph, GGML_OP_MUL_MAT, computed by ggml_graph_compute (ggml-cpu.h) with one thread. The
 * parallelism is the shim's pool: each part of a product is a graph over a view of 8k rows of
 * the weight, so a product uses the same threads, and the same spin-then-sleep pool, as every
 * other product of the process.
 *
 * Exactness: ggml's GEMM (4 activation rows at a time) and GEMV (one) do not round alike for
 * every type, and no row's result may depend on what else shares its call. A decode product
 * (`per_row`: a sequence's tokens are the same whether it decodes alone or in a batch) runs each
 * activation row as its own GEMV; a prompt chunk's rows all go through GEMM, padded with zero
 * rows to a multiple of 4 (a token's KV is then the same whatever the chunking, the batch's
 * padding or where a cache hit split the prompt).
 *
 * The same graph API also multiplies prompt chunks of weights kept as stored (mlxcel_plain_new,
 * mlxcel_plain_matmul): ggml's own mul_mat, whose tiled K-quant kernels (ggml 0.25) are what
 * llama.cpp runs for prompts; one graph over the whole weight on ggml's threads (the activations
 * quantized once), chunks under 8 rows padded so every row takes the tiled kernel.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "thread_pool.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

/* A weight of n rows of k values, repacked. */
struct mlxcel_repacked {
    struct ggml_context *ctx;
    struct ggml_tensor *w;
    ggml_backend_buffer_t buffer;
    int n, k;
    int part_rows; /* rows per part of a product: a multiple of 8, ~PART_BYTES of weights */
};

#define PART_BYTES (192 * 1024) /* a part's weights stay in L2 while its activation rows pass */
#define PARTS_PER_THREAD 2
#define PLAIN_ROWS_MIN 8 /* ggml's tiled K-quant kernels take products of >= 8 rows */

/* ggml's own log, less its per-tensor "repack: repack tensor ..." lines (debug and info). */
static void log_warnings(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static ggml_backend_buffer_type_t repack_type(void) {
    static ggml_backend_buffer_type_t found;
    static int looked;
    if (!looked) {
        looked = 1;
        ggml_log_set(log_warnings, NULL);
        ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
        if (!dev) return NULL;
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        typedef ggml_backend_buffer_type_t *(*extra_fn)(ggml_backend_dev_t);
        extra_fn extra = (extra_fn)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
        for (ggml_backend_buffer_type_t *t = extra ? extra(dev) : NULL; t && *t; t++)
            if (strcmp(ggml_backend_buft_name(*t), "CPU_REPACK") == 0) found = *t;
    }
    return found;
}

/* The weight `data` (n rows of k values of GGML type `type`, in ggml's row layout) repacked, or
 * NULL when ggml has no repacked layout for it on this CPU. `data` is only read. */
struct mlxcel_repacked *mlxcel_repack_new(int type, const void *data, int n, int k) {
    ggml_backend_buffer_type_t buft = repack_type();
    if (!buft || n % 8) return NULL;
    struct mlxcel_repacked *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    struct ggml_init_params params = {ggml_tensor_overhead() * 2, NULL, true};
    r->ctx = ggml_init(params);
    r->w = ggml_new_tensor_2d(r->ctx, (enum ggml_type)type, k, n);
    r->buffer = ggml_backend_buft_alloc_buffer(buft, ggml_backend_buft_get_alloc_size(buft, r->w));
    if (!r->buffer || ggml_backend_tensor_alloc(r->buffer, r->w, ggml_backend_buffer_get_base(r->buffer)) != GGML_STATUS_SUCCESS ||
        !r->w->extra) { /* extra: the repacked layout ggml chose; none for this type and CPU */
        if (r->buffer) ggml_backend_buffer_free(r->buffer);
        ggml_free(r->ctx);
        free(r);
        return NULL;
    }
    ggml_backend_tensor_set(r->w, data, 0, ggml_nbytes(r->w));
    r->n = n;
    r->k = k;
    long rows = PART_BYTES / (long)ggml_row_size((enum ggml_type)type, k);
    r->part_rows = rows < 8 ? 8 : (int)(rows / 8 * 8);
    return r;
}

/* The weight `data` as it is stored (n rows of k values of GGML type `type`, ggml's row layout),
 * for prompt chunks through ggml's own mul_mat (mlxcel_plain_matmul): its tiled K-quant
 * kernels, llama.cpp's prompt arithmetic. Nothing is copied: `data` (the mapped file) must
 * outlive the handle. */
struct mlxcel_repacked *mlxcel_plain_new(int type, const void *data, int n, int k) {
    struct mlxcel_repacked *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    struct ggml_init_params params = {ggml_tensor_overhead() * 2, NULL, true};
    r->ctx = ggml_init(params);
    r->w = ggml_new_tensor_2d(r->ctx, (enum ggml_type)type, k, n);
    r->w->data = (void *)data;
    r->n = n;
    r->k = k;
    r->part_rows = n;
    return r;
}

void mlxcel_repack_free(struct mlxcel_repacked *r) {
    if (!r) return;
    if (r->buffer) ggml_backend_buffer_free(r->buffer);
    ggml_free(r->ctx);
    free(r);
}

/* Bytes the repacked weight takes. */
long mlxcel_repack_bytes(const struct mlxcel_repacked *r) { return r->buffer ? (long)ggml_backend_buffer_get_size(r->buffer) : 0; }

/* A thread's reused memory: the graph's tensors, ggml's work buffer (the quantized activations),
 * padded activations and outputs, and an output for products that accumulate. */
static __thread struct mlxcel_scratch graph_scratch, work_scratch, x_scratch, pad_scratch, out_scratch;

/* ggml's threads for graphs computed on more than one thread (prompt chunks' products), kept for
 * the process: ggml_graph_compute without a threadpool makes one for the call and joins it after,
 * ~0.1-0.2 ms a product (most of a short prompt's chunk). Its threads sleep as soon as a graph is
 * done (poll 0), leaving the cores to the shim's pool between graphs. Held by one caller at a
 * time (graph_threads_lock); another caller meanwhile computes with a threadpool of its own. */
static pthread_mutex_t graph_threads_lock = PTHREAD_MUTEX_INITIALIZER;
static struct ggml_threadpool *graph_threads;
static int graph_threads_n;

static void graph_threads_after_fork_in_child(void) {
    graph_threads = NULL; /* its threads did not survive the fork: the first graph makes new ones */
    pthread_mutex_init(&graph_threads_lock, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, graph_threads_after_fork_in_child); }

/* The process's threadpool of `threads` threads, locked for the caller (graph_threads_lock), or
 * NULL (ggml makes one for the call) when another caller holds it. */
static struct ggml_threadpool *graph_threads_acquire(int threads) {
    static pthread_once_t registered = PTHREAD_ONCE_INIT;
    pthread_once(&registered, register_fork_handler);
    if (pthread_mutex_trylock(&graph_threads_lock) != 0) return NULL;
    if (graph_threads && graph_threads_n != threads) {
        ggml_threadpool_free(graph_threads);
        graph_threads = NULL;
    }
    if (!graph_threads) {
        struct ggml_threadpool_params params = ggml_threadpool_params_default(threads);
        params.poll = 0;
        graph_threads = ggml_threadpool_new(&params);
        graph_threads_n = threads;
    }
    if (!graph_threads) pthread_mutex_unlock(&graph_threads_lock);
    return graph_threads;
}

/* out[i, 0 .. count) = x[i, :] . W[r0 .. r0 + count, :] as one graph of `nodes` mul_mat nodes over
 * the same view of the weight, each of `rows` consecutive activation rows (strides ldx, ldo), on
 * `threads` threads (1: the calling thread; more: the process's ggml threadpool, graph_threads). */
static void run_graph(const struct mlxcel_repacked *r, int r0, int count, int nodes, int rows, const float *x,
                      long ldx, float *out, long ldo, int threads) {
    size_t tensors = 1 + 2 * (size_t)nodes;
    size_t mem = ggml_tensor_overhead() * tensors + ggml_graph_overhead_custom(tensors, false);
    struct ggml_init_params params = {mem, mlxcel_scratch(&graph_scratch, mem), true};
    struct ggml_context *ctx = ggml_init(params);
    struct ggml_tensor *w = ggml_view_2d(ctx, r->w, r->k, count, r->w->nb[1], (size_t)r0 * r->w->nb[1]);
    w->buffer = r->w->buffer; /* the repacked layout (if any): what ggml's CPU backend dispatches on */
    w->extra = r->w->extra;
    w->data = (char *)r->w->data + (size_t)r0 * r->w->nb[1]; /* 8-row groups are contiguous */
    struct ggml_cgraph *graph = ggml_new_graph_custom(ctx, tensors, false);
    for (int node = 0; node < nodes; node++) {
        struct ggml_tensor *xt = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, r->k, rows);
        xt->data = (void *)(x + (size_t)node * ldx);
        xt->nb[1] = (size_t)ldx * sizeof(float);
        xt->nb[2] = xt->nb[3] = xt->nb[1] * (size_t)rows;
        struct ggml_tensor *y = ggml_mul_mat(ctx, w, xt);
        y->data = out + (size_t)node * ldo;
        y->nb[1] = (size_t)ldo * sizeof(float);
        y->nb[2] = y->nb[3] = y->nb[1] * (size_t)rows;
        ggml_build_forward_expand(graph, y);
    }
    struct ggml_threadpool *pool = threads > 1 ? graph_threads_acquire(threads) : NULL;
    struct ggml_cplan plan = ggml_graph_plan(graph, threads, pool);
    plan.work_data = plan.work_size ? mlxcel_scratch(&work_scratch, plan.work_size) : NULL;
    ggml_graph_compute(graph, &plan);
    if (pool) pthread_mutex_unlock(&graph_threads_lock);
    ggml_free(ctx);
}

/* out[i, 0 .. count) = x[i, :] . W[r0 .. r0 + count, :] for i < m, by one graph: one GEMM node
 * (`gemm`), or one GEMV node per activation row, run one after the other over the same weights
 * (which stay in the cache meanwhile; one graph amortizes ggml's per-graph set-up). */
static void graph_product(const struct mlxcel_repacked *r, int r0, int count, int m, const float *x, long ldx,
                          float *out, long ldo, int gemm) {
    if (gemm && (ldx != r->k || m % 4)) {
        /* ggml quantizes 4 activation rows at a time as one contiguous block, and multiplies
         * rows in groups of 4 by its GEMM, the rest by its GEMV, which round differently for
         * some types (Q4_K): zero rows pad m to a multiple of 4, so that every row of a product
         * with several rows is a GEMM row, whatever else shares the call. */
        int padded = (m + 3) / 4 * 4;
        float *packed = mlxcel_scratch(&x_scratch, sizeof(float) * (size_t)padded * (size_t)r->k);
        for (int i = 0; i < m; i++) memcpy(packed + (size_t)i * r->k, x + (size_t)i * ldx, sizeof(float) * (size_t)r->k);
        memset(packed + (size_t)m * r->k, 0, sizeof(float) * (size_t)(padded - m) * (size_t)r->k);
        if (padded != m) {
            float *wide = mlxcel_scratch(&pad_scratch, sizeof(float) * (size_t)padded * (size_t)count);
            graph_product(r, r0, count, padded, packed, r->k, wide, count, gemm);
            for (int i = 0; i < m; i++) memcpy(out + (size_t)i * ldo, wide + (size_t)i * count, sizeof(float) * (size_t)count);
            return;
        }
        x = packed;
        ldx = r->k;
    }
    run_graph(r, r0, count, gemm ? 1 : m, gemm ? m : 1, x, ldx, out, ldo, 1);
}

struct job {
    const struct mlxcel_repacked *r;
    int m;
    const float *x;
    long ldx;
    float *c;
    long ldc;
    float beta;
    int per_row;
    int part_rows;
};

/* Part p: weight rows r0 .. r0 + count for every activation row. */
static void part(const void *ctx, int p) {
    const struct job *j = ctx;
    const struct mlxcel_repacked *r = j->r;
    int r0 = p * j->part_rows, count = r0 + j->part_rows < r->n ? j->part_rows : r->n - r0;
    float *c = j->c + r0;
    if (j->beta == 0.0f) {
        graph_product(r, r0, count, j->m, j->x, j->ldx, c, j->ldc, !j->per_row);
        return;
    }
    float *tmp = mlxcel_scratch(&out_scratch, sizeof(float) * (size_t)j->m * (size_t)count);
    graph_product(r, r0, count, j->m, j->x, j->ldx, tmp, count, !j->per_row);
    for (int a = 0; a < j->m; a++)
        for (int t = 0; t < count; t++) c[(size_t)a * j->ldc + t] = tmp[(size_t)a * count + t] + j->beta * c[(size_t)a * j->ldc + t];
}

/* c[i, :] = x[i, :] . W^T (+ beta * c[i, :]) for i < m, x and c row-major with leading dimensions
 * ldx and ldc, as block_matmul.c's mlxcel_block_matmul; per_row: each row its own GEMV. */
void mlxcel_repack_matmul(const struct mlxcel_repacked *r, int m, const float *x, long ldx, float *c, long ldc,
                          float beta, int per_row) {
    if (m <= 0) return;
    /* One activation row reads each weight once: parts as large as the pool allows (each part
     * quantizes the row again and builds a graph). More rows: parts whose weights stay in L2. */
    int part_rows = r->part_rows;
    if (m == 1) {
        int even = (r->n + PARTS_PER_THREAD * mlxcel_threads() - 1) / (PARTS_PER_THREAD * mlxcel_threads());
        even = (even + 7) / 8 * 8;
        if (even > part_rows) part_rows = even;
    }
    struct job j = {r, m, x, ldx, c, ldc, beta, per_row, part_rows};
    int parts = (r->n + part_rows - 1) / part_rows;
    mlxcel_parallel(parts, part, &j);
}

/* c = x W^T (+ beta c) for a prompt chunk of m rows, as one graph on ggml's threads (one
 * mul_mat quantizes the activations once for all the weight's rows). ggml picks its kernel by
 * the row count (its tiled K-quant kernels from PLAIN_ROWS_MIN rows, vec_dot below), so fewer
 * rows are padded with zero rows: every row of every chunk takes the same kernel, and its
 * result does not depend on the chunk (tests/test_ggml_repack.py). */
void mlxcel_plain_matmul(const struct mlxcel_repacked *r, int m, const float *x, long ldx, float *c, long ldc,
                         float beta) {
    if (m <= 0) return;
    int rows = m < PLAIN_ROWS_MIN ? PLAIN_ROWS_MIN : m;
    if (rows != m) {
        float *packed = mlxcel_scratch(&x_scratch, sizeof(float) * (size_t)rows * (size_t)r->k);
        for (int i = 0; i < m; i++) memcpy(packed + (size_t)i * r->k, x + (size_t)i * ldx, sizeof(float) * (size_t)r->k);
        memset(packed + (size_t)m * r->k, 0, sizeof(float) * (size_t)(rows - m) * (size_t)r->k);
        x = packed;
        ldx = r->k;
    }
    int direct = rows == m && beta == 0.0f;
    float *out = direct ? c : mlxcel_scratch(&pad_scratch, sizeof(float) * (size_t)rows * (size_t)r->n);
    run_graph(r, 0, r->n, 1, rows, x, ldx, out, direct ? ldc : r->n, mlxcel_batch_threads());
    if (direct) return;
    for (int i = 0; i < m; i++)
        for (int t = 0; t < r->n; t++) {
            float v = out[(size_t)i * r->n + t];
            c[(size_t)i * ldc + t] = beta == 0.0f ? v : v + beta * c[(size_t)i * ldc + t];
        }
}
