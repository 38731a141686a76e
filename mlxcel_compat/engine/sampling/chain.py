"""``SamplerChain``: one request's sampler chain, as llama.cpp runs it (``common/sampling.cpp``).

Logit bias first (a grammar's mask right after it), then the configured samplers in order
(``samplers.SAMPLERS``), then the final draw (``draws.py``). The common path stays in lazy MLX
ops so the engine can ``mx.async_eval`` the sampled token and pipeline decode steps.
"""

from __future__ import annotations

import secrets
from typing import Any, Iterable, Sequence

import mlx.core as mx
import numpy as np

from mlxcel_compat.engine.sampling.candidates import NEG_INF, Candidates
from mlxcel_compat.engine.sampling.draws import AdaptiveP, Mirostat, draw_dist, full_probs
from mlxcel_compat.engine.sampling.dry import dry_sequence_breakers
from mlxcel_compat.engine.sampling.history import TokenHistory
from mlxcel_compat.engine.sampling.params import DEFAULT_SEED, SamplingParams
from mlxcel_compat.engine.sampling.parsing import SAMPLER_ALIASES
from mlxcel_compat.engine.sampling.results import SampleResult
from mlxcel_compat.engine.sampling.samplers import SAMPLERS, ChainState, plain_temperature


class SamplerChain:
    """Samples tokens for one request with llama.cpp's chain semantics.

    Build one per request (it holds the RNG and penalty history) and call
    :meth:`sample` once per generated token, from any thread. ``history`` is the
    prompt plus the generated tokens so far; it must only grow between calls
    (elements may be ints or lazy MLX scalars, so the newest token need not be
    evaluated yet). ``n_ctx`` is what ``-1`` means for ``repeat_last_n`` /
    ``dry_penalty_last_n`` (None: unbounded). ``tokenizer`` (the served
    tokenizer, an HF tokenizer or an mlx-lm wrapper) is needed only for DRY and infill.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        eog_token_ids: Iterable[int] = (),
        tokenizer: Any = None,
        n_ctx: int | None = None,
    ) -> None:
        self.params = params
        self.vocab_size = int(vocab_size)
        self.eog_token_ids = [int(t) for t in eog_token_ids]
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.seed = int(params.seed) & 0xFFFFFFFF
        if self.seed == DEFAULT_SEED:
            self.seed = secrets.randbits(32)

        samplers = [SAMPLER_ALIASES.get(str(name).lower()) for name in params.samplers]
        if any(name is None for name in samplers):
            raise ValueError(f"unknown sampler in {params.samplers!r}")

        self._build_logit_bias()

        mirostat = int(params.mirostat)
        if mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0, 1 or 2, got {params.mirostat}")
        adaptive = "adaptive_p" in samplers and mirostat == 0 and params.adaptive_target >= 0.0
        self._stages = (
            [name for name in samplers if name in SAMPLERS and SAMPLERS[name].is_active(params)]
            if mirostat == 0 else []
        )
        if "infill" in self._stages and tokenizer is None:
            raise ValueError("the infill sampler needs a tokenizer")
        self._greedy_prefix = None if mirostat or adaptive else self._find_greedy_prefix()

        keys = mx.random.split(mx.random.key(self.seed), 2)
        self._dist_key, xtc_key = keys[0], keys[1]
        mx.eval(self._dist_key, xtc_key)
        rng = np.random.default_rng(self.seed)
        # The draws that replace dist and keep state across steps (None: not used).
        self.mirostat = Mirostat(mirostat, params.mirostat_tau, params.mirostat_eta, self.vocab_size, rng) if mirostat else None
        self.adaptive = AdaptiveP(params.adaptive_target, params.adaptive_decay, self.vocab_size, rng) if adaptive else None

        dry_active = "dry" in self._stages
        history = TokenHistory(params, self.vocab_size, n_ctx, "penalties" in self._stages, dry_active)
        dry_breakers: dict[int, list[tuple[int, ...]]] = {}
        if dry_active and params.dry_sequence_breakers:
            if tokenizer is None:
                raise ValueError("the dry sampler needs a tokenizer for its sequence breakers")
            dry_breakers = dry_sequence_breakers(tokenizer, params.dry_sequence_breakers)
        # What the stages read (samplers.py): public so that a test can run one stage alone.
        self.state = ChainState(params, self.vocab_size, self.eog_token_ids, tokenizer, history, dry_breakers, xtc_key)

    # -- construction helpers ------------------------------------------------

    def _build_logit_bias(self) -> None:
        bias: dict[int, float] = {}
        for token, value in self.params.logit_bias.items():
            token = int(token)
            if 0 <= token < self.vocab_size:
                bias[token] = bias.get(token, 0.0) + float(value)
        if self.params.ignore_eos:
            for token in self.eog_token_ids:
                if 0 <= token < self.vocab_size:
                    bias[token] = bias.get(token, 0.0) + NEG_INF
        self._bias_idx: mx.array | None = None
        self._bias_val: mx.array | None = None
        self._bias_np: tuple[np.ndarray, np.ndarray] | None = None  # argmax_of's copy, made at first use
        if bias:
            self._bias_idx = mx.array(list(bias.keys()), dtype=mx.int32)
            self._bias_val = mx.array(list(bias.values()), dtype=mx.float32)

    def _find_greedy_prefix(self) -> list[str] | None:
        """Stages to run before a plain argmax, or None if the full chain is needed.

        With temperature <= 0 the temperature stage keeps only the top token, so
        the result is the argmax after the stages that change logits. Stages that
        always keep the top token (top-k, top-p, min-p, top-n-sigma) can be
        skipped; typical-p, XTC and infill may drop it, so they force the full path.
        (Mirostat and adaptive-p draw otherwise: the full path too.)
        """
        p = self.params
        if p.temperature > 0.0 or p.dynatemp_range > 0.0 or "temperature" not in self._stages:
            return None
        prefix = self._stages[: self._stages.index("temperature")]
        if any(name in ("typ_p", "xtc", "infill") for name in prefix):
            return None
        return [name for name in prefix if name in ("penalties", "dry")]

    # -- public --------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        """True when each step is a plain argmax (temperature <= 0)."""
        return self._greedy_prefix is not None

    @property
    def is_plain_argmax(self) -> bool:
        """True when the token is the argmax of the logits after the logit bias (``ignore_eos``'s
        included: -inf on the end-of-generation tokens): greedy, nothing that reads the history,
        no post-sampling probabilities. A batch can then pick all such rows with one argmax
        (``biased``), and the CPU decode runtime's rows with ``argmax_of``, instead of one chain
        call per row (~0.1 ms of MLX ops a token)."""
        return self._greedy_prefix == [] and not self.params.post_sampling_probs

    def biased(self, logits: mx.array, row: int | None = None) -> mx.array:
        """``logits`` (a row, or row ``row`` of a batch's matrix) plus the logit bias, lazily: the
        same float32 additions as ``sample``'s."""
        if self._bias_idx is None:
            return logits
        if row is None:
            return logits.at[self._bias_idx].add(self._bias_val)
        return logits.at[mx.full(self._bias_idx.shape, row, mx.int32), self._bias_idx].add(self._bias_val)

    def argmax_of(self, logits: np.ndarray) -> int:
        """The argmax of a float32 NumPy row after the logit bias (the first of equal maxima, as
        MLX's): what ``sample`` draws when ``is_plain_argmax``. The row is biased in place for the
        argmax and put back (the bias's tokens are distinct), not copied."""
        if self._bias_idx is None:
            return int(logits.argmax())
        if self._bias_np is None:
            self._bias_np = (np.array(self._bias_idx, np.int64), np.array(self._bias_val, np.float32))
        idx, val = self._bias_np
        row = logits if logits.flags.writeable else logits.copy()
        saved = row[idx]
        row[idx] = saved + val
        try:
            return int(row.argmax())
        finally:
            row[idx] = saved

    def sample(self, logits: mx.array, history: Sequence[Any] | None = None, allowed: mx.array | None = None) -> SampleResult:
        """Sample the next token from raw logits of shape (vocab,).

        ``allowed``: a grammar's boolean mask (engine/grammar.py); the tokens outside it are
        removed right after the logit bias, before any other sampler (llama.cpp's grammar-first
        order), so every sampler and the final draw see only what the grammar accepts.
        """
        logits = logits.reshape(-1).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        self.state.history.update(history)

        c = Candidates(logits)
        if self._bias_idx is not None:
            c = Candidates(logits.at[self._bias_idx].add(self._bias_val))
        if allowed is not None:
            c = Candidates(mx.where(allowed, c.logits, NEG_INF))

        if self._greedy_prefix is not None:
            for name in self._greedy_prefix:
                c = SAMPLERS[name].apply(c, self.state)
            token = mx.argmax(c.logits).astype(mx.int32)
            probs = None
            if self.params.post_sampling_probs:
                probs = (mx.arange(self.vocab_size) == token).astype(mx.float32)
            return SampleResult(token, logprobs, probs)

        if self.mirostat is not None:
            c = plain_temperature(c, self.params.temperature)
            token, probs = self.mirostat.draw(c)
            return SampleResult(token, logprobs, probs if self.params.post_sampling_probs else None)

        for name in self._stages:
            c = SAMPLERS[name].apply(c, self.state)

        if self.adaptive is not None:
            token, probs = self.adaptive.draw(c)
        else:
            self._dist_key, sub = mx.random.split(self._dist_key)
            token, cand_probs = draw_dist(c, sub)
            token = token.astype(mx.int32)
            probs = full_probs(c, cand_probs, self.vocab_size) if self.params.post_sampling_probs else None
        return SampleResult(token, logprobs, probs if self.params.post_sampling_probs else None)
