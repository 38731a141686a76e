"""llama.cpp-compatible token sampling on MLX.

The sampler chain follows llama.cpp (``common/sampling.cpp`` and ``src/llama-sampler.cpp``):
logit bias first, then the configured samplers in order, then the final draw. The common path
stays in lazy MLX ops so the engine can ``mx.async_eval`` the sampled token and pipeline decode
steps. One job per module:

- ``parsing.py``: the request's ``samplers`` names, aliases and characters, and ``logit_bias``;
- ``params.py``: ``SamplingParams``, a request's settings, and their defaults;
- ``candidates.py``: the candidate set every stage takes and returns;
- ``samplers.py``: the stages, one function each, and ``SAMPLERS``, the table the chain walks;
- ``dry.py`` and ``infill_pieces.py``: what DRY and infill derive from the vocabulary;
- ``history.py``: what the penalties and DRY keep of the tokens so far;
- ``draws.py``: the final draw (dist, mirostat 1/2, adaptive-p);
- ``chain.py``: ``SamplerChain``, one request's chain; ``results.py``: what a step gives back.

Adding a sampler: write its stage in ``samplers.py`` as a function of the candidates and the
request's ``ChainState`` that returns the candidates left, and register it in ``SAMPLERS``
under its llama.cpp name with the rule that says when it is active (llama.cpp leaves a sampler
whose parameters change nothing out of the chain); add that name to ``CANONICAL_SAMPLERS``
and its character to ``SAMPLER_CHARS`` in ``parsing.py``, and its parameters to
``SamplingParams`` (and to the request parser, ``server/params.py``). State it keeps across
steps goes in ``ChainState``; what it derives from the whole vocabulary gets a module of its
own, built once per tokenizer on the request's worker thread, as DRY's breakers are.
"""
