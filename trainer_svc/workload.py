"""What a run trains on: each step's prompts as token ids and text, and how responses score.

Contract:

- :func:`open_workload` reads the run spec. Without a ``dataset`` it is the built-in task
  (:class:`TaskWorkload`: ``arith-seq`` prompts drawn from the run seed, its token-level
  reward). With one it is a :class:`DatasetWorkload`: the train (and eval) split loaded with
  HF ``datasets``, the reward started in its worker processes
  (:class:`~trainer_svc.inputs.scorer.RewardScorer`), so a missing file, a missing column, an empty
  split or a reward that does not import is a :class:`WorkloadError` naming the path, key or
  function and the cause, before the model is built. Only then ``use_model(model_dir)``
  loads the tokenizer: prompts are rendered through its chat template (and ``system_prompt``),
  and generation stops at its EOS.
- ``prompts(step, count)`` is a pure function of (seed, step, count) and the data: a restarted
  trainer, or a test, draws the same prompts. ``count`` defaults to ``prompts_per_step``; more
  (dynamic sampling's extra prompts) extend the same list, which stays a prefix of any longer one.
- ``score(prompt, responses)`` returns one reward per response, each response's decoded text
  (special tokens skipped; None without a tokenizer) and how many reward calls failed. A
  failing call scores 0 and is counted; the scorer logs the first failure of each kind with
  its traceback. User reward code never runs in the trainer's process or on its event loop.
- ``evaluate(step, model_dir)`` is due every ``eval.every`` steps (step 0 included): one
  response per held-out prompt, sampled at the run's temperature from the weights of version
  ``step`` as published (the model is not trained on them), scored like training samples.
  Sampling is :func:`shared.generation.generate`, the rollout's keyed draw, at keys no
  training sample uses (:func:`eval_key`): an eval is a pure function of the weights.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shared import spec as shared_spec
from shared.generation import DrawKey, generate
from shared.spec import RunSpec
from trainer_svc.embedded import task
from trainer_svc.errors import RunSpecError
from trainer_svc.inputs.chat import ChatFormat, ChatFormatError, eos_token_ids
from trainer_svc.inputs.data import DatasetError, DatasetSpec, PromptDataset, load_prompts
from trainer_svc.inputs.rewards import BUILTIN_REWARDS, RewardNameError
from trainer_svc.inputs.scorer import RewardScorer, RewardWorkerError

TokenReward = Callable[[list[int], list[int]], float]


@dataclass(frozen=True, slots=True)
class StepPrompt:
    """One prompt of a step: what the model is fed, and the text the reward and user see."""

    token_ids: list[int]
    prompt: str  # the dataset's string (the built-in task: its decoded tokens)
    prompt_text: str  # as fed to the model, template applied
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class Scored:
    rewards: list[float]
    texts: list[str | None]
    errors: int = 0


@dataclass(frozen=True, slots=True)
class EvalResult:
    reward_mean: float
    responses: int
    errors: int


class Workload(Protocol):
    eos_token_id: int

    def use_model(self, model_dir: Path | None, reward: TokenReward) -> None: ...
    def prompts(self, step: int, count: int | None = None) -> list[StepPrompt]: ...
    async def score(self, prompt: StepPrompt, responses: list[list[int]]) -> Scored: ...
    def eval_due(self, step: int) -> bool: ...
    async def evaluate(self, step: int, model_dir: Path) -> EvalResult: ...
    async def close(self) -> None: ...


class TaskWorkload:
    """The built-in ``arith-seq`` task: prompts and reward on token ids; text when the model
    directory has a tokenizer (``tiny``'s decodes its 14 tokens)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.reward: TokenReward = task.reward
        self.eos_token_id = task.EOS_ID
        self.tokenizer: Any = None

    def use_model(self, model_dir: Path | None, reward: TokenReward) -> None:
        self.reward = reward  # the policy's: an emu model scores its own stand-in tokens
        if model_dir is not None and (model_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    def _text(self, ids: Sequence[int], skip_special: bool) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))

    def prompts(self, step: int, count: int | None = None) -> list[StepPrompt]:
        out = []
        for ids in task.make_prompts(self.spec.seed, step, count or self.spec.prompts_per_step):
            text = self._text(ids, skip_special=False) or task.detokenize(ids)
            out.append(StepPrompt(ids, text, text))
        return out

    async def score(self, prompt: StepPrompt, responses: list[list[int]]) -> Scored:
        return Scored([self.reward(prompt.token_ids, r) for r in responses],
                      [self._text(r, skip_special=True) for r in responses])

    def eval_due(self, step: int) -> bool:
        return False

    async def evaluate(self, step: int, model_dir: Path) -> EvalResult:
        raise RunSpecError("the built-in task has no eval set")

    async def close(self) -> None:
        return None


