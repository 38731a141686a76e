"""Resumable streams: a generation that outlives its HTTP connection (llama-server's
``server-stream``).

A streamed request that carries ``X-Conversation-Id`` is not bound to its socket. Its SSE bytes
are produced by a task of their own into a bounded per-conversation buffer
(:class:`StreamSession`), and the client that sent the request reads them from that buffer like
any later reader. When the client goes away (a reload, a closed laptop lid), only its reader
stops: the generation runs to its end, and ``GET /v1/stream?conv_id=...&from=N`` replays the
buffer from byte ``N`` and follows it live. A newer request for the same conversation replaces
(and stops) the older generation; ``DELETE /v1/stream`` stops it on request.

Why a buffer of bytes, not of events: a reader resumes at the byte offset it had reached, and
the replayed bytes are exactly what the first reader would have received, so a client's SSE
parser needs nothing new. The buffer keeps the newest ``max_bytes`` (oldest bytes are dropped
first); an offset below the dropped prefix is refused, as llama-server refuses it. A finished
session is kept ``ttl`` seconds for a late reader, then dropped.

Everything here runs on the event loop (no lock needed): producers append, readers wait on an
``asyncio.Event`` that each append replaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "x-conversation-id"
SESSION_TTL_S = 300.0  # a finished session is kept this long for a late reader (llama-server's)
SESSION_MAX_BYTES = 4 * 1024 * 1024  # each session's buffer keeps at most this many bytes
# Finished sessions kept at most (the oldest go first): live ones are bounded by the requests the
# server runs, finished ones would otherwise be bounded only by the TTL and how fast ids come.
MAX_FINISHED_SESSIONS = 256


class OffsetLost(Exception):
    """The requested offset fell below the bytes the bounded buffer has dropped."""


@dataclass
class SessionStatus:
    """What ``POST /v1/streams/lookup`` says of one session (llama-server's fields, and the bytes
    the buffer holds now, which the storm benchmark checks against the bound)."""

    conversation_id: str
    is_done: bool
    total_bytes: int
    buffered_bytes: int
    started_at: int
    completed_at: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class StreamSession:
    """One conversation's generation: the buffer of its SSE bytes and the task producing them."""

    def __init__(self, conversation_id: str, max_bytes: int = SESSION_MAX_BYTES) -> None:
        self.conversation_id = conversation_id
        self.max_bytes = max_bytes
        self.started_at = time.time()
        self.completed_at = 0.0  # 0 while alive, unix seconds after finalize
        self.cancelled = False
        self.buffer = bytearray()
        self.dropped = 0  # bytes dropped from the front to stay within max_bytes
        self.done = False
        self._changed = asyncio.Event()
        self._producer: asyncio.Task[None] | None = None

    @property
    def total_bytes(self) -> int:
        """Bytes that ever entered the session (the offset just past its last byte)."""
        return self.dropped + len(self.buffer)

    def append(self, data: bytes) -> bool:
        if self.done:
            return False
        if not data:
            return True
        self.buffer += data
        excess = len(self.buffer) - self.max_bytes
        if excess > 0:
            del self.buffer[:excess]
            self.dropped += excess
        self._wake()
        return True

    def finalize(self) -> None:
        """No more bytes will come: readers drain what is left and end."""
        if self.done:
            return
        self.done = True
        self.completed_at = time.time()
        self._wake()

    def cancel(self) -> None:
        """Stop the generation (its task closes the engine stream, which cancels the sequences)
        and end the readers."""
        self.cancelled = True
        if self._producer is not None and not self._producer.done():
            self._producer.cancel()
        self.finalize()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def produce(self, chunks: AsyncIterator[bytes]) -> None:
        """Drain ``chunks`` into the buffer on a task of its own, whoever reads them."""

        async def pump() -> None:
            try:
                async for chunk in chunks:
                    if not self.append(chunk):
                        break
            except asyncio.CancelledError:
                pass
            except Exception:  # the stream's own errors are SSE events; this is a bug, logged
                log.exception("resumable stream %r failed", self.conversation_id)
            finally:
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]
                self.finalize()

        self._producer = asyncio.create_task(pump())

    def check_offset(self, offset: int) -> None:
        if offset < self.dropped:
            raise OffsetLost(f"offset {offset} was dropped (the buffer starts at {self.dropped})")

    async def read_from(self, offset: int) -> AsyncIterator[bytes]:
        """The session's bytes from ``offset`` on: what is buffered, then live bytes as they
        come, until the session is finalized. A reader that falls more than ``max_bytes`` behind
        ends (its next bytes are gone)."""
        while True:
            if offset < self.dropped:
                return
            changed = self._changed
            if offset < self.total_bytes:
                chunk = bytes(self.buffer[offset - self.dropped :])
                offset += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await changed.wait()

    def status(self) -> SessionStatus:
        return SessionStatus(
            conversation_id=self.conversation_id,
            is_done=self.done,
            total_bytes=self.total_bytes,
            buffered_bytes=len(self.buffer),
            started_at=int(self.started_at),
            completed_at=int(self.completed_at),
        )


class StreamSessions:
    """Every live and recently finished session, one per conversation id.

    Finished sessions older than ``ttl``, and beyond the newest ``max_finished``, are dropped
    whenever a session is created or looked up (no timer task: a server nobody calls holds at
    most what it held at the last call). So the buffers hold at most ``max_bytes`` times the
    running streams plus ``max_finished``."""

    def __init__(self, max_bytes: int = SESSION_MAX_BYTES, ttl: float = SESSION_TTL_S,
                 max_finished: int = MAX_FINISHED_SESSIONS) -> None:
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.max_finished = max_finished
        self.sessions: dict[str, StreamSession] = {}

    def create_or_replace(self, conversation_id: str) -> StreamSession:
        """A fresh session for ``conversation_id``; an older one is cancelled (its generation
        stops) and forgotten."""
        self.prune()
        previous = self.sessions.pop(conversation_id, None)
        if previous is not None:
            previous.cancel()
        session = StreamSession(conversation_id, self.max_bytes)
        self.sessions[conversation_id] = session
        return session

    def get(self, conversation_id: str) -> StreamSession | None:
        self.prune()
        return self.sessions.get(conversation_id)

    def lookup(self, conversation_ids: list[str]) -> list[SessionStatus]:
        """The sessions of the ids asked for, and only those (an id also matches its
        ``id::model`` variants, as llama-server's router names them): live sessions cannot be
        listed by someone who does not know their ids."""
        self.prune()
        found = []
        for wanted in conversation_ids:
            for conv, session in self.sessions.items():
                if conv == wanted or conv.startswith(wanted + "::"):
                    found.append(session.status())
        return found

    def cancel(self, conversation_id: str) -> bool:
        """Stop and forget a conversation's session (idempotent); whether there was one."""
        session = self.sessions.pop(conversation_id, None)
        if session is None:
            return False
        session.cancel()
        return True

    def prune(self) -> None:
        cutoff = time.time() - self.ttl
        for conv in [c for c, s in self.sessions.items() if s.done and s.completed_at <= cutoff]:
            del self.sessions[conv]
        finished = sorted((s.completed_at, c) for c, s in self.sessions.items() if s.done)
        for _, conv in finished[: max(0, len(finished) - self.max_finished)]:
            del self.sessions[conv]

    def close_all(self) -> None:
        """Shutdown: every generation stops and every reader ends."""
        for session in self.sessions.values():
            session.cancel()
        self.sessions.clear()

    def buffered_bytes(self) -> int:
        return sum(len(s.buffer) for s in self.sessions.values())
