/* DeepSeek V2/V3's multi-head latent attention in the decode pass (mla_attention.h says what it
 * computes; runtime/decode_mla.py describes the layers).
 *
 * Why its own file: MLA's cache is not the plain attention's (heads of d keys and d values):
 * deepseek_v3's holds per position one latent row and one rotary key, which every head reads;
 * deepseek_v2's holds per-head keys and values of different widths. The attention here reads each
 * in the form mlx-lm's own step leaves it, so MLX's prefill, the prompt cache and slot files see
 * the same cache whichever of the two wrote it. The products go through decode_pass.c's (ggml's
 * blocks, the shim's kernels); the attention itself is a plain loop over the stored rows (widened
 * to float32 a unit at a time), exact in its sums' order for a row whatever the other rows. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blas_shim.h"
#include "decode_kernels.h"
#include "kv_rows.h"
#include "mla_attention.h"
#include "thread_pool.h"

/* Per-thread scratch (the engine thread runs the passes). */
static __thread struct mlxcel_scratch mla_scratch[9];
/* A unit's stored rows widened to float32 (keys, values) and its softmax row. */
static __thread struct mlxcel_scratch widened[3];

static float *mla_buffer(int i, size_t floats) { return mlxcel_scratch(&mla_scratch[i], sizeof(float) * (floats ? floats : 1)); }

/* A stored row: position s of head h, from the shared cache below `base`, else from the unit's own
 * rows (k_out / v_out: heads x n rows) or the cache itself (out NULL). */
static char *mla_row(void *cache, void *out, int64_t capacity, int64_t base, int n, int h, int64_t s, size_t bytes) {
    if (out && s >= base) return (char *)out + ((size_t)h * n + (size_t)(s - base)) * bytes;
    return (char *)cache + ((size_t)h * capacity + (size_t)s) * bytes;
}

/* p (n values) = softmax(p) in place, max-subtracted, float32. */
static void mla_softmax(float *p, int n) {
    float top = p[0], sum = 0.0f;
    for (int s = 1; s < n; s++) top = p[s] > top ? p[s] : top;
    for (int s = 0; s < n; s++) sum += p[s] = expf(p[s] - top);
    for (int s = 0; s < n; s++) p[s] /= sum;
}

static float mla_dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

