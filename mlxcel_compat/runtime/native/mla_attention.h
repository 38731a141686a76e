/* DeepSeek V2/V3's multi-head latent attention (MLA) in the decode pass (mla_attention.c;
 * runtime/decode_mla.py describes it), as mlx-lm's deepseek_v3 and deepseek_v2 modules compute it
 * and in the form each keeps in its KV cache. */
#ifndef MLXCEL_MLA_ATTENTION_H
#define MLXCEL_MLA_ATTENTION_H

#include <stdint.h>

#include "decode_pass.h" /* struct mlxcel_linear, the products */

/* One MLA layer. The queries: q (n set), or the query LoRA q_a, its RMS norm, q_b; per head
 * nope + rope values, the rope part rotated (interleaved). The keys and values: kv_a gives per
 * row the latent (kv_lora, then RMS-normed) and one rotary key (rope) shared by every head.
 * deepseek_v3 (kv_b.n == 0) caches exactly those: the cache's keys are the latent rows
 * (1 x kv_lora), its values the rotated keys (1 x rope); the attention runs in the latent
 * space, the queries' nope part taken into it by embed_q and the output out of it by unembed_out
 * (mlx-lm's absorbed step). deepseek_v2 (kv_b set) expands the latent by kv_b into per-head keys
 * (nope, then the shared rotary key: heads x (nope + rope)) and values (heads x v_dim), and
 * caches those. */
struct mlxcel_mla {
    struct mlxcel_linear q, q_a, q_b, kv_a, kv_b, o;
    const float *q_a_norm, *kv_norm; /* the RMS norms' gains (q_a_norm NULL without a query LoRA) */
    float q_a_eps, kv_eps;
    const float *embed_q;     /* deepseek_v3: (heads, kv_lora, nope) */
    const float *unembed_out; /* deepseek_v3: (heads, v_dim, kv_lora) */
    int heads, nope, rope, kv_lora, v_dim;
    float scale; /* the softmax scale (mlx-lm's, YaRN's mscale included) */
};

/* Where one unit (a decode row, or a prompt chunk) attends in one MLA layer: the cache's keys and
 * values (rows of the pass's k_type and v_type, capacity positions a head), the first position
 * the unit writes; k_out set: the cache is shared (read only), the unit's rows go to k_out and
 * v_out (heads x unit rows); cos and sin: the RoPE angles of the unit's positions, rope / 2 a row. */
struct mlxcel_mla_kv {
    void *keys, *values, *k_out, *v_out;
    int64_t capacity, write;
    const float *cos, *sin;
    /* shared prompt-cache blocks the cache starts with (n_blocked > 0): positions below n_blocked
     * in blocks[b] (keys) and blocks[n_blocked / block_tokens + b] (values), (heads, block_tokens,
     * width) each; the cache's own buffers then hold the positions from n_blocked on */
    const void *const *blocks;
    int64_t n_blocked, block_tokens;
};

/* x += the MLA layer of h (rows x hidden): unit u is row u (segments NULL) or rows
 * segments[u] .. segments[u + 1] - 1 (consecutive positions of one sequence), each attending
 * causally over its cache and itself. Returns 0, or -1 where a unit does not fit its cache. */
int mlxcel_mla_layer(const struct mlxcel_mla *a, int hidden, int rows, const int *segments, int n_segments,
                     const struct mlxcel_mla_kv *kv, int k_type, int v_type, int traditional, int tiles,
                     const float *h, float *x, const double *scales, int n_adapters);

#endif
