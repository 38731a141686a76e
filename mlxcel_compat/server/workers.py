"""The bounded worker pool: the CPU work of requests runs here, never on the event loop.

One event loop serves every connection, ``/health`` included, so a handler must not spend long
on it. Parsing a large JSON body, rendering a chat template, tokenizing, and building a large
response go to this pool (``--threads-http`` threads, queued beyond that). The tokenizers'
batch encoder releases the GIL while it works; pure-Python steps (Jinja, building JSON) share
the GIL with the loop, which then still gets a turn every switch interval (5 ms).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

AUTO_THREADS = 4  # --threads-http -1: min(4, CPUs)


def pool_size(setting: int) -> int:
    return setting if setting > 0 else max(1, min(AUTO_THREADS, os.cpu_count() or 1))


class WorkerPool:
    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="mlxcel-worker")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a worker thread. A cancelled caller stops waiting; the call
        itself runs to its end (it only holds request-local data)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run ``fn()`` on a worker thread without waiting for it; an error is only logged."""

        def logged() -> None:
            try:
                fn()
            except Exception:
                log.exception("background request work failed")

        self._executor.submit(logged)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
