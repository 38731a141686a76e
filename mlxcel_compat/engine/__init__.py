"""The engine: the one thread that owns every piece of MLX state (the model, each sequence's cache,
the prompt cache) and what runs on it. ``core.py`` is the thread and its loop; a request becomes a
``sequence.py`` (built by ``factory.py``), whose passes ``scheduler.py`` runs alone or batched
(``batch.py``), sampled by ``sampling/``; ``prefix_cache.py`` adopts and donates its KV.
``client.py`` is the door the asyncio side uses; ``request.py`` holds the records that cross it.
"""
