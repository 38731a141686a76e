/* The decode runtime's kernels (elementwise.c, attention.c), for decode_pass.c's layer loop. */
#ifndef MLXCEL_DECODE_KERNELS_H
#define MLXCEL_DECODE_KERNELS_H

void mlxcel_rms_norm(const float *x, const float *w, float *out, int rows, int n, float eps);
void mlxcel_rms_norm_add(const float *b, const float *w, float *x, int rows, int n, float eps);
void mlxcel_rope(float *x, int heads, int d, const float *cos, const float *sin, int traditional);
void mlxcel_rope_rows(float *x, int rows, int heads, int d, const float *cos, const float *sin, int traditional);
void mlxcel_swiglu(float *gate, const float *up, int n);
void mlxcel_gelu_tanh_gate(float *gate, const float *up, int n);
void mlxcel_swiglu_oai(float *gate, const float *up, int n, float alpha, float limit);
int mlxcel_decode_attention_at(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                               float *out, int kv_heads, int group, int d, int write, int n, long capacity,
                               float scale);
int mlxcel_decode_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                  const float *values, float *out, float *k_out, float *v_out, int kv_heads,
                                  int group, int d, int n_base, long capacity, float scale);
int mlxcel_decode_attention_sinks(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                                  float *out, float *k_out, float *v_out, int kv_heads, int group, int d, int write,
                                  int n, long capacity, float scale, const float *sinks);
int mlxcel_chunk_attention(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                           float *out, int rows, int kv_heads, int group, int d, int pos, long capacity, float scale);
int mlxcel_chunk_attention_window(const float *q, const float *k_new, const float *v_new, float *keys, float *values,
                                  float *out, int rows, int kv_heads, int group, int d, int pos, long capacity,
                                  float scale, int window, const float *sinks);
int mlxcel_chunk_attention_apart(const float *q, const float *k_new, const float *v_new, const float *keys,
                                 const float *values, float *out, float *k_out, float *v_out, int rows,
                                 int kv_heads, int group, int d, int pos, long capacity, float scale);

#endif
