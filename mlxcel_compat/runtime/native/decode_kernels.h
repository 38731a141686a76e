/* The decode runtime's kernels (elementwise.c, attention.c, chunk_attention.c), for decode_pass.c's layer loop. */
#ifndef MLXCEL_DECODE_KERNELS_H
#define MLXCEL_DECODE_KERNELS_H

/* The KV cache's storage types (runtime/kv_precision.py, -ctk/-ctv), as cpu_decode.py codes them:
 * the attention kernels' k_type and v_type. Keys and values are passed as the cache's raw rows
 * (q8_0 and q4_0: a row of d values is d / 32 of ggml's blocks, kv_rows.h). */
enum { MLXCEL_KV_F32 = 0, MLXCEL_KV_F16 = 1, MLXCEL_KV_BF16 = 2, MLXCEL_KV_Q8_0 = 3, MLXCEL_KV_Q4_0 = 4 };

/* A recurrent mixer's units for its recurrence (delta_net.c, mamba2.c): consecutive units on the
 * same state, decode rows of one sequence (a prompt's rest fed as rows: CpuDecoder.step_tokens),
 * become one unit whose rows go in order, as a prompt chunk's do: in units of their own the
 * recurrence's parallel parts would race on that state. `first` (units + 1 row offsets) is
 * compacted in place, `merged` (units entries) gets each unit's state; returns the unit count. */
static inline int mlxcel_state_units(int units, int *first, float *const *states, float **merged) {
    int n = 0;
    for (int u = 0; u < units; u++) {
        if (n && states[u] == merged[n - 1]) continue;
        merged[n] = states[u];
        first[n++] = first[u];
    }
    first[n] = first[units];
    return n;
}

/* 1 / sqrt(mean(x^2) + eps) over n values, MLX's rounding bit for bit (elementwise.c). */
float mlxcel_rms_scale(const float *x, int n, float eps);
void mlxcel_rms_norm(const float *x, const float *w, float *out, int rows, int n, float eps);
void mlxcel_rms_norm_add(const float *b, const float *w, float *x, int rows, int n, float eps);
void mlxcel_rope(float *x, int heads, int d, const float *cos, const float *sin, int traditional);
void mlxcel_rope_rows(float *x, int rows, int heads, int d, const float *cos, const float *sin, int traditional);
void mlxcel_swiglu(float *gate, const float *up, int n);
void mlxcel_gelu_tanh_gate(float *gate, const float *up, int n);
void mlxcel_layer_norm(const float *x, const float *w, const float *bias, float *out, int rows, int n, float eps);
void mlxcel_gelu_erf(float *x, int n);
void mlxcel_rope_part(float *x, int heads, int d, int dims, const float *cos, const float *sin, int traditional);
void mlxcel_xielu(float *x, int n, float alpha_p, float alpha_n, float beta, float eps);
void mlxcel_swiglu_oai(float *gate, const float *up, int n, float alpha, float limit);
int mlxcel_decode_attention_rows(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                 float *out, int rows, int kv_heads, int group, int d, int write, int n, long capacity,
                                 float scale, int k_type, int v_type);
int mlxcel_decode_attention_at(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                               float *out, int kv_heads, int group, int d, int write, int n, long capacity,
                               float scale, int k_type, int v_type);
int mlxcel_decode_attention_apart(const float *q, const float *k_new, const float *v_new, const void *keys,
                                  const void *values, float *out, void *k_out, void *v_out, int kv_heads,
                                  int group, int d, int n_base, long capacity, float scale, int k_type, int v_type);
int mlxcel_decode_attention_sinks(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, void *k_out, void *v_out, int kv_heads, int group, int d, int write,
                                  int n, long capacity, float scale, const float *sinks, int k_type, int v_type);
int mlxcel_chunk_attention(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                           float *out, int rows, int kv_heads, int group, int d, int pos, long capacity, float scale,
                           int k_type, int v_type);
int mlxcel_chunk_attention_window(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                                  float scale, int k_type, int v_type, int window, const float *sinks);
int mlxcel_chunk_attention_apart(const float *q, const float *k_new, const float *v_new, const void *keys,
                                 const void *values, float *out, void *k_out, void *v_out, int rows,
                                 int kv_heads, int group, int d, int pos, long capacity, float scale, int k_type,
                                 int v_type);
int mlxcel_decode_attention_paged(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, int kv_heads, int group, int d, int pos, long capacity, float scale,
                                  int k_type, int v_type, const float *sinks, const void *const *blocks,
                                  int n_blocked, int block_tokens);
int mlxcel_chunk_attention_paged(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                 float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                                 float scale, int k_type, int v_type, int window, const float *sinks,
                                 const void *const *blocks, int n_blocked, int block_tokens);
int mlxcel_decode_attention_capped(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                   float *out, void *k_out, void *v_out, int kv_heads, int group, int d, int write,
                                   int n, long capacity, float scale, int k_type, int v_type, const float *sinks,
                                   const void *const *blocks, int n_blocked, int block_tokens, float softcap);
int mlxcel_chunk_attention_capped(const float *q, const float *k_new, const float *v_new, void *keys, void *values,
                                  float *out, void *k_out, void *v_out, int rows, int kv_heads, int group, int d,
                                  int pos, long capacity, float scale, int k_type, int v_type, int window,
                                  const float *sinks, const void *const *blocks, int n_blocked, int block_tokens,
                                  float softcap);

#endif
