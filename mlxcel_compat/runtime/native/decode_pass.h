/* What the decode pass (decode_pass.c) shares with the layers it calls in other files: a linear
 * layer's description and its products, and the mixture-of-experts layer (moe_layer.c). */
#ifndef MLXCEL_DECODE_PASS_H
#define MLXCEL_DECODE_PASS_H

#include <stdint.h>

typedef void (*repacked_fn)(const void *handle, int m, const float *x, long ldx, float *c, long ldc, float beta,
                            int per_row);
typedef void (*prompt_fn)(const void *handle, int m, const float *x, long ldx, float *c, long ldc, float beta);

struct mlxcel_block_weight; /* block_matmul.c */
void mlxcel_block_matmul(const struct mlxcel_block_weight *w, int m, const float *x, long ldx, float *c, long ldc,
                         float beta, int tiles);
void mlxcel_block_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int m, const float *x,
                                long ldx, float *const *cs, const long *ldcs, float beta);
int mlxcel_block_prompt_lanes(const struct mlxcel_block_weight *w);
int mlxcel_expert_matmul_shared(int count, const struct mlxcel_block_weight *const *ws, int rows, int groups,
                                const int32_t *expert, const int32_t *start, const int32_t *source, int n_x,
                                const float *x, long ldx, float *const *cs, long ldc);

int mlxcel_expert_matmul_f32(int count, const float *const *ws, int n_expert, int rows, int k, int groups,
                             const int32_t *expert, const int32_t *start, const int32_t *source, const float *x,
                             long ldx, float *const *cs, long ldc);

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
    /* gating 2 (glm4_moe): the experts chosen by sigmoid(logit) + score_bias, weighted by the
     * sigmoid alone (renormalised where norm_topk says so), then times routed_scale; gating 3
     * (lfm2_moe): the same, renormalised by the sum + 1e-6 */
    const float *score_bias;
    float routed_scale;
    /* grouped expert selection (n_group > 1: DeepSeek V3's and glm4_moe's, DeepSeek V2's
     * group_limited_greedy): the experts in n_group equal groups, each group ranked by the sum of
     * its two best selection scores (group_by_max: by its best one), the scores of all but the
     * topk_group best groups set to 0 before the top k are chosen, as mlx-lm does */
    int n_group, topk_group, group_by_max;
    /* float32 stacks (mlx-lm's SwitchLinear weights, (n_expert, rows, hidden) and (n_expert, hidden,
     * rows)) in place of gate, up and down (then NULL): expert_f32.c's grouped product */
    const float *gate_f32, *up_f32, *down_f32;
};

/* decode_pass.c's products (a linear layer's, and several of the same input at once). */
void mlxcel_pass_product(const struct mlxcel_linear *l, int m, const float *x, float *out, float beta, int tiles,
                         const double *scales, int n_adapters);
void mlxcel_pass_products(int count, const struct mlxcel_linear *const *ls, int m, const float *x,
                          float *const *outs, int tiles, const double *scales, int n_adapters);

/* x += the MoE layer of h (moe_layer.c). Returns 0, or -1 where the grouped product refused the stacks. */
void mlxcel_moe_top_k(const float *l, int n, int k, int32_t *chosen, float *value);
int mlxcel_moe_group(const int32_t *chosen, int pairs, int k, int n, int32_t *count, int32_t *start, int32_t *experts,
                     int32_t *slot, int32_t *source);
void mlxcel_moe_weighted_sum(float *out, const float *down, const int32_t *slot, const float *weight, int rows, int k,
                             int hidden);
int mlxcel_moe_layer(const struct mlxcel_moe *e, int rows, int hidden, const float *h, float *x, float *gate,
                     float *up, float *branch, int tiles, const double *scales, int n_adapters, float residual_scale);

#endif
