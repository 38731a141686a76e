"""The disk tier's index: which entries are on disk, looked up by the same rules as in RAM.

A process indexes the whole directory at start-up and, while running, picks up what the others
sharing it wrote or deleted since its last look (``DiskIndex.refresh``, one ``stat`` when nothing
changed); a file another process evicted is a plain miss (``vanished``), never an error. Readers
never lock; the directory lock (``cache/disk_directory.py``) serialises what changes many files at
once.

The index is not thread-safe: it belongs to the engine thread. Pure Python (no MLX).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel_compat.cache.block_hash import ApcConfig
from mlxcel_compat.cache.disk_directory import (
    directory_entries,
    directory_lock,
    enforce_budget,
    entry_name,
    is_entry_name,
    remove_stale_temps,
)
from mlxcel_compat.cache.disk_format import REJECT_REASONS, TIER_KINDS, Compat, DiskReject, EntryHeader, read_header
from mlxcel_compat.cache.key import Bucket, prompt_digest
from mlxcel_compat.cache.prompt_store import PromptCacheStore
from mlxcel_compat.cache.records import CacheEntry
from mlxcel_compat.cache.snapshot import SnapshotStore
from mlxcel_compat.cache.store import EntryStore

_SCAN_THREADS = 8  # header reads in flight at start-up
REFRESH_MAX_FILES = 64  # other processes' new files indexed per refresh (headers read on the engine thread)
RACY_NS = 1_000_000_000  # a directory listed sooner than this after its mtime is listed again


@dataclass(frozen=True)
class DiskRef:
    """Where an indexed entry's payload lives (the index's opaque payload)."""

    path: Path
    size: int
    kind: str


class _FileBacked(EntryStore):
    """Mixin for the index stores: records each entry that leaves, so ``DiskIndex`` can delete its
    file (or keep it, when the entry was only forgotten or rewritten under the same name)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dropped: list[DiskRef] = []

    def _on_entry_removed(self, entry: CacheEntry) -> None:
        super()._on_entry_removed(entry)
        self.dropped.append(entry.payload)  # type: ignore[arg-type]


class _KVIndex(_FileBacked, PromptCacheStore):
    pass


class _SnapshotIndex(_FileBacked, SnapshotStore):
    pass


@dataclass
class DiskCounters:
    """Monotonic counters of the index (the engine side adds its load and write counters)."""

    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    last_reject: dict[str, Any] | None = None
    removed_by_budget: int = 0
    vanished: int = 0  # indexed files another process removed
    picked_up: int = 0  # files another process wrote, indexed while running (``refresh``)
    refreshes: int = 0  # listings of the directory after a change


