#!/usr/bin/env python3
"""Which products' 8-bit activations flip a quantized file's greedy choices.

``bench_quantized.py --measure accuracy`` compares each server's greedy tokens with a float32
reference: the file's own weights dequantized, every activation kept in float32. Both servers
multiply every quantized weight by activations rounded to 8 bits first (ggml's ``vec_dot_type``:
Q8_0 blocks of 32 for Q4_0-Q8_0 weights, Q8_K blocks of 256 for the K-quants), so that rounding
is where their greedy choices part from the reference's, near-ties deciding which side a token
falls. This script shows which products account for it: the same float32 reference, teacher
forced over the accuracy prompts' own text, with the activations of chosen products rounded to
8 bits (per block, scale = max |x| / 127), and how many positions' greedy token (argmax) then
differs from the unrounded reference's, with the reference's top-2 logit gap at those positions.

    .venv/bin/python scripts/check_activation_flips.py FILE --prompts 60

It rounds by the weight's shape, not its stored type: inputs of 32-multiples in blocks of 32
and the attention output's and the MLP's down projection's in blocks of 256 (Gemma 3 Q4_K_M's
Q4_K/Q6_K weights); the tied output head in blocks of 32 (its Q8_0). A model (mlx-lm) whose
products are ``nn.Linear`` and whose head is a tied ``nn.Embedding`` or a linear layer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime.backend import load_optimized_blas  # noqa: E402

load_optimized_blas()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402

import bench_quantized  # noqa: E402

# The products rounded to 8 bits in blocks of 256 (K-quant weights in a Q4_K_M file); others of 32.
K_BLOCK_INPUTS = ("o_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def rounded(x: mx.array, block: int) -> mx.array:
    """``x`` through 8-bit blocks and back: each block's values times 127 / max |x|, rounded."""
    blocks = x.reshape(-1, block)
    scale = mx.max(mx.abs(blocks), axis=-1, keepdims=True) / 127.0
    safe = mx.where(scale > 0, scale, 1.0)
    return (mx.round(blocks / safe) * scale).reshape(x.shape)


class Rounding:
    """Which products round their activations now (names of ``nn.Linear`` layers, ``"head"``)."""

    def __init__(self) -> None:
        self.on: set[str] = set()

    def install(self, model: nn.Module) -> list[str]:
        """Wrap ``nn.Linear`` and the tied head's ``as_linear``; the model's linear layers' names."""
        plain_linear, plain_head = nn.Linear.__call__, nn.Embedding.as_linear
        rounding = self

        def linear(layer: nn.Linear, x: mx.array) -> mx.array:
            name = getattr(layer, "flips_name", "")
            if name in rounding.on:
                x = rounded(x, 256 if name in K_BLOCK_INPUTS else 32)
            return plain_linear(layer, x)

        def head(embedding: nn.Embedding, x: mx.array) -> mx.array:
            return plain_head(embedding, rounded(x, 32) if "head" in rounding.on else x)

        nn.Linear.__call__, nn.Embedding.as_linear = linear, head
        names = set()
        for path, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.flips_name = "head" if path.endswith("lm_head") else path.split(".")[-1]
                names.add(module.flips_name)
        return sorted(names - {"head"})


def greedy(model: nn.Module, prompts: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt, every position's argmax and its top-2 logit gap (one teacher-forced pass)."""
    out = []
    for ids in prompts:
        logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
        top2 = np.sort(logits, axis=-1)[:, -2:]
        out.append((logits.argmax(-1), top2[:, 1] - top2[:, 0]))
        del logits
        mx.clear_cache()  # every prompt has its own length: cached buffers would pile up
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", help="a quantized GGUF file")
    parser.add_argument("--prompts", type=int, default=60, help="accuracy prompts of bench_quantized.py")
    args = parser.parse_args()
    from mlxcel_compat.gguf.load import load_gguf

    mx.set_default_device(mx.cpu)
    mx.set_cache_limit(1 << 30)
    model, tokenizer, _, _ = load_gguf(args.file, on_cpu=True, blocks=False)
    texts = [*bench_quantized.PROMPTS, *(bench_quantized._accuracy_text(i)
                                         for i in range(max(0, args.prompts - len(bench_quantized.PROMPTS))))]
    prompts = [[int(t) for t in tokenizer.encode(text)] for text in texts[: args.prompts]]
    rounding = Rounding()
    names = rounding.install(model)
    t0 = time.monotonic()
    reference = greedy(model, prompts)
    print(f"{sum(len(p) for p in prompts)} positions of {len(prompts)} prompts; products {', '.join(names)} "
          f"and the head; the reference in {time.monotonic() - t0:.0f} s", flush=True)
    variants = {"all": {*names, "head"}, "all but the head": set(names), "the head": {"head"},
                "attention (" + ", ".join(n for n in ATTENTION if n in names) + ")": set(ATTENTION) & set(names),
                "MLP (" + ", ".join(n for n in MLP if n in names) + ")": set(MLP) & set(names)}
    for label, on in variants.items():
        rounding.on = on
        gaps = [gap[i] for (want, gap), (got, _) in zip(reference, greedy(model, prompts))
                for i in np.nonzero(want != got)[0]]
        median = f"{np.median(gaps):.3g}" if gaps else "-"
        print(f"8-bit activations in {label:32s} flips {len(gaps):5d}  (reference's top-2 gap there: median {median})",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
