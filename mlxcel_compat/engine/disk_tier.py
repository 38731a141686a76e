"""The prompt cache's disk tier as the engine uses it: spill, probe, load, and a writer thread.

    RAM store evicts an entry (LRU / bytes) ──► spill: encode (zero-copy views, engine thread)
        ──► writer thread: temp file, hash, fsync, rename, budget ──► results ──► index.add
    request misses RAM (or RAM's match is shorter) ──► refresh the index with what other
        servers on the directory wrote or deleted since ──► probe it (same key and prefix rules)
        ──► load: header, tokens, tensors, checksum, rebuild (engine thread) ──► promote into
        the RAM store, where the normal lookup adopts it
    clean shutdown ──► flush: every RAM entry not on disk yet (newest first, up to the budget)
    --prompt-cache-write-through ──► spill each entry as soon as the RAM store holds it, so that
        servers sharing the directory (replicas behind a router) find it without waiting for
        an eviction: a shared system prompt is then prefilled once for all of them

The index and every MLX object belong to the engine thread. The writer thread only reads numpy
views of evaluated arrays and touches files; a finished job goes back to the engine thread (which
drops the arrays) through a results queue, and ``wake`` asks the engine to collect it soon. The
writer runs at a lower CPU priority, hashes and writes in 8 MiB steps (releasing the GIL), and
the queue is bounded in bytes: when it is full, an evicted entry is dropped (counted) rather than
making decode wait. The files are written with ``O_DIRECT`` where the filesystem takes it
(``cache/disk_write.py``), and while the engine has work (``busy``) the writer paces itself to
``BUSY_WRITE_BYTES_PER_S``, at full speed again once it is idle: on a machine whose cores decode
already uses in full, writing evicted entries through the page cache at full speed (~100 MB/s when
a 2K-token entry is evicted twice a second) cost decode up to 17 % even at the lowest CPU
priority; with both, it measured within the noise of runs that wrote nothing
(docs/benchmarks/disk-tier.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlxcel_compat.cache import kv, kv_io
from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.disk_directory import directory_lock, enforce_budget, entry_name, touch
from mlxcel_compat.cache.disk_format import REJECT_REASONS, Compat, DiskReject, EntryHeader, Tensor, read_header
from mlxcel_compat.cache.disk_index import DiskIndex, DiskRef
from mlxcel_compat.cache.disk_write import commit, discard, write_temp
from mlxcel_compat.cache.records import CacheEntry, CacheHit
from mlxcel_compat.cache.store import EntryStore

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 1 << 30  # evicted entries waiting for the writer; more are dropped
WRITER_NICE = 19  # where SCHED_IDLE is not available: the writer yields the CPU to decode
# Write rate while the engine has work (requests running or waiting). A new 2K-token entry of the
# small llama (50 MB) takes seconds of prefill on these cores, so new KV arrives at ~20 MB/s at
# most; faster evictions are repeats and extensions of what is already cached.
BUSY_WRITE_BYTES_PER_S = 32 << 20


@dataclass
class Loaded:
    """A payload read back from disk, with the header it was checked against."""

    header: EntryHeader
    payload: list[Any]


@dataclass
class _Job:
    path: Path
    header: EntryHeader
    tensors: list[Tensor] | None  # numpy views of the entry's arrays: dropped on the engine thread
    nbytes: int
    generation: int


@dataclass
class _Result:
    job: _Job
    size: int = 0
    error: str | None = None
    discarded: bool = False  # a reset happened while it was written
    removed: list[Path] = field(default_factory=list)  # deleted by the budget
    paced_ms: float = 0.0  # pauses while the engine was busy


@dataclass
class DiskCountersEngine:
    lookups: int = 0  # requests for which the disk index was consulted
    hits: int = 0  # requests served from a file (loaded, checked and promoted into RAM)
    tokens_loaded: int = 0  # prompt tokens those hits adopted
    loads: int = 0  # files read back and checked
    load_ms_total: float = 0.0
    load_ms_last: float = 0.0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    write_errors: int = 0
    writes_dropped: int = 0  # the queue was full
    writes_skipped: int = 0  # already on disk, or larger than the whole budget
    write_paced_ms: float = 0.0  # the writer's pauses while the engine was busy


class DiskTier:
    """Disk-backed second tier behind the RAM stores (``--prompt-cache-dir``)."""

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        compat: Compat,
        min_prefix: int,
        apc: ApcConfig | None,
        wake: Callable[[], None] = lambda: None,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.index = DiskIndex(root, compat, capacity_bytes, min_prefix, apc)
        t0 = time.perf_counter()
        self.startup = self.index.open()
        self.startup_ms = (time.perf_counter() - t0) * 1000.0
        self.counters = DiskCountersEngine()
        self.generation = 0  # bumped by clear(): jobs of an older generation are not committed
        self._pending_bytes = 0
        self._queued: dict[Path, _Job] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._results: queue.Queue[_Result] = queue.Queue()
        self._wake = wake
        self._busy = busy  # read by the writer thread: whether the engine has work now
        self._flushing = False  # the shutdown flush writes at full speed
        self._writer = threading.Thread(target=self._write_loop, name="mlxcel-disk-writer", daemon=True)
        self._writer.start()
        log.info(
            "prompt-cache disk tier: %s (%d bytes budget): %d entries indexed from %d files in %.0f ms "
            "(%d rejected, %d stale temporary files, %d removed by the budget)",
            self.index.directory, capacity_bytes, self.startup["indexed"], self.startup["files"], self.startup_ms,
            self.startup["rejected"], self.startup["stale_temp"], self.startup["removed_by_budget"],
        )

    # ------------------------------------------------------------------ engine thread

    def spill(self, kind: str, entry: CacheEntry, force: bool = False) -> bool:
        """Queue an entry that leaves RAM for writing; False when it is not written.

        ``force`` ignores the queue bound (the shutdown flush: the entries are in RAM anyway).
        """
        self.collect()
        if self.index.has(kind, entry.bucket, entry.session_key, entry.tokens) or entry.nbytes > self.capacity_bytes:
            self.counters.writes_skipped += 1
            return False
        header = EntryHeader(
            kind=kind, compat=self.index.compat, bucket=entry.bucket, session_key=entry.session_key,
            tokens=entry.tokens, origin=entry.origin, trimmable=entry.trimmable, nbytes=entry.payload_nbytes, layout={},
        )
        path = self.index.directory / entry_name(kind, header.digest)
        if path in self._queued:
            self.counters.writes_skipped += 1
            return False
        if not force and self._pending_bytes + entry.nbytes > MAX_PENDING_BYTES:
            self.counters.writes_dropped += 1
            return False
        header.layout, tensors = kv_io.encode(kv.materialize(entry.payload))  # a table's blocks gathered
        job = _Job(path, header, tensors, sum(t.nbytes for t in tensors), self.generation)
        self._queued[path] = job
        self._pending_bytes += job.nbytes
        self._jobs.put(job)
        return True

    def probe(self, kind: str, bucket: Any, session_key: str, tokens: list[int]) -> CacheHit | None:
        """The disk index's best match for a request (same rules as RAM), without loading it."""
        self.collect()
        self.index.refresh(skip=self._queued)
        store = self.index.stores[kind]
        if not len(store):
            return None
        return store.lookup(bucket, session_key, tokens, record=False).hit  # type: ignore[attr-defined]

    def load(self, kind: str, hit: CacheHit, request: list[int]) -> Loaded | None:
        """Read a probed entry back; None when the file is gone or rejected (then removed).

        Checks, in order: the header (checksum, model, runtime, size), its tokens against the index
        and against the request up to the adopted length, the tensor bytes against their checksum,
        that the path still names the file that was read, and that the state rebuilds.
        """
        ref: DiskRef = hit.entry.payload  # type: ignore[assignment]
        t0 = time.perf_counter()
        try:
            header, inode = read_header(ref.path, self.index.compat, (kind,))
            if header.tokens != hit.entry.tokens:
                raise DiskReject("token_mismatch", "the file's tokens differ from the indexed ones")
            n = hit.matched_len
            if list(header.tokens[:n]) != list(request[:n]):
                raise DiskReject("token_mismatch", f"the first {n} tokens differ from the request")
            # Another process may have replaced the file (same key) since its header was read: then
            # what was read belongs to two files, which is a miss (FileNotFoundError), not damage.
            try:
                arrays = kv_io.load_arrays(ref.path, header)
            except DiskReject:
                _same_file(ref.path, inode)
                raise
            _same_file(ref.path, inode)
            payload = kv_io.decode(header.layout, arrays)
            if kind == "kv" and any(getattr(layer, "offset", len(header.tokens)) != len(header.tokens) for layer in payload):
                raise DiskReject("bad_payload", "the state does not hold as many tokens as the header")
        except FileNotFoundError:
            self.index.forget(ref.path)
            self.index.counters.vanished += 1
            return None
        except DiskReject as exc:
            log.warning("prompt-cache disk tier: rejected %s (%s: %s); removed", ref.path.name, exc.reason, exc.detail)
            self.index.reject(exc.reason, ref.path, exc.detail, remove=True)
            return None
        touch(ref.path)
        ms = (time.perf_counter() - t0) * 1000.0
        c = self.counters
        c.loads += 1
        c.load_ms_total += ms
        c.load_ms_last = ms
        c.bytes_read += ref.size
        log.debug("prompt-cache disk tier: loaded %s (%d tokens, %d bytes) in %.1f ms", ref.path.name, len(header.tokens), ref.size, ms)
        return Loaded(header, payload)

    def collect(self) -> None:
        """Apply the writer's finished jobs to the index (and drop their arrays here)."""
        while True:
            try:
                self._apply(self._results.get_nowait())
            except queue.Empty:
                return

    def _apply(self, result: _Result) -> None:
        job = result.job
        self._queued.pop(job.path, None)
        self._pending_bytes -= job.nbytes
        job.tensors = None
        if result.error is not None:
            self.counters.write_errors += 1
            log.warning("prompt-cache disk tier: writing %s failed: %s", job.path.name, result.error)
        self.counters.write_paced_ms += result.paced_ms
        if result.error is None and not result.discarded:
            self.counters.writes += 1
            self.counters.bytes_written += result.size
            self.index.add(job.header, job.path, result.size)
        for path in result.removed:
            self.index.forget(path)
        self.index.counters.removed_by_budget += len(result.removed)

    def flush(self, stores: dict[str, EntryStore], timeout: float) -> int:
        """Write every RAM entry that is not on disk yet (clean shutdown); return how many.

        The most recently used entries that fit the budget are chosen, and written oldest first so
        that the newest get the newest modification times (the budget evicts the oldest). One at a
        time: a file holds an entry whole, so each one's shared blocks are gathered into a copy of
        its own, and queueing them all at once would raise memory toward the entries' logical total
        (64 sessions sharing a 4K-token prompt: 64 copies of it) just as the server exits.
        """
        chosen: list[tuple[str, CacheEntry]] = []
        room = self.capacity_bytes
        pairs = [(kind, e) for kind, store in stores.items() for e in store.entries()]
        for kind, entry in sorted(pairs, key=lambda p: p[1].last_used, reverse=True):
            if entry.nbytes <= room:
                chosen.append((kind, entry))
                room -= entry.nbytes
        self._flushing = True
        deadline = time.monotonic() + timeout
        written = 0
        for done, (kind, entry) in enumerate(reversed(chosen)):
            if time.monotonic() >= deadline:
                log.warning("prompt-cache disk tier: %d entries not written: the shutdown flush ran out of time",
                            len(chosen) - done)
                break
            if self.spill(kind, entry, force=True):
                written += 1
                self.wait_written(deadline - time.monotonic())  # its copy is gone before the next is made
        self.wait_written(max(0.0, deadline - time.monotonic()))
        if self._queued:
            log.warning("prompt-cache disk tier: %d entries were still being written at shutdown", len(self._queued))
        return written

    def wait_written(self, timeout: float) -> bool:
        """Wait until every queued entry is written (or ``timeout`` passes); True if none is left."""
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            try:
                self._apply(self._results.get(timeout=min(0.1, max(0.0, deadline - time.monotonic()))))
            except queue.Empty:
                pass
        self.collect()
        return not self._queued

    def clear(self) -> tuple[int, int]:
        """Drop every entry of this model from disk (``POST /v1/cache/reset``); (entries, bytes)."""
        self.generation += 1
        with contextlib.suppress(queue.Empty):
            while True:
                job = self._jobs.get_nowait()
                if job is not None:
                    self._queued.pop(job.path, None)
                    self._pending_bytes -= job.nbytes
                    job.tensors = None
        self.collect()
        entries, nbytes = self.index.entries, self.index.nbytes
        self.index.clear()
        return entries, nbytes

    def close(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._writer.join(timeout)
        self.collect()

    def stats(self) -> dict[str, Any]:
        self.collect()
        c, ic = self.counters, self.index.counters
        return {
            "enabled": True,
            "path": str(self.index.directory),
            "entries": self.index.entries,
            "bytes": self.index.nbytes,
            "capacity_bytes": self.capacity_bytes,
            "lookups": c.lookups,
            "hits": c.hits,
            "misses": c.lookups - c.hits,
            "tokens_loaded_total": c.tokens_loaded,
            "loads": c.loads,
            "load_ms_total": round(c.load_ms_total, 3),
            "load_ms_avg": round(c.load_ms_total / c.loads, 3) if c.loads else 0.0,
            "load_ms_last": round(c.load_ms_last, 3),
            "bytes_read_total": c.bytes_read,
            "writes": c.writes,
            "bytes_written_total": c.bytes_written,
            "writes_dropped": c.writes_dropped,
            "writes_skipped": c.writes_skipped,
            "write_errors": c.write_errors,
            "write_paced_ms_total": round(c.write_paced_ms, 3),
            "write_queue_entries": len(self._queued),
            "write_queue_bytes": self._pending_bytes,
            "evictions": ic.removed_by_budget,
            "vanished": ic.vanished,
            "picked_up": ic.picked_up,
            "refreshes": ic.refreshes,
            "rejections": dict(ic.rejections),
            "last_reject": dict(ic.last_reject) if ic.last_reject is not None else None,
            "startup_ms": round(self.startup_ms, 3),
            "startup": dict(self.startup),
        }

    @staticmethod
    def disabled_stats() -> dict[str, Any]:
        """The same keys with the tier off."""
        return {
            "enabled": False, "path": None, "entries": 0, "bytes": 0, "capacity_bytes": 0, "lookups": 0,
            "hits": 0, "misses": 0, "tokens_loaded_total": 0, "loads": 0, "load_ms_total": 0.0, "load_ms_avg": 0.0,
            "load_ms_last": 0.0, "bytes_read_total": 0, "writes": 0, "bytes_written_total": 0,
            "writes_dropped": 0, "writes_skipped": 0, "write_errors": 0, "write_paced_ms_total": 0.0, "write_queue_entries": 0,
            "write_queue_bytes": 0, "evictions": 0, "vanished": 0, "picked_up": 0, "refreshes": 0,
            "rejections": dict.fromkeys(REJECT_REASONS, 0), "last_reject": None, "startup_ms": 0.0,
            "startup": dict(files=0, indexed=0, rejected=0, stale_temp=0, removed_by_budget=0),
        }

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            result = _Result(job)

            def pace(nbytes: int, result: _Result = result) -> None:
                if not self._flushing and self._busy():
                    pause = nbytes / BUSY_WRITE_BYTES_PER_S
                    time.sleep(pause)
                    result.paced_ms += pause * 1000.0

            try:
                assert job.tensors is not None
                temp = write_temp(job.path, job.header, job.tensors, pace)
                with directory_lock(self.root):
                    if job.generation != self.generation:
                        discard(temp)
                        result.discarded = True
                    else:
                        commit(temp, job.path)
                        result.size = temp.size
                        result.removed = enforce_budget(self.root, self.capacity_bytes)
            except Exception as exc:  # a full disk or a vanished directory must not stop the writer
                result.error = f"{type(exc).__name__}: {exc}"
            self._results.put(result)
            del job, result
            self._wake()


def _same_file(path: Path, inode: int) -> None:
    """Raise FileNotFoundError unless ``path`` still names the file ``inode``."""
    if os.stat(path).st_ino != inode:
        raise FileNotFoundError(path)


def _lower_priority() -> None:
    """Run the calling (writer) thread only on CPU time nothing else wants: Linux's SCHED_IDLE,
    else the lowest nice value. A writer that falls behind fills its bounded queue and evicted
    entries are then dropped (counted), which is the trade the tier makes for decode speed."""
    tid = threading.get_native_id()
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:
            pass
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)
