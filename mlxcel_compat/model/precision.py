"""What each GGUF tensor becomes in memory, by device: the precision policy.

- **CPU**: the weights of linear layers and of the token embedding stay in the file's blocks
  (``blocks``): every quantized type, F16 and BF16, memory-mapped and multiplied by ggml's
  kernels (``block_weight.py``). Everything else (norms, F32 tensors, tensors of other layers)
  is float32, as MLX's CPU matmuls are fastest there. Without ggml's kernels (another
  platform, ``MLXCEL_GGML=0``) the block types are dequantized to float32 instead.
- **Metal / CUDA**: Q8_0, Q4_0 and Q4_1 matrices stay quantized as MLX affine weights (group
  size 32, 8 or 4 bits). The conversion is exact: same integers, same float16 scales, and the
  offsets ggml implies (-128 d, -8 d, or the stored min) are float16 values too. The other
  quantized types (Q5_0, Q5_1 and the K-quants, whose 16-value sub-blocks or 6-bit scales
  have no exact MLX form) are dequantized to the model's half-precision dtype: each weight is
  rounded once to float16 (relative error at most 2^-11, far below the quantization error
  itself). Float tensors keep the file's precision: an all-F32 file stays float32, a file with
  BF16 tensors runs in bfloat16, anything else in float16.

``tensor_precision`` is the whole decision, so it can be tested on any machine.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as T

from mlxcel_compat.model.ggml_cpu import BLOCK_TYPES

FLOAT32, FLOAT16, BFLOAT16, AFFINE, BLOCKS = "float32", "float16", "bfloat16", "affine", "blocks"
AFFINE_TYPES = frozenset({T.Q8_0, T.Q4_0, T.Q4_1})


def compute_dtype(on_cpu: bool, ggml_types: set[int]) -> str:
    """The float dtype the model runs in."""
    if on_cpu:
        return FLOAT32
    if T.BF16 in ggml_types:
        return BFLOAT16
    if ggml_types <= {T.F32}:
        return FLOAT32
    return FLOAT16


def tensor_precision(ggml_type: int, on_cpu: bool, quantizable: bool, dtype: str, blocks: bool = False) -> str:
    """How one tensor is kept: ``blocks`` (the file's, CPU), ``affine`` (MLX quantized) or a float
    dtype name.

    Args:
        ggml_type: the tensor's GGML type.
        on_cpu: whether MLX runs on the CPU.
        quantizable: the tensor is the weight of a Linear or Embedding whose rows are whole
            32-value groups (what ``nn.QuantizedLinear`` can hold, and what a block layer replaces).
        dtype: the model's compute dtype (``compute_dtype``).
        blocks: ggml's CPU kernels are loaded (``block_weight.library()``).
    """
    if on_cpu:
        return BLOCKS if blocks and quantizable and ggml_type in BLOCK_TYPES else FLOAT32
    if ggml_type in AFFINE_TYPES and quantizable:
        return AFFINE
    return dtype
