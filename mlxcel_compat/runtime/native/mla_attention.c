/* DeepSeek V2/V3's multi-head latent attention in the decode pass (mla_attention.h says what it
 * computes; runtime/decode_mla.py describes the layers).
 *
 * Why its own file: MLA's cache is not the plain attention's (heads of d keys and d values):
 * deepseek_v3's holds per position one latent row and one rotary key, which every head reads;
 * deepseek_v2's holds per-head keys and values of different widths. The attention here reads each
 * in the form mlx-lm's own step leaves it, so MLX's prefill, the prompt cache and slot files see
 * the same cache whichever of the two wrote it. The projections go through decode_pass.c's
 * products (ggml's blocks, the shim's kernels); the attention is a few products a head through the
 * shim's sgemm over the stored rows (a float32 cache read in place, any other widened to float32
 * once a unit), a unit being a decode row or a prompt chunk's rows together with a causal softmax
 * between. A decode row is always a unit of its own, so its result does not depend on the rows
 * that share its pass (rows together equal rows alone, bit for bit). */
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
/* A unit's stored rows widened to float32 (keys, values) and its scores (rows x positions). */
static __thread struct mlxcel_scratch widened[3];

/* A unit's queries, scaled, their rotary parts rotated: (n, heads, qd). */
static __thread struct mlxcel_scratch query_scratch;

static float *mla_queries(int n, int heads, int qd) {
    return mlxcel_scratch(&query_scratch, sizeof(float) * (size_t)n * heads * qd);
}

static float *mla_buffer(int i, size_t floats) {
    return mlxcel_scratch(&mla_scratch[i], sizeof(float) * (floats ? floats : 1));
}

/* Where position t of head h is stored for unit s (which: 0 keys, 1 values; rows of `bytes`):
 * a shared block below n_blocked, a row kept apart from a shared cache (k_out, v_out: heads x n
 * rows from `write` on), or the cache's own buffer (positions from n_blocked on). */
static char *mla_row(const struct mlxcel_mla_kv *s, int which, int n, int h, int64_t t, size_t bytes) {
    if (t < s->n_blocked) {
        int64_t b = t / s->block_tokens, n_blocks = s->n_blocked / s->block_tokens;
        const char *block = s->blocks[(size_t)which * n_blocks + b];
        return (char *)block + ((size_t)h * s->block_tokens + (size_t)(t % s->block_tokens)) * bytes;
    }
    void *out = which ? s->v_out : s->k_out;
    if (out && t >= s->write) return (char *)out + ((size_t)h * n + (size_t)(t - s->write)) * bytes;
    return (char *)(which ? s->values : s->keys) + ((size_t)h * s->capacity + (size_t)(t - s->n_blocked)) * bytes;
}

/* p (n values) = softmax(p) in place, max-subtracted, float32. */
static void mla_softmax(float *p, int n) {
    float top = p[0], sum = 0.0f;
    for (int s = 1; s < n; s++) top = p[s] > top ? p[s] : top;
    for (int s = 0; s < n; s++) sum += p[s] = expf(p[s] - top);
    for (int s = 0; s < n; s++) p[s] /= sum;
}

/* p (n x per rows of span scores, row t * per + h: the unit's row t, head h): row t sees positions
 * 0 .. base + t (causal), softmax over those, 0 beyond. */
static void mla_causal_softmax(float *p, int n, int per, int span, int64_t base) {
    for (int t = 0; t < n; t++) {
        int seen = (int)(base + t) + 1;
        for (int h = 0; h < per; h++) {
            float *row = p + ((size_t)t * per + h) * span;
            mla_softmax(row, seen);
            for (int j = seen; j < span; j++) row[j] = 0.0f;
        }
    }
}

