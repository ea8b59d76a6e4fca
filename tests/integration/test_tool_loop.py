"""An agentic response's turns end to end through the trainer's tool loop, against real NATS,
Redis and calculator workers: the model's turn (tiny-chat ids) ends, the loop claims the call,
the calculator answers, the observation's ids continue the response exactly as the chat
template renders the conversation, and the final answer ends it with the environment's reward;
each turn's answer is committed once."""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from shared.turns import loss_mask
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
        spec = RunSpec(model="tiny-chat", algorithm="reinforce_pp",
                       samples_per_prompt=1, prompts_per_step=1,
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


TALLY_ENV = """
import json, re

LOG = {log!r}


def _log(entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\\n")


def _number(text):
    return sum(int(n) for n in re.findall(r"\\d+", text))


class Tally:
    # State across turns: a running total of the numbers the model said.
    def __init__(self):
        self.total = 0

    def restore(self, history):
        _log({{"restore": history}})
        self.total = sum(_number(h["action"]) for h in history)

    def step(self, action, call_id):
        _log({{"call": call_id}})
        self.total += _number(action)
        done = "####" in action
        return {{"observation": None if done else f"total {{self.total}}",
                 "reward": float(self.total) if done else None, "done": done}}


def make(prompt, answer, seed):
    return Tally()
"""


async def test_a_restarted_trainer_restores_the_environment_from_committed_turns(
        brokers: Stack, tmp_path: Path) -> None:
    log = tmp_path / "calls.jsonl"
    (tmp_path / "tally_env.py").write_text(TALLY_ENV.format(log=str(log)))
    tok = tc.train_tokenizer()
    chat = ChatFormat(tok)
    prompt = chat.render(QUESTION)
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    nc = await connect_nats(brokers.nats.url, "test-tool-restore")
    tasks: list[asyncio.Task[None]] = []
    pools: list[EnvPool] = []
    try:
        runs = RunStore(redis, Archive(tmp_path))
        env = "python:tally_env:make"
        spec = RunSpec(model="tiny-chat", algorithm="reinforce_pp",
                       samples_per_prompt=1, prompts_per_step=1,
                       dataset=DatasetSpec(path="x.jsonl"), env=env, max_turns=4)
        run_id = (await runs.create(spec))["id"]
        ledger = Ledger(redis, lease_ttl_s=60.0)
        await ledger.create_step(run_id, 0, 0, [prompt.prompt_token_ids], 1, 96,
                                 extra={"max_turns": 4})
        turns = Turns(redis)
        await serve(nc, names.TRAINER_TOOLS, ToolClaim, turns.on_claim)
        await serve(nc, names.TRAINER_ANSWER, ToolResult, turns.on_answer)
        rid = request_id(run_id, 0, 0, 0)

        async def trainer() -> None:
            """A trainer process's tool side: a fresh pool (no episode held) and loop."""
            pool = EnvPool(env, dirs=[tmp_path], tool_s=5.0, workers=1, max_turns=4)
            pools.append(pool)
            await pool.start()
            loop = ToolLoop(ManagerClient(nc, f"t{len(pools)}"), pool, chat, run_id, 0,
                            [StepPrompt(prompt.prompt_token_ids, QUESTION, prompt.prompt_text,
                                        "9")], seed=0, poll_s=0.05)
            tasks.append(asyncio.create_task(loop.run()))

        async def stop_trainer() -> None:
            tasks[-1].cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tasks[-1]
            await pools[-1].close()

        async def model_turn(text: str) -> None:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            lease = await ledger.assign(rid, "i0", 1.0, 0, 2)
            assert lease is not None
            offset = await redis.hget(Keys.request(rid), "n")
            [got] = await ledger.commit(TokenFrame(instance_id="i0", entries=[FrameEntry.of(
                request_id=rid, epoch=lease.epoch, weight_version=0, offset=int(offset or 0),
                token_ids=ids, final=True, finish_reason="stop")]))
            assert got.status == "tool"

        async def answered() -> bool:
            return bool(await redis.sismember(Keys.pending(run_id, 0), rid))

        await trainer()
        await model_turn("2<|im_end|>")
        await until(answered, "turn 0's answer")
        await stop_trainer()  # the episode's state goes with its process
        await trainer()
        await model_turn("3<|im_end|>")
        await until(answered, "turn 1's answer")
        await model_turn("#### 4<|im_end|>")
        await until(lambda: redis.sismember(Keys.done(run_id, 0), rid), "the end")

        [sample] = await ledger.samples([rid])
        observed = [t for t in sample.turns if t.role == "observation"]
        assert [t.observation for t in observed] == ["total 2", "total 5"]  # 5: state restored
        assert sample.env_reward == 9.0
        assert sample.loss_mask == loss_mask(sample.turns, len(sample.response_token_ids))
        assert 0 in sample.loss_mask and sample.loss_mask[-1] == 1
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        assert [e["call"] for e in entries if "call" in e] == [f"{rid}:{k}" for k in range(3)]
        [restored] = [e["restore"] for e in entries if "restore" in e]
        assert restored == [{"call_id": f"{rid}:0", "action": "2", "observation": "total 2"}]
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pool in pools:
            await pool.close()
        await nc.close()
        await redis.aclose()


BAD_ENV = """
import time


class Bad:
    # Misbehaves by sample (the prompt's text carries its index): hangs past max_tool_s,
    # raises, or answers with a non-string observation; sample 3 behaves.
    def __init__(self, prompt, answer, seed):
        self.kind = prompt

    def step(self, action, call_id):
        sample = int(call_id.split(":")[-2])
        if sample == 0:
            time.sleep(60)
        if sample == 1:
            raise RuntimeError("tool exploded")
        if sample == 2:
            return {{"observation": 42, "reward": None, "done": False}}
        return {{"observation": None, "reward": 1.0, "done": True}}


def make(prompt, answer, seed):
    return Bad(prompt, answer, seed)
"""


async def test_a_hung_raising_or_invalid_tool_ends_its_response_and_the_step_goes_on(
        brokers: Stack, tmp_path: Path) -> None:
    (tmp_path / "bad_env.py").write_text(BAD_ENV.format())
    tok = tc.train_tokenizer()
    chat = ChatFormat(tok)
    prompt = chat.render(QUESTION)
    redis = await connect_redis(brokers.redis.url)
    await redis.flushdb()
    nc = await connect_nats(brokers.nats.url, "test-tool-bad")
    registry = CollectorRegistry()
    env = "python:bad_env:make"
    # One worker per episode: the worker killed for the hung call would take any other episode
    # it held with it (counted `lost`, tested in test_env_pool), hiding the `raised` case here.
    pool = EnvPool(env, dirs=[tmp_path], tool_s=1.0, workers=4, max_turns=3,
                   registry=registry)
    task: asyncio.Task[None] | None = None
    try:
        runs = RunStore(redis, Archive(tmp_path))
        spec = RunSpec(model="tiny-chat", samples_per_prompt=4, prompts_per_step=1,
                       dataset=DatasetSpec(path="x.jsonl"), env=env, max_turns=3)
        run_id = (await runs.create(spec))["id"]
        ledger = Ledger(redis, lease_ttl_s=60.0)
        await ledger.create_step(run_id, 0, 0, [prompt.prompt_token_ids], 4, 64,
                                 extra={"max_turns": 3})
        turns = Turns(redis)
        await serve(nc, names.TRAINER_TOOLS, ToolClaim, turns.on_claim)
        await serve(nc, names.TRAINER_ANSWER, ToolResult, turns.on_answer)
        await pool.start()
        loop = ToolLoop(ManagerClient(nc, "t0"), pool, chat, run_id, 0,
                        [StepPrompt(prompt.prompt_token_ids, QUESTION, prompt.prompt_text,
                                    "5")], seed=0, poll_s=0.05)
        task = asyncio.create_task(loop.run())
        ids = tok("<calc>2+3</calc><|im_end|>", add_special_tokens=False)["input_ids"]
        for sample in range(4):
            rid = request_id(run_id, 0, 0, sample)
            lease = await ledger.assign(rid, "i0", 1.0, 0, 2)
            assert lease is not None
            [got] = await ledger.commit(TokenFrame(instance_id="i0", entries=[FrameEntry.of(
                request_id=rid, epoch=lease.epoch, weight_version=0, offset=0,
                token_ids=ids, final=True, finish_reason="stop")]))
            assert got.status == "tool"
        # Every response ends (the step's barrier can come), the hung call within its limit.
        await until(lambda: _all_done(redis, run_id), "every response to end", 20)
        rewards = [await redis.hget(Keys.request(request_id(run_id, 0, 0, s)), "env_reward")
                   for s in range(4)]
        assert [float(r) for r in rewards] == [0.0, 0.0, 0.0, 1.0]
        counted = registry.get_sample_value
        for reason in ("timeout", "raised", "invalid"):
            assert counted("rlboost_env_call_failures_total", {"reason": reason}) == 1, reason
        assert counted("rlboost_env_call_timeouts_total") == 1
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await pool.close()
        await nc.close()
        await redis.aclose()


async def _all_done(redis: Any, run_id: str) -> bool:
    return int(await redis.scard(Keys.done(run_id, 0))) == 4