int mlxcel_mla_layer(const struct mlxcel_mla *a, int hidden, int rows, const int *segments, int n_segments,
                     const struct mlxcel_mla_kv *kv, int k_type, int v_type, int traditional, int tiles,
                     const float *h, float *x, const double *scales, int n_adapters) {
    (void)hidden;
    int H = a->heads, nope = a->nope, rope = a->rope, lora = a->kv_lora, vd = a->v_dim, qd = nope + rope;
    int half = rope / 2, expanded = a->kv_b.n != 0;
    int kw = expanded ? qd : lora, vw = expanded ? vd : rope, hk = expanded ? H : 1; /* the cache's rows */
    size_t kb = kv_row_bytes(k_type, kw), vb = kv_row_bytes(v_type, vw);
    float *q = mla_buffer(0, (size_t)rows * H * qd);
    float *ckv = mla_buffer(1, (size_t)rows * (lora + rope));
    float *att = mla_buffer(2, (size_t)rows * H * vd);
    if (a->q.n) {
        mlxcel_pass_product(&a->q, rows, h, q, 0.0f, tiles, scales, n_adapters);
    } else {
        float *qa = mla_buffer(3, (size_t)rows * a->q_a.n);
        mlxcel_pass_product(&a->q_a, rows, h, qa, 0.0f, tiles, scales, n_adapters);
        mlxcel_rms_norm(qa, a->q_a_norm, qa, rows, a->q_a.n, a->q_a_eps);
        mlxcel_pass_product(&a->q_b, rows, qa, q, 0.0f, tiles, scales, n_adapters);
    }
    mlxcel_pass_product(&a->kv_a, rows, h, ckv, 0.0f, tiles, scales, n_adapters);
    float *lat = mla_buffer(3, (size_t)rows * lora); /* the normed latents (q_a's scratch is spent) */
    float *kpe = mla_buffer(4, (size_t)rows * rope);
    for (int r = 0; r < rows; r++) {
        mlxcel_rms_norm(ckv + (size_t)r * (lora + rope), a->kv_norm, lat + (size_t)r * lora, 1, lora, a->kv_eps);
        memcpy(kpe + (size_t)r * rope, ckv + (size_t)r * (lora + rope) + lora, sizeof(float) * rope);
    }
    float *kvb = NULL;
    if (expanded) {
        kvb = mla_buffer(5, (size_t)rows * H * (nope + vd));
        mlxcel_pass_product(&a->kv_b, rows, lat, kvb, 0.0f, tiles, scales, n_adapters);
    }
    float *qpe = mla_buffer(6, (size_t)H * rope), *qlat = mla_buffer(7, (size_t)H * (expanded ? qd : lora));
    float *row = mla_buffer(8, (size_t)(kw > vw ? kw : vw));
    int units = segments ? n_segments : rows;
    for (int u = 0; u < units; u++) {
        const struct mlxcel_mla_kv *s = &kv[u];
        int r0 = segments ? segments[u] : u, n = segments ? segments[u + 1] - r0 : 1;
        int64_t base = s->write, last = base + n - 1;
        if (base < 0 || (!s->k_out && last >= s->capacity)) return -1;
        /* the unit's rows into the cache (or its own rows beside a shared one) */
        for (int t = 0; t < n; t++) {
            int r = r0 + t;
            float *kp = kpe + (size_t)r * rope;
            mlxcel_rope(kp, 1, rope, s->cos + (size_t)t * half, s->sin + (size_t)t * half, traditional);
            if (!expanded) {
                kv_narrow(k_type, mla_row(s->keys, s->k_out, s->capacity, base, n, 0, base + t, kb), lat + (size_t)r * lora,
                          lora);
                kv_narrow(v_type, mla_row(s->values, s->v_out, s->capacity, base, n, 0, base + t, vb), kp, rope);
                continue;
            }
            for (int hh = 0; hh < H; hh++) {
                const float *kv_h = kvb + ((size_t)r * H + hh) * (nope + vd);
                memcpy(row, kv_h, sizeof(float) * nope);
                memcpy(row + nope, kp, sizeof(float) * rope);
                kv_narrow(k_type, mla_row(s->keys, s->k_out, s->capacity, base, n, hh, base + t, kb), row, qd);
                kv_narrow(v_type, mla_row(s->values, s->v_out, s->capacity, base, n, hh, base + t, vb), kv_h + nope, vd);
            }
        }
        /* the stored rows widened once for the unit: keys (hk, last + 1, kw), values (hk, last + 1, vw) */
        size_t span = (size_t)last + 1;
        float *kf = mlxcel_scratch(&widened[0], sizeof(float) * (size_t)hk * span * kw);
        float *vf_ = mlxcel_scratch(&widened[1], sizeof(float) * (size_t)hk * span * vw);
        float *p = mlxcel_scratch(&widened[2], sizeof(float) * span);
        for (int hh = 0; hh < hk; hh++)
            for (size_t t = 0; t < span; t++) {
                kv_widen(k_type, mla_row(s->keys, s->k_out, s->capacity, base, n, hh, (int64_t)t, kb),
                         kf + ((size_t)hh * span + t) * kw, kw);
                kv_widen(v_type, mla_row(s->values, s->v_out, s->capacity, base, n, hh, (int64_t)t, vb),
                         vf_ + ((size_t)hh * span + t) * vw, vw);
            }
        for (int t = 0; t < n; t++) {
            int r = r0 + t, seen = (int)(base + t) + 1;
            const float *qr = q + (size_t)r * H * qd;
            float *out = att + (size_t)r * H * vd;
            for (int hh = 0; hh < H; hh++) { /* the rope part of each head, rotated, times the scale */
                memcpy(qpe + (size_t)hh * rope, qr + (size_t)hh * qd + nope, sizeof(float) * rope);
            }
            mlxcel_rope(qpe, H, rope, s->cos + (size_t)t * half, s->sin + (size_t)t * half, traditional);
            for (int i = 0; i < H * rope; i++) qpe[i] *= a->scale;
            for (int hh = 0; hh < H; hh++) {
                const float *qn = qr + (size_t)hh * qd, *qp = qpe + (size_t)hh * rope;
                float *o = out + (size_t)hh * vd;
                if (expanded) { /* deepseek_v2: [q_nope | q_pe] against the head's stored keys */
                    float *qh = qlat;
                    for (int i = 0; i < nope; i++) qh[i] = qn[i] * a->scale;
                    memcpy(qh + nope, qp, sizeof(float) * rope);
                    const float *kh = kf + (size_t)hh * span * kw, *vh = vf_ + (size_t)hh * span * vw;
                    for (int j = 0; j < seen; j++) p[j] = mla_dot(qh, kh + (size_t)j * kw, qd);
                    mla_softmax(p, seen);
                    for (int c = 0; c < vd; c++) o[c] = 0.0f;
                    for (int j = 0; j < seen; j++)
                        for (int c = 0; c < vd; c++) o[c] += p[j] * vh[(size_t)j * vw + c];
                    continue;
                }
                /* deepseek_v3: the query's nope part into the latent space (embed_q), scaled */
                const float *wq = a->embed_q + (size_t)hh * lora * nope;
                float *ql = qlat;
                for (int c = 0; c < lora; c++) ql[c] = mla_dot(qn, wq + (size_t)c * nope, nope) * a->scale;
                for (int j = 0; j < seen; j++)
                    p[j] = mla_dot(ql, kf + (size_t)j * kw, lora) + mla_dot(qp, vf_ + (size_t)j * vw, rope);
                mla_softmax(p, seen);
                float *ol = row; /* the output in the latent space, then out of it (unembed_out) */
                for (int c = 0; c < lora; c++) ol[c] = 0.0f;
                for (int j = 0; j < seen; j++)
                    for (int c = 0; c < lora; c++) ol[c] += p[j] * kf[(size_t)j * kw + c];
                const float *wo = a->unembed_out + (size_t)hh * vd * lora;
                for (int c = 0; c < vd; c++) o[c] = mla_dot(ol, wo + (size_t)c * lora, lora);
            }
        }
    }
    mlxcel_pass_product(&a->o, rows, att, x, 1.0f, tiles, scales, n_adapters);
    return 0;
}
