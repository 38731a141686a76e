"""Adding models to the router's hub cache and removing them: ``POST /models`` and ``DELETE /models``.

llama-server's router (``tools/server/server-models.cpp``: ``post_router_models``,
``server_models::remove``) downloads ``{"model": "user/repo[:TAG]"}`` into ``$LLAMA_CACHE`` as
``-hf`` would, answering ``{"success": true}`` at once; ``/models/sse`` reports
``download_progress`` (bytes done and total per file) and then ``download_finished`` (or
``download_failed``), after which the model is listed. ``DELETE /models?model=NAME`` stops a
cache model if it runs and removes its files from the cache (``model_remove``); models of
``--models-dir`` or a preset are not removable. A download asked for explicitly runs even under
``--offline``, as there (the flag governs what a model load may fetch).

The files come from the hub ``HF_ENDPOINT`` names, through huggingface-hub (``model/hub.py``
chooses the GGUF a tag means, as ``-hf`` does); a download occupies no model slot.

A download under way is cancelled as llama-server cancels it: ``DELETE /models?model=NAME`` or
``POST /models/unload`` naming it. The download thread stops at its next chunk (the progress hook
raises), ``download_failed`` is sent, and what it left in the cache (unfinished blobs, the parts it
finished, the repository's folder when no model is left in it) is deleted.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from mlxcel_compat.model.hub import HubError, HubRequest, choose_gguf, list_files, parse_repo, split_siblings
from mlxcel_compat.server.errors import InvalidRequest
from mlxcel_compat.server.router_registry import ModelRegistry, RouterModel

log = logging.getLogger(__name__)

PROGRESS_SECONDS = 0.1  # the most often one file's download_progress is sent


class DownloadCancelled(Exception):
    """Raised in a download thread (by its progress hook) once its download is cancelled."""


@dataclass
class Download:
    """One download under way: its task, the flag that stops its thread, the parts it finished."""

    repo: str
    task: asyncio.Task
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: list[Path] = field(default_factory=list)
    stopped: bool = False  # it ended because it was cancelled (not finished, not failed)


class Downloads:
    """The downloads under way (one per model name) and what to do when one ends."""

    def __init__(self, registry: ModelRegistry, cache_dir: str | None, token: str | None,
                 reload: Callable[[], Awaitable[None]]) -> None:
        self.registry = registry
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self.token = token
        self.reload = reload  # re-reads the sources, so a finished download is listed
        self.running: dict[str, Download] = {}

    def start(self, name: str) -> None:
        """Validate ``name`` and start its download in the background."""
        try:
            repo, tag = parse_repo(name)
        except HubError as exc:
            raise InvalidRequest(str(exc)) from None
        if self.registry.find(name) is not None or name in self.running:
            raise InvalidRequest(f"model '{name}' already exists")
        request = HubRequest(repo, tag, token=self.token, cache_dir=self.cache_dir)
        download = Download(repo, asyncio.get_running_loop().create_task(self._download(name, request)))
        self.running[name] = download
        download.task.add_done_callback(lambda _: self.running.pop(name, None))

    async def cancel(self, name: str) -> bool:
        """Stop the download of ``name`` and delete what it left, returning once it has stopped
        and ``download_failed`` has been sent. False if none is under way, or if it ended some
        other way first (its files all arrived: the model is listed, and removed as any other)."""
        download = self.running.get(name)
        if download is None:
            return False
        log.info("router: cancelling the download of '%s'", name)
        download.cancelled.set()
        await asyncio.wait({download.task})
        return download.stopped

    async def _download(self, name: str, request: HubRequest) -> None:
        events = self.registry.events
        loop = asyncio.get_running_loop()
        progress: dict[str, dict[str, int]] = {}

        def report(url: str, done: int, total: int) -> None:  # a download thread
            progress[url] = {"done": done, "total": total}
            snapshot = {"progress": {k: dict(v) for k, v in progress.items()}}
            loop.call_soon_threadsafe(events.notify, "download_progress", name, snapshot)

        download = self.running[name]
        try:
            await asyncio.to_thread(fetch_with_progress, request, report, download.cancelled, download.finished)
        except DownloadCancelled:
            download.stopped = True
            await asyncio.to_thread(remove_partial, self._repo_dir(request.repo), download.finished)
            log.info("router: download of '%s' cancelled", name)
            events.notify("download_failed", name, {"error": "cancelled"})
            return
        except HubError as exc:
            log.error("router: downloading '%s' failed: %s", name, exc)
            events.notify("download_failed", name, {"error": str(exc)})
            return
        log.info("router: downloaded '%s' into %s", name, self.cache_dir or "the hub cache")
        await self.reload()
        events.notify("download_finished", name)

    def _repo_dir(self, repo: str) -> Path:
        """The repository's folder in the hub cache (huggingface-hub's layout)."""
        if self.cache_dir is not None:
            root = self.cache_dir
        else:
            from huggingface_hub.constants import HF_HUB_CACHE

            root = Path(HF_HUB_CACHE)
        return root / ("models--" + repo.replace("/", "--"))

    async def close(self) -> None:
        for download in list(self.running.values()):
            download.cancelled.set()
            download.task.cancel()


def fetch_with_progress(request: HubRequest, report: Callable[[str, int, int], None],
                        cancelled: threading.Event | None = None, finished: list[Path] | None = None) -> Path:
    """Download the GGUF (all its split parts) the request's tag chooses, reporting bytes as they
    arrive through huggingface-hub's progress bar hook, which also stops the download (raising
    :class:`DownloadCancelled`) once ``cancelled`` is set. Finished parts go to ``finished``."""
    from huggingface_hub import hf_hub_download

    files = list_files(request)
    chosen = choose_gguf(files, request.tag)
    if chosen is None:
        raise HubError(f"'{request.label}' has no GGUF file for that tag")
    paths = [] if finished is None else finished
    for part in split_siblings(chosen, files):
        if cancelled is not None and cancelled.is_set():
            raise DownloadCancelled(request.label)
        try:
            paths.append(Path(hf_hub_download(request.repo, part, cache_dir=request.cache_dir, token=request.token,
                                              tqdm_class=_progress_class(request.repo + "/" + part, report,
                                                                         cancelled))))
        except DownloadCancelled:
            raise
        except Exception as exc:  # hub errors come in many classes; the message is what matters
            raise HubError(f"cannot download '{part}' of '{request.repo}': {type(exc).__name__}: {exc}") from exc
        size = paths[-1].stat().st_size
        report(request.repo + "/" + part, size, size)
    return paths[0]


def _progress_class(url: str, report: Callable[[str, int, int], None], cancelled: threading.Event | None) -> Any:
    """A tqdm class that reports a file's bytes (at most every PROGRESS_SECONDS), draws nothing,
    and stops the download at its next chunk once ``cancelled`` is set."""
    from tqdm.std import tqdm

    class Progress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.bytes_done = 0
            self.reported = 0.0
            report(url, 0, int(self.total or 0))

        def update(self, n: float | None = 1) -> bool | None:
            if cancelled is not None and cancelled.is_set():
                raise DownloadCancelled(url)
            self.bytes_done += int(n or 0)
            now = time.monotonic()
            if now - self.reported >= PROGRESS_SECONDS:
                self.reported = now
                report(url, self.bytes_done, int(self.total or 0))
            return None

    return Progress


def remove_cached(model: RouterModel) -> None:
    """Delete a cache model's files: its snapshot links (every split part) and the blobs no other
    link of the repository still points at, and the repository's folder when no model is left in it."""
    first = Path(model.source.model)
    snapshot = first.parent
    stem = first.name.split("-00001-of-")[0] if "-00001-of-" in first.name else None
    parts = sorted(snapshot.glob(f"{stem}-*-of-*.gguf")) if stem else [first]
    repo_dir = snapshot
    while repo_dir.name != "snapshots" and repo_dir.parent != repo_dir:
        repo_dir = repo_dir.parent
    repo_dir = repo_dir.parent  # models--user--repo
    if repo_dir.name.startswith("models--"):
        _remove_links(repo_dir, parts)
    else:  # not in the hub's layout: only the files themselves
        for part in parts:
            part.unlink(missing_ok=True)


