/* The loader's rearrangements of a weight's rows into the layouts this project's kernels read:
 * split rows (block_weight.split_rows: split_rows.c's and mxfp4_rows.c's kernels) and grouped
 * rows (block_weight.group_rows: k_quant_rows.c's). Plain byte loops over the shim's threads, not
 * tied to AVX-512: always built, and exported (block_weight.library binds them). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "thread_pool.h"

/* The loader's split of a weight's rows (block_weight.split_rows), for every split type: each of
 * n rows of nb blocks of block_bytes, in groups of 16 blocks, becomes its group's field 0 of
 * every block, then field 1, ... (field f: widths[f] bytes at starts[f] of a block). A plain
 * byte loop: NumPy's strided copies of such short fields ran at 1/25 of memcpy's pace, 1.9 s a
 * stack of gpt-oss's experts (141 MB) and most of the model's load. */
struct split_job {
    const uint8_t *src;
    uint8_t *dst;
    long n, per; /* rows, and rows a part */
    int nb, block_bytes, fields;
    const int32_t *starts, *widths;
};

static void split_part(const void *ctx, int part) {
    const struct split_job *j = ctx;
    const size_t row = (size_t)j->nb * (size_t)j->block_bytes;
    long end = (part + 1) * j->per < j->n ? (part + 1) * j->per : j->n;
    for (long r = part * j->per; r < end; r++) {
        const uint8_t *in = j->src + (size_t)r * row;
        uint8_t *out = j->dst + (size_t)r * row;
        for (int b0 = 0; b0 < j->nb; b0 += 16) {
            const int count = j->nb - b0 < 16 ? j->nb - b0 : 16;
            for (int f = 0; f < j->fields; f++) {
                const int width = j->widths[f];
                for (int p = 0; p < count; p++, out += width) {
                    const uint8_t *from = in + (size_t)(b0 + p) * (size_t)j->block_bytes + (size_t)j->starts[f];
                    if (width == 16) memcpy(out, from, 16); /* nibbles and codes: one 16-byte move */
                    else for (int i = 0; i < width; i++) out[i] = from[i];
                }
            }
        }
    }
}

/* The rows in parts over the shim's threads: a stack of gpt-oss's experts is 2.5 GB split at load,
 * where each part's first touch of its output pages and its reads of the file's run side by side. */
void mlxcel_split_layout(const uint8_t *src, uint8_t *dst, long n, int nb, int block_bytes, int fields,
                         const int32_t *starts, const int32_t *widths) {
    const int parts = n < 256 ? 1 : 64;
    struct split_job j = {src, dst, n, (n + parts - 1) / parts, nb, block_bytes, fields, starts, widths};
    mlxcel_parallel(parts, split_part, &j);
}

/* The loader's grouping of a weight's rows (block_weight.group_rows): each whole group of 16 rows
 * of nb blocks of block_bytes becomes, block after block, the 16 rows' dwords side by side (the
 * block's `dwords` dwords from byte `lead`: dword 4 q + j of row r at 64 (4 slot + j) + 4 r, slot =
 * q's place in `quad_order`, or q where it is NULL), and each row's other bytes (the `lead` bytes
 * before its dwords, then those past them) in turn: after the dwords, or ahead of them where the
 * block starts mid-line (GROUP_TAILS_AHEAD: dst 64-byte aligned). Rows past the last whole group
 * are copied as they are. NumPy's transposes of 4-byte fields took ~7 s for a Qwen3-30B-A3B-shaped
 * file's 2.7 GB. */
struct group_job {
    const uint8_t *src;
    uint8_t *dst;
    long groups, per; /* whole groups, and groups a part */
    int nb, block_bytes, lead, dwords;
    int slot[64]; /* quad q's place */
};

static void group_part(const void *ctx, int part) {
    const struct group_job *j = ctx;
    const size_t row = (size_t)j->nb * (size_t)j->block_bytes, tail = (size_t)j->block_bytes - 4 * (size_t)j->dwords;
    const long end = (part + 1) * j->per < j->groups ? (part + 1) * j->per : j->groups;
    for (long g = part * j->per; g < end; g++) {
        const uint8_t *in = j->src + (size_t)g * 16 * row;
        uint8_t *out = j->dst + (size_t)g * 16 * row;
        for (int b = 0; b < j->nb; b++, out += 16 * (size_t)j->block_bytes) {
            const int ahead = tail && GROUP_TAILS_AHEAD(out);
            uint8_t *lanes = out + (ahead ? 16 * tail : 0), *tails = ahead ? out : out + 64 * (size_t)j->dwords;
            for (int r = 0; r < 16; r++) {
                const uint8_t *from = in + (size_t)r * row + (size_t)b * (size_t)j->block_bytes;
                for (int t = 0; t < j->dwords; t++)
                    memcpy(lanes + 64 * (size_t)(4 * j->slot[t / 4] + t % 4) + 4 * (size_t)r,
                           from + j->lead + 4 * (size_t)t, 4);
                if (j->lead) memcpy(tails + (size_t)r * tail, from, (size_t)j->lead);
                if (tail > (size_t)j->lead)
                    memcpy(tails + (size_t)r * tail + j->lead, from + j->lead + 4 * (size_t)j->dwords, tail - j->lead);
            }
        }
    }
}

void mlxcel_group_layout(const uint8_t *src, uint8_t *dst, long n, int nb, int block_bytes, int lead, int dwords,
                         const int8_t *quad_order) {
    const long groups = n / 16;
    const int parts = groups < 64 ? 1 : 64;
    struct group_job j = {src, dst, groups, (groups + parts - 1) / parts, nb, block_bytes, lead, dwords, {0}};
    for (int q = 0; q < (dwords + 3) / 4 && q < 64; q++) j.slot[quad_order ? quad_order[q] : q] = q;
    mlxcel_parallel(parts, group_part, &j);
    const size_t row = (size_t)nb * (size_t)block_bytes;
    memcpy(dst + (size_t)groups * 16 * row, src + (size_t)groups * 16 * row, (size_t)(n - groups * 16) * row);
}
