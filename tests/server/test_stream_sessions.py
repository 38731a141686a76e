"""The resumable-stream buffers (``server/streams.py``) without a server: their bound, replay from
an offset, lost offsets, replacement, cancellation and expiry."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest

from mlxcel_compat.server.streams import OffsetLost, StreamSession, StreamSessions


async def drain(session: StreamSession, offset: int = 0) -> bytes:
    return b"".join([chunk async for chunk in session.read_from(offset)])


def test_the_buffer_keeps_the_newest_bytes_within_its_bound():
    async def run() -> None:
        session = StreamSession("c", max_bytes=10)
        for i in range(7):
            session.append(b"%03d" % i)  # 21 bytes in all
        assert session.total_bytes == 21 and len(session.buffer) == 10 and session.dropped == 11
        session.finalize()
        assert await drain(session, 11) == bytes(b"000001002003004005006"[11:])
        assert await drain(session, 15) == b"000001002003004005006"[15:]
        with pytest.raises(OffsetLost):
            session.check_offset(10)
        assert await drain(session, 10) == b""  # a reader that fell behind ends
        assert not session.append(b"late")  # a finalized session takes nothing more

    asyncio.run(run())


def test_one_chunk_larger_than_the_bound_keeps_its_tail():
    async def run() -> None:
        session = StreamSession("c", max_bytes=4)
        session.append(b"abcdefgh")
        assert bytes(session.buffer) == b"efgh" and session.dropped == 4

    asyncio.run(run())


def test_a_reader_follows_live_bytes_until_the_session_ends():
    async def run() -> None:
        session = StreamSession("c")

        async def produce() -> AsyncIterator[bytes]:
            for piece in (b"a", b"b", b"c"):
                await asyncio.sleep(0.01)
                yield piece

        reader = asyncio.create_task(drain(session))
        session.produce(produce())
        assert await asyncio.wait_for(reader, 5) == b"abc"
        assert session.done and session.completed_at >= session.started_at

    asyncio.run(run())


def test_a_newer_session_cancels_the_older_and_lookups_need_the_id():
    async def run() -> None:
        sessions = StreamSessions()
        closed = asyncio.Event()

        async def endless() -> AsyncIterator[bytes]:
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield b"x"
            finally:
                closed.set()  # the generator is closed: the engine's sequences are cancelled

        old = sessions.create_or_replace("conv")
        old.produce(endless())
        await asyncio.sleep(0.05)
        new = sessions.create_or_replace("conv")
        await asyncio.wait_for(closed.wait(), 5)
        assert old.cancelled and old.done and not new.done and sessions.get("conv") is new
        assert [s.conversation_id for s in sessions.lookup(["conv"])] == ["conv"]
        assert sessions.lookup(["con", "other"]) == []
        sessions.create_or_replace("conv::org/model")  # a router's per-model variant matches its id
        assert sorted(s.conversation_id for s in sessions.lookup(["conv"])) == ["conv", "conv::org/model"]
        assert sessions.cancel("conv") and not sessions.cancel("conv")
        assert new.cancelled and new.done

    asyncio.run(run())


def test_finished_sessions_expire_after_their_ttl():
    async def run() -> None:
        sessions = StreamSessions(ttl=0.05)
        sessions.create_or_replace("done").finalize()
        sessions.create_or_replace("live")
        await asyncio.sleep(0.1)
        assert sessions.get("done") is None and sessions.get("live") is not None

    asyncio.run(run())


def test_only_the_newest_finished_sessions_are_kept():
    async def run() -> None:
        sessions = StreamSessions(max_finished=2)
        for i in range(4):
            sessions.create_or_replace(f"done-{i}").finalize()
            await asyncio.sleep(0.01)  # completion times in order
        live = sessions.create_or_replace("live")
        assert sorted(sessions.sessions) == ["done-2", "done-3", "live"] and sessions.get("live") is live

    asyncio.run(run())