def remove_partial(repo_dir: Path, finished: list[Path]) -> None:
    """What a cancelled download leaves in the cache: the parts it finished, and the repository's
    folder when no model is left in it (llama-server's ``common_download_remove``, best-effort).
    The part it was writing needs nothing: huggingface-hub writes it to a temporary file of its
    own (``<etag>.<random>.incomplete``) and deletes that file when the download raises, so a
    download of another tag of the same repository running beside it is left alone."""
    if repo_dir.is_dir():
        _remove_links(repo_dir, finished)


def _remove_links(repo_dir: Path, parts: list[Path]) -> None:
    """Delete snapshot links ``parts``, their blobs unless another link shares one, and the
    repository's folder once it holds no GGUF model."""
    blobs = {part.resolve() for part in parts if part.is_symlink()}
    for part in parts:
        part.unlink(missing_ok=True)
    links = [p for p in (repo_dir / "snapshots").rglob("*") if p.is_symlink()]
    still_used = {p.resolve() for p in links}
    for blob in blobs - still_used:  # identical files share a blob (the hub cache stores by hash)
        blob.unlink(missing_ok=True)
    if not any(p.name.endswith(".gguf") for p in links):
        shutil.rmtree(repo_dir, ignore_errors=True)


__all__ = ["DownloadCancelled", "Downloads", "fetch_with_progress", "remove_cached", "remove_partial"]
