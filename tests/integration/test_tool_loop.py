"""An agentic response's turns end to end through the trainer's tool loop, against real NATS,
Redis and calculator workers: the model's turn (tiny-chat ids) ends, the loop claims the call,
the calculator answers, the observation's ids continue the response exactly as the chat
template renders the conversation, and the final answer ends it with the environment's reward;
each turn's answer is committed once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as Nats
from prometheus_client import CollectorRegistry

from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.runs import RunStore
from manager_svc.turns import Turns
from rlboost.stack import Stack
from shared import names
from shared.bus import connect_nats, connect_redis
from shared.names import Keys, request_id
from shared.protocol import FrameEntry, TokenFrame, ToolClaim, ToolResult, decode, encode
from shared.spec import DatasetSpec, RunSpec
from trainer_svc.embedded import tiny_chat as tc
from trainer_svc.inputs.chat import ChatFormat
from trainer_svc.inputs.tool_pool import EnvPool
from trainer_svc.manager_client import ManagerClient
from trainer_svc.tool_loop import ToolLoop
from trainer_svc.workload import StepPrompt

M = TypeVar("M", bound=msgspec.Struct)
QUESTION = "Tom has 2 cards and buys 3. How many cards?"


async def serve(nc: Nats, subject: str, kind: type[M],
                handler: Callable[[M], Awaitable[msgspec.Struct]]) -> None:
    """Answer ``subject`` as the manager's service does: decode, handle, reply."""
    async def on_msg(msg: Any) -> None:
        await msg.respond(encode(await handler(decode(msg.data, kind))))

    await nc.subscribe(subject, cb=on_msg)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_the_loop_answers_each_turn_once_and_ends_the_response(
        brokers: Stack, tmp_path: Path) -> None:
    tok = tc.train_tokenizer()
    chat = ChatFormat(tok)
    prompt = chat.render(QUESTION)
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    nc = await connect_nats(brokers.nats.url, "test-tool-loop")
    registry = CollectorRegistry()
    pool = EnvPool("calculator", tool_s=5.0, workers=1, max_turns=3, registry=registry)
    loop_task: asyncio.Task[None] | None = None
    try:
        runs = RunStore(redis, Archive(tmp_path))
        spec = RunSpec(model="tiny-chat", samples_per_prompt=1, prompts_per_step=1,
                       dataset=DatasetSpec(path="x.jsonl"), env="calculator", max_turns=3)
        run_id = (await runs.create(spec))["id"]
        ledger = Ledger(redis, lease_ttl_s=60.0)
        await ledger.create_step(run_id, 0, 0, [prompt.prompt_token_ids], 1, 64,
                                 extra={"max_turns": 3})
        turns = Turns(redis)
        await serve(nc, names.TRAINER_TOOLS, ToolClaim, turns.on_claim)
        await serve(nc, names.TRAINER_ANSWER, ToolResult, turns.on_answer)
        await pool.start()
        loop = ToolLoop(ManagerClient(nc, "t0"), pool, chat, run_id, 0,
                        [StepPrompt(prompt.prompt_token_ids, QUESTION, prompt.prompt_text, "5")],
                        seed=0, poll_s=0.05)
        loop_task = asyncio.create_task(loop.run())
        rid = request_id(run_id, 0, 0, 0)

        async def model_turn(text: str, offset: int) -> list[int]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            lease = await ledger.assign(rid, "i0", 1.0, 0, 2)
            assert lease is not None
            [got] = await ledger.commit(TokenFrame(instance_id="i0", entries=[FrameEntry.of(
                request_id=rid, epoch=lease.epoch, weight_version=0, offset=offset,
                token_ids=ids, final=True, finish_reason="stop")]))
            assert got.status == "tool"
            return list(ids)

        first = await model_turn("<calc>2+3</calc><|im_end|>", 0)
        await until(lambda: redis.sismember(Keys.pending(run_id, 0), rid), "the answer")
        tokens = [int(t) for t in (await redis.get(Keys.tokens(rid))).split(",")]
        assert tokens[:len(first)] == first  # what the model sampled, untouched
        conversation = [{"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": "<calc>2+3</calc>"},
                        {"role": "tool", "content": "5"}]
        assert tok.decode(prompt.prompt_token_ids + tokens) == tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)
        await model_turn("#### 5<|im_end|>", len(tokens))
        await until(lambda: redis.sismember(Keys.done(run_id, 0), rid), "the end")
        req = await redis.hgetall(Keys.request(rid))
        assert (req["finish"], float(req["env_reward"])) == ("stop", 1.0)
        assert await redis.hget(Keys.step(run_id, 0), "tool_calls_committed") == "2"
        assert (loop.answered, loop.repeated) == (2, 0)
        counted = registry.get_sample_value
        assert counted("rlboost_env_calls_committed_total") == 2
        assert counted("rlboost_env_calls_total") == 2
    finally:
        if loop_task is not None:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
        await pool.close()
        await nc.close()
        await redis.aclose()
