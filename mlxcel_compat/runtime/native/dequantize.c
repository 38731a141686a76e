/* Weight rows of Q4_0, Q4_1, Q5_0 and Q5_1 expanded to float32 (a prompt chunk's tiles,
 * block_matmul.c; an embedding row), 16 values an instruction: ggml's to_float for these types
 * is its scalar reference code (~0.8 ns a value here, ~40 ms of a 32-token prompt on SmolLM2's
 * Q4_1 file; this takes ~0.1 ns). The same values as ggml's, bit for bit: the integer value
 * (less its offset) converted to float, times d, plus m for the types with a minimum (the
 * product of a 5-bit integer and a half-precision d is exact in float32, so a fused
 * multiply-add rounds once where ggml's x*d + m does). A 32-value block: value j of the first
 * half is the low nibble of qs[j], of the second half its high nibble; the Q5 types' fifth bits
 * are bits j and 16 + j of qh. (Q8_0's to_float, vectorized by the compiler, is as fast.)
 *
 * These are the expansions quant_rows.c's mlxcel_dequantizer hands out for the rows as ggml stores
 * them; split rows expand in split_rows.c.
 */
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
/* Where a 32-value type keeps its parts: bytes a block, offsets of the minimum m (-1: none),
 * the fifth bits qh (-1: none) and the 16 bytes of nibbles (d at 0), and the offset taken from
 * every integer value. */
struct nibble_layout {
    int bytes, m, qh, qs, offset;
};

static const struct nibble_layout Q4_0_LAYOUT = {18, -1, -1, 2, 8}, Q4_1_LAYOUT = {20, 2, -1, 4, 0},
                                  Q5_0_LAYOUT = {22, -1, 2, 6, 16}, Q5_1_LAYOUT = {24, 2, 4, 8, 0};

static inline __attribute__((always_inline)) void dequantize_nibbles(const uint8_t *x, float *y, int64_t k,
                                                                      struct nibble_layout L) {
    for (int64_t b = 0; b < k / 32; b++, x += L.bytes, y += 32) {
        uint16_t d, m = 0;
        uint32_t qh = 0;
        memcpy(&d, x, 2);
        if (L.m >= 0) memcpy(&m, x + L.m, 2);
        if (L.qh >= 0) memcpy(&qh, x + L.qh, 4);
        __m512i first, second;
        nibble_halves(x + L.qs, qh, L.qh >= 0, &first, &second);
        store_block(y, first, second, L.offset, half_to_float(d), L.m >= 0, half_to_float(m));
    }
}

void dequantize_q4_0(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q4_0_LAYOUT); }
void dequantize_q4_1(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q4_1_LAYOUT); }
void dequantize_q5_0(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q5_0_LAYOUT); }
void dequantize_q5_1(const void *x, float *y, int64_t k) { dequantize_nibbles(x, y, k, Q5_1_LAYOUT); }
#endif
