"""The chunk stream keeps every frame against a manager credential, and bounds what it holds.

Real nats-server from the venv, run with the shipped compose/nats.conf (locked) and open. The
manager's permissions allow the JetStream calls it makes and no stream purge, update or
delete; a heartbeat whose reply subject is the purge endpoint, answered with those
permissions, is refused by the server (the reflection the issue reproduced). The stream itself
denies purge and message delete, so even a credential allowed the whole JetStream API cannot
empty it; it refuses frames past its message size, and, full, refuses new frames rather than
dropping old ones.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client as Nats
from nats.js.api import DiscardPolicy
from nats.js.errors import APIError

from rlboost.stack import Stack
from shared import names
from shared.bus import MAX_FRAME_BYTES, ensure_chunk_stream

SUBJECT = names.chunk_subject("run-a", "spot-0")
STREAM_API = f"$JS.API.STREAM.%s.{names.CHUNK_STREAM}"


async def manager_client(stack: Stack, errors: list[str]) -> Nats:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    return await nats.connect(stack.nats.url_for("manager"), error_cb=on_error)


async def messages(nc: Nats) -> int:
    return (await nc.jetstream().stream_info(names.CHUNK_STREAM)).state.messages


async def test_stream_denies_purge_and_delete_to_any_credential(brokers: Stack) -> None:
    nc = await nats.connect(brokers.nats.url)  # open server: the whole JetStream API allowed
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js, max_bytes=1 << 20)
        config = (await js.stream_info(names.CHUNK_STREAM)).config
        assert config.deny_purge and config.deny_delete
        assert config.discard == DiscardPolicy.NEW
        assert config.max_bytes == 1 << 20 and config.max_msg_size == MAX_FRAME_BYTES
        ack = await js.publish(SUBJECT, b"frame")
        with pytest.raises(APIError):
            await js.purge_stream(names.CHUNK_STREAM)
        with pytest.raises(APIError):
            await js.delete_msg(names.CHUNK_STREAM, ack.seq)
        await ensure_chunk_stream(js, max_bytes=1 << 20)  # a manager restart: created again
        assert await messages(nc) == 1
    finally:
        await nc.close()


async def test_a_full_stream_refuses_new_frames_and_keeps_old_ones(brokers: Stack) -> None:
    nc = await nats.connect(brokers.nats.url)
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js, max_bytes=64 << 10)
        stored = 0
        with pytest.raises(APIError):  # 4 KiB frames: at most 16 fit 64 KiB
            for _ in range(64):
                await js.publish(SUBJECT, b"x" * 4000)
                stored += 1
        assert 8 <= stored <= 16
        assert await messages(nc) == stored  # nothing old was dropped to make room
        first = await js.get_msg(names.CHUNK_STREAM, 1)
        assert first.data == b"x" * 4000
    finally:
        await nc.close()


async def test_a_frame_past_the_message_size_is_refused(brokers: Stack) -> None:
    nc = await nats.connect(brokers.nats.url)
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js)
        with pytest.raises((APIError, nats.errors.MaxPayloadError)):
            await js.publish(SUBJECT, b"x" * (MAX_FRAME_BYTES + 1))
        assert await messages(nc) == 0
    finally:
        await nc.close()


async def test_manager_credential_cannot_purge_update_or_delete(locked: Stack) -> None:
    errors: list[str] = []
    nc = await manager_client(locked, errors)
    try:
        js = nc.jetstream()
        await ensure_chunk_stream(js)
        await ensure_chunk_stream(js)  # again, as every manager start does: no update needed
        await js.publish(SUBJECT, b"frame")
        for verb in ("PURGE", "UPDATE", "DELETE"):
            with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
                await nc.request(STREAM_API % verb, b"{}", timeout=0.5)
            await asyncio.sleep(0.1)
            assert any("permissions violation" in e and verb.lower() in e for e in errors), verb
        # The reflection: a "heartbeat" whose reply subject is the purge endpoint, answered
        # as a handler answers, with the manager's permissions.
        inbox = await nc.subscribe(names.heartbeat_subject("spot-0"))
        await nc.publish(names.heartbeat_subject("spot-0"), b"{}",
                         reply=STREAM_API % "PURGE")
        msg = await inbox.next_msg(timeout=2)
        await msg.respond(b"{}")
        await nc.flush()
        await asyncio.sleep(0.2)
        assert await messages(nc) == 1
    finally:
        await nc.close()
