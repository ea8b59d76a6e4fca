"""The trainer's step feed against a real nats-server, the test answering as the manager:
groups wait for train_now, come in the order announced, each once, and the barrier brings the
rest from the paged samples."""

from __future__ import annotations

import asyncio

import nats
from nats.aio.msg import Msg as NatsMsg

from rlboost.stack import Stack
from shared import names
from shared.digest import sample_digest
from shared.protocol import (
    Barrier,
    GroupDone,
    Sample,
    StepSamples,
    StepSamplesQuery,
    decode,
    encode,
)
from trainer_svc.manager_client import ManagerClient
from trainer_svc.step_feed import StepEvents, StepFeed

RUN = "run-feed"


def group(prompt: int, step: int = 0) -> list[Sample]:
    return [Sample(request_id=f"{RUN}:{step}:{prompt}:{k}", prompt_index=prompt, sample_index=k,
                   weight_version=step, prompt_token_ids=[prompt], response_token_ids=[k, 2],
                   finish_reason="stop", instances=["i"]) for k in range(2)]


async def test_groups_wait_for_train_now_come_once_and_the_barrier_brings_the_rest(
        brokers: Stack) -> None:
    samples = [s for p in range(4) for s in group(p)]
    digest = sample_digest(samples)
    state = {"train_now": False, "complete": False}

    async def manager(msg: NatsMsg) -> None:
        q = decode(msg.data, StepSamplesQuery)
        done = sorted(samples, key=lambda s: s.request_id)
        await msg.respond(encode(StepSamples(
            run_id=q.run_id, step=q.step, complete=state["complete"],
            train_now=state["train_now"], samples=done[q.offset:q.offset + q.limit],
            done=len(done), digest=digest if state["complete"] else None)))

    side = await nats.connect(brokers.nats.url)
    trainer = await nats.connect(brokers.nats.url)
    events = StepEvents()
    await side.subscribe(names.TRAINER_SAMPLES, cb=manager)
    await trainer.subscribe(names.group_subject("*"), cb=events.on_group)
    await trainer.subscribe(names.barrier_subject("*"), cb=events.on_barrier)
    # A SUB is sent without waiting for the server: flush both sides, or the first
    # announcements can be published before the trainer's subscriptions exist.
    await trainer.flush()
    await side.flush()
    feed = StepFeed(ManagerClient(trainer, "t"), events, RUN, 0, poll_s=0.2)
    given: list[int] = []

    async def consume() -> None:
        async for prompt_index, got in feed.groups():
            assert [s.prompt_index for s in got] == [prompt_index] * 2
            given.append(prompt_index)

    async def announce(prompt: int, step: int = 0, with_samples: bool = True) -> None:
        await side.publish(names.group_subject(RUN), encode(GroupDone(
            run_id=RUN, step=step, prompt_index=prompt,
            samples=group(prompt, step) if with_samples else [])))

    async def until(want: list[int]) -> None:
        async with asyncio.timeout(5):
            while given != want:
                await asyncio.sleep(0.02)

    consumer = asyncio.create_task(consume())
    try:
        await announce(1)
        await announce(0, step=1)  # another step's group: not this feed's
        await announce(2, with_samples=False)  # too large for one message: paged in later
        await asyncio.sleep(0.6)  # several polls while the reserved side still generates
        assert given == []
        state["train_now"] = True
        await until([1])
        await announce(3)
        await until([1, 3])
        await announce(1)  # announced again (a redelivered commit): still trained once
        state["complete"] = True
        await side.publish(names.barrier_subject(RUN),
                           encode(Barrier(run_id=RUN, step=0, digest=digest)))
        async with asyncio.timeout(5):
            await consumer
        assert given == [1, 3, 0, 2]
        assert feed.digest == digest
    finally:
        consumer.cancel()
        await side.close()
        await trainer.close()
