/* The mixture-of-experts layer of the decode pass (decode_pass.c calls it in place of a layer's MLP;
 * runtime/decode_moe.py describes it): the router's logits, the family's gating, then only the
 * chosen experts' rows of the stacked block tensors, grouped by expert as ggml's mul_mat_id groups
 * them, SwiGLU between, the weighted sum, and the shared expert. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blas_shim.h"
#include "decode_kernels.h"
#include "decode_pass.h"
#include "thread_pool.h"

int mlxcel_expert_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int rows, int groups,
                                const int32_t *expert, const int32_t *start, const int32_t *source, int n_x,
                                const float *x, long ldx, float *const *cs, long ldc);

/* ------------------------------------------------------------------------- MoE layers */

/* Per-thread scratch of the MoE layer (the engine thread runs the passes). */
static __thread struct mlxcel_scratch moe_scratch[10];

static void *moe_buffer(int i, size_t bytes) { return mlxcel_scratch(&moe_scratch[i], bytes ? bytes : 1); }

/* The k largest of l[0 .. n), largest first (ties: the lower index first): their indices and (unless
 * value is NULL) values. */
void mlxcel_moe_top_k(const float *l, int n, int k, int32_t *chosen, float *value) {
    for (int j = 0; j < k; j++) { /* k passes of an arg-max over the experts not chosen yet (k is a few) */
        int best = -1;
        for (int i = 0; i < n; i++) {
            int taken = 0;
            for (int t = 0; t < j && !taken; t++) taken = chosen[t] == i;
            if (!taken && (best < 0 || l[i] > l[best])) best = i;
        }
        chosen[j] = best;
        if (value) value[j] = l[best];
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

/* Grouped expert selection (struct mlxcel_moe's n_group): s (n scores) in n_group groups, each
 * ranked by the sum of its two largest scores (by_max: its largest), every score outside the
 * topk_group best groups set to 0, as mlx-lm's deepseek_v3 / glm4_moe group_expert_select and
 * deepseek_v2's group_limited_greedy do (ties between groups: the lower group kept). */
static void moe_drop_groups(float *s, int n, int n_group, int topk_group, int by_max) {
    int per = n / n_group;
    float rank[n_group];
    int kept[n_group];
    for (int g = 0; g < n_group; g++) {
        const float *x = s + (size_t)g * per;
        float first = x[0], second = -INFINITY;
        for (int i = 1; i < per; i++) {
            if (x[i] > first) second = first, first = x[i];
            else if (x[i] > second) second = x[i];
        }
        rank[g] = by_max || per < 2 ? first : first + second;
        kept[g] = 0;
    }
    for (int j = 0; j < topk_group; j++) {
        int best = -1;
        for (int g = 0; g < n_group; g++)
            if (!kept[g] && (best < 0 || rank[g] > rank[best])) best = g;
        kept[best] = 1;
    }
    for (int g = 0; g < n_group; g++)
        if (!kept[g])
            for (int i = 0; i < per; i++) s[(size_t)g * per + i] = 0.0f;
}

/* Row r's chosen experts and their weights from its router logits `l` (n_expert of them), as
 * mlx-lm's qwen3_moe, qwen2_moe and olmoe blocks compute them: a softmax over every expert in float32,
 * the k largest (ties: the lower expert first), renormalised to sum 1 where norm_topk says so. */
static void moe_route(const struct mlxcel_moe *e, float *l, int32_t *chosen, float *weight) {
    int n = e->n_expert, k = e->top_k;
    if (e->gating == 3) { /* lfm2_moe: as glm4_moe's, renormalised by the sum + 1e-6 whatever k is */
        float biased[n];
        for (int i = 0; i < n; i++) {
            l[i] = 1.0f / (1.0f + expf(-l[i]));
            biased[i] = l[i] + e->score_bias[i];
        }
        mlxcel_moe_top_k(biased, n, k, chosen, weight);
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += weight[j] = l[chosen[j]];
        for (int j = 0; j < k; j++) weight[j] = (e->norm_topk ? weight[j] / (total + 1e-6f) : weight[j]) * e->routed_scale;
        return;
    }
    if (e->gating == 2) { /* glm4_moe: sigmoid scores, chosen with their selection bias, weighted without */
        float biased[n];
        for (int i = 0; i < n; i++) {
            l[i] = 1.0f / (1.0f + expf(-l[i]));
            biased[i] = l[i] + e->score_bias[i];
        }
        if (e->n_group > 1) moe_drop_groups(biased, n, e->n_group, e->topk_group, e->group_by_max);
        mlxcel_moe_top_k(biased, n, k, chosen, weight);
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += weight[j] = l[chosen[j]];
        for (int j = 0; j < k; j++) weight[j] = (e->norm_topk && k > 1 ? weight[j] / total : weight[j]) * e->routed_scale;
        return;
    }
    if (e->gating == 1) { /* gpt-oss: the k largest logits, then a softmax over those k */
        mlxcel_moe_top_k(l, n, k, chosen, weight);
        float top = weight[0], sum = 0.0f; /* the largest comes first */
        for (int j = 0; j < k; j++) sum += weight[j] = expf(weight[j] - top);
        for (int j = 0; j < k; j++) weight[j] /= sum;
        return;
    }
    float top = l[0], sum = 0.0f;
    for (int i = 1; i < n; i++) top = l[i] > top ? l[i] : top;
    for (int i = 0; i < n; i++) sum += l[i] = expf(l[i] - top);
    for (int i = 0; i < n; i++) l[i] /= sum;
    if (e->n_group > 1) moe_drop_groups(l, n, e->n_group, e->topk_group, e->group_by_max); /* deepseek_v2 */
    mlxcel_moe_top_k(l, n, k, chosen, weight);
    if (e->norm_topk) {
        float total = 0.0f;
        for (int j = 0; j < k; j++) total += weight[j];
        for (int j = 0; j < k; j++) weight[j] /= total;
    }
    if (e->routed_scale != 1.0f) /* deepseek_v2's routed_scaling_factor */
        for (int j = 0; j < k; j++) weight[j] *= e->routed_scale;
}

/* The (row, expert) pairs grouped by expert, as ggml's mul_mat_id groups them: ``experts[g]`` the
 * g-th expert chosen by any row (ascending), its pairs sorted slots start[g] .. start[g + 1] (rows in
 * order within a group), ``slot[p]`` pair p's sorted slot, ``source[s]`` the row of slot s. ``count``:
 * n scratch integers. Returns the number of groups. */
int mlxcel_moe_group(const int32_t *chosen, int pairs, int k, int n, int32_t *count, int32_t *start, int32_t *experts,
                     int32_t *slot, int32_t *source) {
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
    return groups;
}

/* out[r] = sum over the k chosen experts j of weight[r, j] * down[slot[r, j]]: each row's experts'
 * outputs weighted and added in the order the router chose them (mlx-lm's sum over k). */
void mlxcel_moe_weighted_sum(float *out, const float *down, const int32_t *slot, const float *weight, int rows, int k,
                             int hidden) {
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
}

/* x += the MoE layer of h (rows x hidden): route every row, sort the (row, expert) pairs by
 * expert (a counting sort: ggml's mul_mat_id's grouping), gate and up of every pair in one
 * grouped call (each row quantized once), SwiGLU, down, then each row's weighted sum of its
 * experts' outputs, plus the shared expert. Every product of a pair takes the decode path of the
 * block kernels, whose result for a row does not depend on the other rows: a row's output is
 * the same alone, batched or in a prompt chunk. `gate`, `up` and `branch` are the pass's
 * buffers (the shared expert's). Returns 0, or -1 where the grouped product refused the stacks. */
int mlxcel_moe_layer(const struct mlxcel_moe *e, int rows, int hidden, const float *h, float *x, float *gate,
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
    mlxcel_pass_product(&e->router, rows, h, logits, 0.0f, tiles, scales, n_adapters);
    for (int r = 0; r < rows; r++) moe_route(e, logits + (size_t)r * n, chosen + (size_t)r * k, weight + (size_t)r * k);
    int groups = mlxcel_moe_group(chosen, pairs, k, n, count, start, experts, slot, source);
    const struct mlxcel_block_weight *gate_up[2] = {e->gate, e->up};
    float *gate_up_out[2] = {g, u};
    if (e->gate_f32) { /* float32 stacks (expert_f32.c) */
        const float *gate_up_f32[2] = {e->gate_f32, e->up_f32};
        if (mlxcel_expert_matmul_f32(2, gate_up_f32, n, inter, hidden, groups, experts, start, source, h, hidden,
                                     gate_up_out, inter))
            return -1;
    } else if (mlxcel_expert_matmul_shared(2, gate_up, inter, groups, experts, start, source, rows, h, hidden,
                                           gate_up_out, inter))
        return -1;
    moe_bias(g, e->gate_bias, inter, groups, experts, start);
    moe_bias(u, e->up_bias, inter, groups, experts, start);
    if (e->clamped) mlxcel_swiglu_oai(g, u, pairs * inter, e->alpha, e->limit);
    else mlxcel_swiglu(g, u, pairs * inter);
    float *down_out[1] = {down};
    if (e->down_f32) {
        if (mlxcel_expert_matmul_f32(1, &e->down_f32, n, hidden, inter, groups, experts, start, NULL, g, inter,
                                     down_out, hidden))
            return -1;
    } else if (mlxcel_expert_matmul_shared(1, &e->down, hidden, groups, experts, start, NULL, pairs, g, inter,
                                           down_out, hidden))
        return -1;
    moe_bias(down, e->down_bias, hidden, groups, experts, start);
    float *out = moe_buffer(0, sizeof(float) * (size_t)rows * (hidden > n ? hidden : n)); /* the logits are spent */
    mlxcel_moe_weighted_sum(out, down, slot, weight, rows, k, hidden);
    if (e->shared_gate.n) {
        const struct mlxcel_linear *shared[2] = {&e->shared_gate, &e->shared_up};
        float *shared_out[2] = {gate, up};
        mlxcel_pass_products(2, shared, rows, h, shared_out, tiles, scales, n_adapters);
        mlxcel_swiglu(gate, up, rows * e->shared_gate.n);
        mlxcel_pass_product(&e->shared_down, rows, gate, branch, 0.0f, tiles, scales, n_adapters);
        float *s = up; /* the shared expert's gate logit, one per row */
        if (e->shared_scale.n) mlxcel_pass_product(&e->shared_scale, rows, h, s, 0.0f, tiles, scales, n_adapters);
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