class DatasetWorkload:
    """Prompts from a dataset through the chat template; rewards by name, in worker processes."""

    def __init__(self, spec: RunSpec, train: PromptDataset, held_out: PromptDataset | None,
                 scorer: RewardScorer) -> None:
        self.spec = spec
        self.train = train
        self.held_out = held_out
        self.scorer = scorer
        self.eos_token_id = 0
        self.eos_ids: list[int] = []
        self.chat: ChatFormat | None = None
        self._rendered: dict[str, StepPrompt] = {}

    def use_model(self, model_dir: Path | None, reward: TokenReward) -> None:
        if model_dir is None or not (model_dir / "tokenizer_config.json").is_file():
            raise RunSpecError(f"model {self.spec.model!r} has no tokenizer; a dataset needs one")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        try:
            self.chat = ChatFormat(tokenizer, self.spec.chat_template, self.spec.system_prompt)
            self.eos_ids = eos_token_ids(model_dir, tokenizer)
        except ChatFormatError as exc:
            raise RunSpecError(f"model {self.spec.model!r}: {exc}") from exc
        # The first is the generation config's (a chat model's end of turn). Engines stop on
        # one id for now; the rest still end a response for the reward (skipped in decoding).
        self.eos_token_id = self.eos_ids[0]

    def _render(self, prompt: str, answer: str | None) -> StepPrompt:
        hit = self._rendered.get(prompt)
        if hit is None or hit.answer != answer:
            assert self.chat is not None, "use_model() first"
            r = self.chat.render(prompt)
            hit = StepPrompt(r.prompt_token_ids, r.prompt, r.prompt_text, answer)
            self._rendered[prompt] = hit
        return hit

    def prompts(self, step: int, count: int | None = None) -> list[StepPrompt]:
        n = self.spec.prompts_per_step
        drawn = self.train.draw(self.spec.seed, step, n)
        if count is not None and count > n:  # beyond the epoch stream, whose next rows are
            drawn += self.train.draw_extra(self.spec.seed, step, n, count)  # the next step's
        return [self._render(e.prompt, e.answer) for e in drawn]

    async def score(self, prompt: StepPrompt, responses: list[list[int]]) -> Scored:
        assert self.chat is not None, "use_model() first"
        texts = [self.chat.decode(r) for r in responses]
        rewards, errors = await self.scorer.score_many(
            [(prompt.prompt, t, prompt.answer) for t in texts])
        return Scored(rewards, list(texts), errors)

    def eval_due(self, step: int) -> bool:
        every = self.spec.eval.every if self.spec.eval else 0
        return self.held_out is not None and every > 0 and step % every == 0

    async def evaluate(self, step: int, model_dir: Path) -> EvalResult:
        assert self.held_out is not None and self.chat is not None
        items = [self._render(e.prompt, e.answer) for e in self.held_out.examples()]
        responses = await asyncio.to_thread(self._sample, model_dir, items, step)
        rewards, errors = await self.scorer.score_many(
            [(p.prompt, self.chat.decode(r), p.answer) for p, r in zip(items, responses,
                                                                           strict=True)])
        return EvalResult(statistics.fmean(rewards), len(rewards), errors)

    def _sample(self, model_dir: Path, items: list[StepPrompt], step: int) -> list[list[int]]:
        from trainer_svc.learn.checkpoint import load_policy

        model = load_policy(model_dir).eval()
        pad = int(getattr(model.config, "pad_token_id", None) or 0)
        return generate(model, [p.token_ids for p in items], self.spec.max_new_tokens,
                        self.spec.temperature, self.eos_ids,
                        [eval_key(self.spec.seed, step, i) for i in range(len(items))], pad)

    async def close(self) -> None:
        await self.scorer.close()


def eval_key(seed: int, step: int, index: int) -> DrawKey:
    """The draw of held-out prompt ``index`` at the eval of ``step``: keyed like a rollout's,
    at step ``-1 - step``, which no training sample draws at (their steps count from 0)."""
    return DrawKey(seed, -1 - step, index, 0)


async def open_workload(spec: RunSpec, data_dir: Path, reward_path: Sequence[str],
                        reward_timeout_s: float, *, dataset_roots: Sequence[Path],
                        reward_env: Sequence[str] = ()) -> Workload:
    """The run's workload; bad data or a bad reward is a RunSpecError (the run fails).
    ``dataset_roots``: where data files may be read from; ``reward_env``: names of variables
    the reward workers get beyond the scorer's allowlist (RLBOOST_REWARD_ENV)."""
    if spec.dataset is None:
        return TaskWorkload(spec)
    name = spec.reward_name
    load = functools.partial(load_prompts, require_answer=name in BUILTIN_REWARDS,
                             cache_dir=data_dir / "datasets", roots=dataset_roots)
    try:
        train = await asyncio.to_thread(load, _dataset(spec.dataset))
        held_out = None
        if spec.eval is not None:
            held_out = await asyncio.to_thread(load, _dataset(spec.eval))
    except DatasetError as exc:
        raise RunSpecError(str(exc)) from exc
    scorer = RewardScorer(name, reward_path=reward_path, timeout_s=reward_timeout_s,
                          pass_env=reward_env)
    try:
        await scorer.start()
    except (RewardNameError, RewardWorkerError) as exc:
        raise RunSpecError(str(exc)) from exc
    return DatasetWorkload(spec, train, held_out, scorer)


def _dataset(d: shared_spec.DatasetSpec | shared_spec.EvalSpec) -> DatasetSpec:
    return DatasetSpec(d.path, d.prompt_key, d.answer_key, d.split)
