"""What each GGUF tensor becomes in memory, by device: the precision policy.

- **CPU**: everything is dequantized to float32. MLX's quantized matmul on the CPU is about 40x
  slower than a float32 matmul through OpenBLAS, and half-precision matmuls are as slow, so
  float32 is the fast form there (the memory cost is 4 bytes per weight).
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

FLOAT32, FLOAT16, BFLOAT16, AFFINE = "float32", "float16", "bfloat16", "affine"
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


def tensor_precision(ggml_type: int, on_cpu: bool, quantizable: bool, dtype: str) -> str:
    """How one tensor is kept: ``affine`` (MLX quantized) or a float dtype name.

    Args:
        ggml_type: the tensor's GGML type.
        on_cpu: whether MLX runs on the CPU.
        quantizable: the tensor is the weight of a Linear or Embedding whose rows are whole
            32-value groups (what ``nn.QuantizedLinear`` can hold).
        dtype: the model's compute dtype (``compute_dtype``).
    """
    if on_cpu:
        return FLOAT32
    if ggml_type in AFFINE_TYPES and quantizable:
        return AFFINE
    return dtype