class DiskIndex:
    """Which entries are on disk, looked up by the same key and prefix rules as in RAM.

    Two index stores mirror the RAM stores (a ``PromptCacheStore`` for KV entries, with the same
    APC settings, and a ``SnapshotStore``); their payloads are ``DiskRef``s. Only the directory's
    byte budget evicts (``enforce_budget``, over all processes); an entry superseded in the index
    (a longer one of the same session and origin arrived) has its file deleted.
    """

    def __init__(self, root: Path, compat: Compat, capacity_bytes: int, min_prefix: int, apc: ApcConfig | None) -> None:
        self.root = root
        self.compat = compat
        self.capacity_bytes = capacity_bytes
        self.directory = root / compat.directory_key
        self.counters = DiskCounters()
        unbounded = dict(capacity_bytes=1 << 62, max_entries=1 << 31, ttl_seconds=0, min_prefix=min_prefix)
        self.stores: dict[str, _FileBacked] = {"kv": _KVIndex(apc=apc, **unbounded), "snapshot": _SnapshotIndex(**unbounded)}
        self._by_path: dict[Path, tuple[str, int]] = {}
        self.listed_mtime_ns: int | None = None  # the directory's mtime when it was last listed
        self._listed_at_ns = 0  # wall-clock time of that listing

    # --- start-up ---

    def open(self) -> dict[str, int]:
        """Create the directories, drop stale temporaries and bad files, index the rest.

        Reads only headers. Returns what was found (``files``, ``indexed``, ``rejected``,
        ``stale_temp``, ``removed_by_budget``).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        self.listed_mtime_ns, self._listed_at_ns = os.stat(self.directory).st_mtime_ns, time.time_ns()
        found = dict(files=0, indexed=0, rejected=0, stale_temp=0, removed_by_budget=0)
        with directory_lock(self.root):
            stale = remove_stale_temps(self.directory)
            for _ in range(stale):
                self.reject("stale_temp", None, "a temporary file of a writer that died")
            found["stale_temp"] = stale
            paths = [Path(e.path) for e in directory_entries(self.directory) if is_entry_name(e.name)]
            found["files"] = len(paths)
            good: list[tuple[float, Path, int, EntryHeader]] = []
            # Header reads wait on the disk when the page cache is cold: overlap them.
            with ThreadPoolExecutor(_SCAN_THREADS) as pool:
                for path, outcome in zip(paths, pool.map(self._scan_one, paths)):
                    if isinstance(outcome, DiskReject):
                        self.reject(outcome.reason, path, outcome.detail, remove=True)
                        found["rejected"] += 1
                    elif outcome is not None:
                        good.append(outcome)
            removed = set(enforce_budget(self.root, self.capacity_bytes))
            found["removed_by_budget"] = len(removed)
            self.counters.removed_by_budget += len(removed)
        for _, path, size, header in sorted(good, key=lambda g: (g[0], g[1].name)):
            if path not in removed:
                self.add(header, path, size)
        # What the index holds now: a file found beside one that supersedes it (the same session's
        # prompt and a longer one: two writers, or one killed before it dropped the shorter) was
        # indexed, then dropped and deleted by the longer one's add.
        found["indexed"] = len(self._by_path)
        return found

    def refresh(self, skip: Collection[Path] = ()) -> bool:
        """Pick up what other processes sharing the directory changed since the last look.

        Files that appeared are indexed (headers only, at most ``REFRESH_MAX_FILES`` a call, the
        rest at the next one), files that disappeared are forgotten. ``skip``: this process's
        own files still being committed. Creating, renaming and deleting a file change the
        directory's modification time, so when it is unchanged this costs one ``stat``. A change
        made within the timestamp's granularity after a listing may leave it unchanged, so a
        listing made less than ``RACY_NS`` after the time it saw is repeated at the next call
        (git treats its "racily clean" index the same way). Engine thread. Returns whether the
        directory was listed.
        """
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except OSError:
            return False
        if mtime == self.listed_mtime_ns and self._listed_at_ns - mtime >= RACY_NS:
            return False
        self.listed_mtime_ns, self._listed_at_ns = mtime, time.time_ns()
        self.counters.refreshes += 1
        # Names, not Paths: building a Path per file costs ~7 us, 14 ms for 2000 files.
        listed = {e.name for e in directory_entries(self.directory) if is_entry_name(e.name)}
        known = {p.name for p in self._by_path} | {p.name for p in skip}
        for path in [p for p in self._by_path if p.name not in listed]:
            self.counters.vanished += self.forget(path)
        new = [self.directory / name for name in sorted(listed - known)]
        if len(new) > REFRESH_MAX_FILES:
            new = new[:REFRESH_MAX_FILES]
            self.listed_mtime_ns = None  # list again at the next call
        good = []
        for path in new:
            outcome = self._scan_one(path)
            if isinstance(outcome, DiskReject):
                self.reject(outcome.reason, path, outcome.detail, remove=True)
            elif outcome is not None:
                good.append(outcome)
        for _, path, size, header in sorted(good, key=lambda g: (g[0], g[1].name)):
            self.counters.picked_up += self.add(header, path, size)
        return True

    def _scan_one(self, path: Path) -> tuple[float, Path, int, EntryHeader] | DiskReject | None:
        """One file's header at start-up: ``(mtime, path, size, header)``, a rejection, or None (gone)."""
        try:
            header, _ = read_header(path, self.compat, TIER_KINDS)
            if entry_name(header.kind, header.digest) != path.name:
                raise DiskReject("corrupt_header", "the file name does not match its key")
            st = path.stat()
        except FileNotFoundError:
            return None
        except DiskReject as exc:
            return exc
        return st.st_mtime, path, st.st_size, header

    # --- entries ---

    def add(self, header: EntryHeader, path: Path, size: int) -> bool:
        """Index a file that is on disk now (written by us, or found at start-up)."""
        store = self.stores[header.kind]
        old = store.find(header.digest)
        if old is not None:  # rewritten in place under the same name: forget, keep the file
            self._forget_entry(header.kind, old.id)
        result = store.insert(header.bucket, header.session_key, header.tokens, DiskRef(path, size, header.kind),
                              size, header.trimmable, header.origin)
        self._delete_dropped(keep=path)
        if not result.inserted:  # below --prompt-cache-min-prefix: it could never be adopted
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        assert result.entry_id is not None
        self._by_path[path] = (header.kind, result.entry_id)
        return True

    def has(self, kind: str, bucket: Bucket, session_key: str, tokens: Sequence[int]) -> bool:
        """Whether this exact entry is on disk already (nothing to write when it leaves RAM)."""
        return self.stores[kind].find(prompt_digest(bucket, session_key, tuple(tokens))) is not None

    def forget(self, path: Path) -> bool:
        """The file is gone (evicted by the budget, or by another process): drop its entry."""
        where = self._by_path.get(path)
        if where is None:
            return False
        self._forget_entry(*where)
        return True

    def drop(self, path: Path) -> None:
        """Remove a file that must not be used again, and its entry."""
        self.forget(path)
        with contextlib.suppress(OSError):
            os.unlink(path)

    def clear(self) -> tuple[int, int]:
        """Delete every file of this model directory (``POST /v1/cache/reset``); return (files, bytes)."""
        files = bytes_ = 0
        with directory_lock(self.root):
            for e in directory_entries(self.directory):
                if not is_entry_name(e.name):
                    continue
                try:
                    size = e.stat(follow_symlinks=False).st_size
                    os.unlink(e.path)
                except OSError:
                    continue
                files += 1
                bytes_ += size
        for store in self.stores.values():
            store.reset()
            store.dropped.clear()
        self._by_path.clear()
        return files, bytes_

    def reject(self, reason: str, path: Path | None, detail: str, remove: bool = False) -> None:
        """Count a rejected file (and remove it, so it is not looked at again)."""
        self.counters.rejections[reason] += 1
        self.counters.last_reject = {"reason": reason, "file": path.name if path is not None else None, "detail": detail}
        if remove and path is not None:
            self.drop(path)

    @property
    def entries(self) -> int:
        return sum(len(s) for s in self.stores.values())

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores.values())

    # --- helpers ---

    def _forget_entry(self, kind: str, entry_id: int) -> None:
        store = self.stores[kind]
        entry = store.get(entry_id)
        if entry is None:
            return
        store.remove(entry_id)
        store.dropped.clear()  # its file is gone, or is the one being kept
        self._by_path.pop(entry.payload.path, None)  # type: ignore[attr-defined]

    def _delete_dropped(self, keep: Path) -> None:
        for store in self.stores.values():
            dropped = store.dropped
            for ref in dropped:
                self._by_path.pop(ref.path, None)
                if ref.path != keep:
                    with contextlib.suppress(OSError):
                        os.unlink(ref.path)
            dropped.clear()