enum { RowMajor = 101, NoTrans = 111, Trans = 112 };

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
    float *qpe = mla_buffer(6, (size_t)H * rope);
    float *row = mla_buffer(8, (size_t)(kw > vw ? kw : vw));
    int units = segments ? n_segments : rows;
    for (int u = 0; u < units; u++) {
        const struct mlxcel_mla_kv *s = &kv[u];
        int r0 = segments ? segments[u] : u, n = segments ? segments[u + 1] - r0 : 1;
        int64_t base = s->write, last = base + n - 1;
        float *qlat = mla_buffer(7, (size_t)n * H * lora); /* the latent queries (rows t, h), then the weighted latents */
        if (base < s->n_blocked || (!s->k_out && last - s->n_blocked >= s->capacity)) return -1;
        /* the unit's rows into the cache (or its own rows beside a shared one) */
        for (int t = 0; t < n; t++) {
            int r = r0 + t;
            float *kp = kpe + (size_t)r * rope;
            mlxcel_rope(kp, 1, rope, s->cos + (size_t)t * half, s->sin + (size_t)t * half, traditional);
            if (!expanded) {
                kv_narrow(k_type, mla_row(s, 0, n, 0, base + t, kb), lat + (size_t)r * lora,
                          lora);
                kv_narrow(v_type, mla_row(s, 1, n, 0, base + t, vb), kp, rope);
                continue;
            }
            for (int hh = 0; hh < H; hh++) {
                const float *kv_h = kvb + ((size_t)r * H + hh) * (nope + vd);
                memcpy(row, kv_h, sizeof(float) * nope);
                memcpy(row + nope, kp, sizeof(float) * rope);
                kv_narrow(k_type, mla_row(s, 0, n, hh, base + t, kb), row, qd);
                kv_narrow(v_type, mla_row(s, 1, n, hh, base + t, vb), kv_h + nope, vd);
            }
        }
        /* the stored rows as float32 (hk heads of span rows, kw and vw wide, a head every ks and vs
         * floats): a float32 cache the unit wrote into read in place, any other widened once */
        size_t span = (size_t)last + 1, ks = span * kw, vs = span * vw;
        float *p = mlxcel_scratch(&widened[2], sizeof(float) * span * (size_t)n * (expanded ? 1 : H));
        float *kf, *vf_;
        if (!s->k_out && !s->n_blocked && k_type == MLXCEL_KV_F32 && v_type == MLXCEL_KV_F32) {
            kf = s->keys, vf_ = s->values, ks = (size_t)s->capacity * kw, vs = (size_t)s->capacity * vw;
        } else {
            kf = mlxcel_scratch(&widened[0], sizeof(float) * (size_t)hk * ks);
            vf_ = mlxcel_scratch(&widened[1], sizeof(float) * (size_t)hk * vs);
            for (int hh = 0; hh < hk; hh++)
                for (size_t t = 0; t < span; t++) {
                    kv_widen(k_type, mla_row(s, 0, n, hh, (int64_t)t, kb),
                             kf + hh * ks + t * kw, kw);
                    kv_widen(v_type, mla_row(s, 1, n, hh, (int64_t)t, vb),
                             vf_ + hh * vs + t * vw, vw);
                }
        }
        /* the queries' rotary parts, rotated at each row's position, and every query part times the scale */
        float *qs = mla_queries(n, H, qd);
        for (int t = 0; t < n; t++) {
            const float *qr = q + (size_t)(r0 + t) * H * qd;
            float *qt = qs + (size_t)t * H * qd;
            for (int hh = 0; hh < H; hh++) memcpy(qpe + (size_t)hh * rope, qr + (size_t)hh * qd + nope, sizeof(float) * rope);
            mlxcel_rope(qpe, H, rope, s->cos + (size_t)t * half, s->sin + (size_t)t * half, traditional);
            for (int hh = 0; hh < H; hh++)
                for (int c = 0; c < qd; c++)
                    qt[(size_t)hh * qd + c] = (c < nope ? qr[(size_t)hh * qd + c] : qpe[(size_t)hh * rope + c - nope]) * a->scale;
        }
        int ldq = H * qd, ldo = H * vd;
        float *out = att + (size_t)r0 * ldo;
        if (expanded) {
            for (int hh = 0; hh < H; hh++) { /* deepseek_v2: [q_nope | q_pe] against the head's stored keys, its values */
                const float *kh = kf + hh * ks, *vh = vf_ + hh * vs;
                mlxcel_sgemm(RowMajor, NoTrans, Trans, n, (int)span, qd, 1.0f, qs + (size_t)hh * qd, ldq, kh, kw, 0.0f, p,
                             (int)span);
                mla_causal_softmax(p, n, 1, (int)span, base);
                mlxcel_sgemm(RowMajor, NoTrans, NoTrans, n, vd, (int)span, 1.0f, p, (int)span, vh, vw, 0.0f,
                             out + (size_t)hh * vd, ldo);
            }
            continue;
        }
        /* deepseek_v3: every row's and head's nope query into the latent space (embed_q, a head's
         * weights at a time; rows (t, h)), then for all of them at once, as every head reads the same
         * latents and rotary keys: the scores against the latents plus the rotary parts' against the
         * rotary keys, the causal softmax, the weighted latents; out of the latent space (unembed_out)
         * a head at a time */
        for (int hh = 0; hh < H; hh++)
            mlxcel_sgemm(RowMajor, NoTrans, Trans, n, lora, nope, 1.0f, qs + (size_t)hh * qd, ldq,
                         a->embed_q + (size_t)hh * lora * nope, nope, 0.0f, qlat + (size_t)hh * lora, H * lora);
        int m = n * H;
        mlxcel_sgemm(RowMajor, NoTrans, Trans, m, (int)span, lora, 1.0f, qlat, lora, kf, kw, 0.0f, p, (int)span);
        mlxcel_sgemm(RowMajor, NoTrans, Trans, m, (int)span, rope, 1.0f, qs + nope, qd, vf_, vw, 1.0f, p, (int)span);
        mla_causal_softmax(p, n, H, (int)span, base);
        mlxcel_sgemm(RowMajor, NoTrans, NoTrans, m, lora, (int)span, 1.0f, p, (int)span, kf, kw, 0.0f, qlat, lora);
        for (int hh = 0; hh < H; hh++)
            mlxcel_sgemm(RowMajor, NoTrans, Trans, n, vd, lora, 1.0f, qlat + (size_t)hh * lora, H * lora,
                         a->unembed_out + (size_t)hh * vd * lora, lora, 0.0f, out + (size_t)hh * vd, ldo);
    }
    mlxcel_pass_product(&a->o, rows, att, x, 1.0f, tiles, scales, n_adapters);
    return 0;
}
