"""What each GGUF tensor becomes in memory, by device: the precision policy.

- **CPU**: the weights of linear layers, of the token embedding and the stacked experts of MoE
  layers (``ffn_*_exps``: one block weight per stack, ``runtime/block_experts.py``) stay in the
  file's blocks (``blocks``): every quantized type (MXFP4 and the i-quants included), F16 and BF16,
  memory-mapped and multiplied by ggml's kernels (``block_weight.py``); a type the loaded build
  of ggml lacks (``BlockLibrary.serves``) is dequantized to float32, and the log says so. Everything else (norms, F32 tensors, tensors of other layers)
  is float32, as MLX's CPU matmuls are fastest there. Without ggml's kernels (another
  platform, ``MLXCEL_GGML=0``) the block types are dequantized to float32 instead.
- **Metal / CUDA**: every quantized matrix of a Linear or Embedding becomes MLX affine
  quantization (``QuantizedLinear`` / ``QuantizedEmbedding``: ``scale * u + bias`` per group;
  MXFP4 MLX's ``mxfp4`` mode),
  built tensor by tensor from the file's blocks at about their size (``GPU_FORMS``,
  ``affine_form``). Scales and biases are kept in the compute dtype, as MLX's kernels require.
  Per type (bits per weight in brackets, float16 scales; ε = 2^-11 is float16's unit roundoff,
  2^-8 bfloat16's):

  ========  =====================  ============  =============================================
  type      MLX form               bytes / file  error against the file's own values
  ========  =====================  ============  =============================================
  Q8_0      8-bit, group 32 (9)    1.06x         none: the same integers, scale d, bias -128 d
  Q4_0      4-bit, group 32 (5)    1.11x         none: scale d, bias -8 d
  Q4_1      4-bit, group 32 (5)    1.00x         none: scale d, bias m
  Q5_0      5-bit, group 32 (6)    1.09x         none: scale d, bias -16 d
  Q5_1      5-bit, group 32 (6)    1.00x         none: scale d, bias m
  Q3_K      8-bit, group 128       2.40x         none: u = 128 - sc (q - 4) (sc (q - 4) lies in
            (8.25)                               [-124, 128]), scale -d, bias 128 d per block
  Q4_K      4-bit, group 32 (5)    1.11x         scale d sc and bias -dmin m per 32-value
  Q5_K      5-bit, group 32 (6)    1.09x         sub-block, each rounded once: at most
                                                 ε (|d sc| q + |dmin m|) per weight
  Q6_K      8-bit, group 64 (8.5)  1.295x        requantized: at most (max - min) / 510 over
                                                 its 64-value group, plus rounding (below)
  Q2_K      4-bit, group 32 (5)    1.90x         requantized: at most (max - min) / 30 over
                                                 its 32-value group, plus rounding (below)
  MXFP4     MLX mxfp4, group 32    1.00x         none: MLX's mxfp4 mode is the same format
            (4.25)                               (an E8M0 exponent, E2M1 codes reordered)
  IQ3_S     4-bit, group 32 (5)    1.45x         its grid is the odd integers g in [-15, 15]
                                                 times db = d (1 + 2 s) per 32 values: u = (g +
                                                 15) / 2, scale 2 db, bias -15 db, rounded once
  IQ1_S     2-bit, group 32 (3)    1.92x         g in {-1, 0, 1} plus delta (+-1/8) times dl
                                                 per 32 values: u = g + 1, scale dl, bias
                                                 dl (delta - 1), rounded once (Q4_K's bound)
  IQ4_NL    6-bit, group 32 (7)    1.56x         requantized, as Q6_K and Q2_K: at most
  IQ4_XS    6-bit, group 64 (6.5)  1.53x         (max - min) / (2 (2^bits - 1)) over the
  IQ3_XXS   5-bit, group 64 (5.5)  1.80x         group, plus rounding (below)
  IQ2_XXS   4-bit, group 64 (4.5)  2.18x
  IQ2_XS    4-bit, group 32 (5)    2.16x
  IQ2_S     4-bit, group 32 (5)    1.95x
  IQ1_M     4-bit, group 64 (4.5)  2.57x
  ========  =====================  ============  =============================================

  (Float16 subnormals add at most 2^-25 to a rounded scale or bias.) The requantized bound in
  full, with ``top = 2^bits - 1`` and e = 2^-10 (one float16 ulp, relative; 2^-7 in bfloat16):
  half the grid step, ``(max - min + e |min| + 2^-24) / top * (1 + e) / 2 + 2^-25``.

  Q6_K and Q2_K have a scale (and Q2_K a min) per 16 values, and MLX's groups start at 32, so
  their values are requantized: bias = the group's minimum rounded down, scale = (max - bias) /
  (2^bits - 1) rounded up, each value to the nearest point of that grid (``requantize``).
  Measured on heavy-tailed weights (Student-t, 512 x 2048) quantized by ggml: Q6_K's 8-bit g64
  adds an RMS error 0.30x the file's own quantization error (the error against the original
  weights grows 4.5%); 8-bit g32 would add 0.25x but costs 9 bits per weight, 1.37x the file, over
  the 1.3x memory goal; 6-bit forms add 1.0x. Q2_K's 4-bit g32 adds 0.23x (+2.7%) at 1.9x the
  file, where 8-bit g64 would add 0.02x at 3.24x; a Q2_K file is chosen for its size. Q3_K keeps
  its exact 8-bit form (a 5-bit requantization would save 0.65x and add 0.25x). On the factory's
  small llama the forms move the logits (RMS) by this share of what the file's own quantization
  moved them from the F32 file: Q8_0 and Q3_K 0 (float32 sums), Q4_K_M 0.05, Q5_K_M 0.10, Q6_K
  0.32, Q2_K 0.31 (tests/gguf/test_gpu_policy.py).

  Two i-quants keep their own integers: IQ3_S's grid points are the odd numbers 1..15 and IQ1_S's
  -1, 0, 1 (plus a shift shared by 32 values), evenly spaced, with one factor per 32 values; the
  integers are read from the decoded values (exact multiples of the step), so ggml's grid
  tables stay ggml's. The others' values lie on non-uniform codes (IQ4_NL, IQ4_XS: -127..113),
  on grids with uneven steps (IQ3_XXS: 4..52 by 8, then 62; IQ2_*: 8, 25, 43) or under a factor
  per 16 values (IQ1_M), which an affine grid holds exactly only in 6-8 bits (IQ4_NL 8-bit g32
  exact would be 2.0x its file; IQ3_XXS 6-bit 2.29x), so they are requantized, each to the
  smallest form that adds at most 0.3x the file's own RMS error, as Q6_K's and Q2_K's do
  (measured on the same weights, 32 x 2048, quantized by ggml with a uniform importance
  matrix): IQ4_NL 0.23x, IQ4_XS 0.29x, IQ3_XXS 0.29x, IQ2_XXS 0.26x, IQ2_XS 0.26x, IQ2_S 0.29x,
  IQ1_M 0.22x (IQ3_S's and IQ1_S's own forms: 0.006x, 0.001x, their rounded factors); the next
  smaller form of each adds 0.33-0.45x. (IQ4_NL keeps groups of 32, its block: a row need not
  be whole 64-value groups.) The low-bit types cost 2-2.6x their file, still 3.5-5.5x less than
  float16. MXFP4 (gpt-oss's experts)
  needs no such choice: where MLX has the ``mxfp4`` mode (``mlx_has_mxfp4``) its layers hold
  the file's exponents and codes, every value exact (an exponent of 255, E8M0's NaN, which ggml
  reads as 2^128 and never writes, leaves the tensor to be dequantized); elsewhere MXFP4
  tensors are dequantized to the compute dtype. MLX's mxfp4 embedding gives bfloat16 rows
  whatever the model's dtype, so an MXFP4 embedding is dequantized (gpt-oss's is BF16 anyway).

  The exact forms are exact in float16; in a bfloat16 model (a file with BF16 tensors) their
  scales, which are float16 values, are rounded to bfloat16 (the Q4_K bound with ε = 2^-8). A
  tensor whose scales or biases overflow the compute dtype (|d| >= 512 for Q8_0's -128 d) is
  dequantized to that dtype instead, and the load logs it. Float tensors keep the file's
  precision: an all-F32 file stays float32, a file with BF16 tensors runs in bfloat16, anything
  else in float16; quantized tensors that are not the weight of a Linear or Embedding (none in
  the supported families) are dequantized to the compute dtype.

``tensor_precision`` and ``affine_form`` are the whole decision, so they can be tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gguf import GGMLQuantizationType as T

from mlxcel_compat.gguf import quants as gguf_quants
from mlxcel_compat.runtime.ggml_cpu import BLOCK_TYPES

FLOAT32, FLOAT16, BFLOAT16, AFFINE, BLOCKS = "float32", "float16", "bfloat16", "affine", "blocks"
EXACT, ROUNDED, REQUANTIZED = "exact", "rounded", "requantized"
MXFP4 = "mxfp4"  # MLX's quantization mode of the same name (an AffineForm's ``mode``)

# (bits, group size) of the MLX affine form of each quantized type on Metal / CUDA. IQ3_S and
# IQ1_S keep their own integers; the other i-quants' values lie on uneven codes and grids: each
# is requantized to the smallest form that adds at most 0.3x the file's own RMS error (Q6_K's
# and Q2_K's share; measured above).
GPU_FORMS: dict[int, tuple[int, int]] = {
    T.Q8_0: (8, 32), T.Q4_0: (4, 32), T.Q4_1: (4, 32), T.Q5_0: (5, 32), T.Q5_1: (5, 32),
    T.Q4_K: (4, 32), T.Q5_K: (5, 32), T.Q3_K: (8, 128), T.Q6_K: (8, 64), T.Q2_K: (4, 32),
    T.IQ4_XS: (6, 64), T.IQ4_NL: (6, 32), T.IQ3_XXS: (5, 64), T.IQ3_S: (4, 32), T.IQ2_XXS: (4, 64),
    T.IQ2_XS: (4, 32), T.IQ2_S: (4, 32), T.IQ1_S: (2, 32), T.IQ1_M: (4, 64),
}


@lru_cache(maxsize=1)
def mlx_has_mxfp4() -> bool:
    """Whether the MLX installed quantizes in its ``mxfp4`` mode (recent versions: 0.29 on)."""
    try:
        import mlx.core as mx

        mx.quantize(mx.zeros((1, 32)), group_size=32, bits=4, mode=MXFP4)
    except (ImportError, TypeError, ValueError, RuntimeError):
        return False
    return True


@dataclass(frozen=True)
class AffineForm:
    """How one quantized type is held as MLX affine weights.

    ``method``: ``exact`` (the file's integers, scales and biases, unchanged), ``rounded`` (the
    file's integers; scales and biases rounded once to the compute dtype) or ``requantized``
    (new integers from the file's values, per group).
    """

    bits: int
    group_size: int
    method: str
    mode: str = AFFINE  # or MXFP4: MLX's mxfp4 mode (an 8-bit exponent per group, no bias)

    @property
    def bits_per_weight(self) -> float:
        """With half-precision scales and biases (one of each per group), or mxfp4's 8-bit scale."""
        return self.bits + (8 if self.mode == MXFP4 else 32) / self.group_size

    def describe(self) -> str:
        if self.mode == MXFP4:
            return f"MLX mxfp4, group {self.group_size} ({self.method})"
        return f"MLX affine {self.bits}-bit, group {self.group_size} ({self.method})"


def compute_dtype(on_cpu: bool, ggml_types: set[int]) -> str:
    """The float dtype the model runs in."""
    if on_cpu:
        return FLOAT32
    if T.BF16 in ggml_types:
        return BFLOAT16
    if ggml_types <= {T.F32}:
        return FLOAT32
    return FLOAT16


def affine_form(ggml_type: int, dtype: str) -> AffineForm | None:
    """The MLX affine form of ``ggml_type`` with scales in ``dtype``, or None for types without one.

    Exactness is known from the types alone: the file's integers fit when ``gguf_quants`` has an
    integer form with these bits and a group the size divides, and its scales are exact when the
    dtype has the significant bits they need (float16: 11, bfloat16: 8, float32: 24).
    """
    if ggml_type == T.MXFP4:  # the same format: the file's exponents and codes (gguf_quants.to_mxfp4)
        return AffineForm(4, 32, EXACT, MXFP4) if mlx_has_mxfp4() else None
    if ggml_type not in GPU_FORMS:
        return None
    bits, group_size = GPU_FORMS[ggml_type]
    form = gguf_quants.integer_form(ggml_type, bits, group_size)
    if form is None:
        return AffineForm(bits, group_size, REQUANTIZED)
    exact = form.scale_bits <= gguf_quants.DTYPE_BITS[dtype]
    return AffineForm(bits, group_size, EXACT if exact else ROUNDED)


def tensor_precision(ggml_type: int, on_cpu: bool, quantizable: bool, dtype: str, blocks: bool = False,
                     embedding: bool = False) -> str:
    """How one tensor is kept: ``blocks`` (the file's, CPU), ``affine`` (MLX quantized, in the
    form ``affine_form`` gives) or a float dtype name.

    Args:
        ggml_type: the tensor's GGML type.
        on_cpu: whether MLX runs on the CPU.
        quantizable: the tensor is the weight of a Linear or Embedding whose rows are whole
            32-value groups (what ``nn.QuantizedLinear`` can hold, and what a block layer replaces;
            the affine forms with larger groups belong to K-quants, whose rows are whole 256-value
            blocks).
        dtype: the model's compute dtype (``compute_dtype``).
        blocks: ggml's CPU kernels are loaded and have this type's (``BlockLibrary.serves``).
        embedding: the tensor is an embedding table's (MLX's mxfp4 embedding expands rows to
            bfloat16 whatever the model's dtype: MXFP4 embeddings are expanded to ``dtype``).
    """
    if on_cpu:
        return BLOCKS if blocks and quantizable and ggml_type in BLOCK_TYPES else FLOAT32
    form = affine_form(ggml_type, dtype) if quantizable else None
    if form is not None and not (embedding and form.mode == MXFP4):
        return AFFINE
    return dtype
