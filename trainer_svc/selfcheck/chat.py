"""In-process check that GRPO lifts tiny-chat's reward on the word problems: no services.

Each RL step draws ``prompts_per_step`` problems from the train split with
``PromptDataset.draw(seed, step, n)``, renders them through the chat template, samples
``samples_per_prompt`` responses per prompt at temperature 1 with the rollout's keyed draw
(:func:`shared.generation.generate`, keyed by seed, step, prompt and sample), decodes them
(special tokens skipped), scores them with the ``math`` reward in its worker processes
(:class:`~trainer_svc.inputs.scorer.RewardScorer`), feeds every group to the trainer's
:class:`~trainer_svc.learn.step_trainer.StepTrainer` with GRPO's defaults
(:func:`trainer_svc.selfcheck.grpo.train_step`) and takes one optimizer step. Eval samples one
response per held-out prompt, at the same temperature and with the same draws each time,
before the first step, every ``eval_every`` steps and after the last.

Problems come from :mod:`trainer_svc.embedded.word_problems` (the text of ``examples/data/``),
or from ``--train-file``/``--eval-file`` through :func:`trainer_svc.inputs.data.load_prompts`.

It answers a budget question, so it times everything, the model build included: run it as
``python -m trainer_svc.selfcheck.chat --seeds 0 1 2`` (one intra-op thread, as a trainer
sharing two cores with its rollout instances gets). It prints one line per seed and exits
non-zero when a seed's last-``window`` train mean does not beat its first-``window`` mean by
``min_gain``. The build's cost is paid once per seed and data dir; ``--data-dir`` reuses it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from shared.generation import DrawKey, generate
from trainer_svc.embedded import word_problems
from trainer_svc.embedded.tiny_chat import build_tiny_chat
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids
from trainer_svc.inputs.data import DatasetSpec, PromptDataset, load_prompts
from trainer_svc.inputs.scorer import RewardScorer
from trainer_svc.learn.checkpoint import load_policy
from trainer_svc.learn.schedule import learning_rate_at
from trainer_svc.selfcheck import grpo
from trainer_svc.workload import eval_key

DEFAULT_STEPS = 40
DEFAULT_PROMPTS_PER_STEP = 16
DEFAULT_SAMPLES_PER_PROMPT = 8
DEFAULT_MAX_NEW_TOKENS = 16
DEFAULT_LEARNING_RATE = 2e-4
DEFAULT_EVAL_EVERY = 10


@dataclass(slots=True, kw_only=True)
class ChatCheckResult(grpo.RewardCurve):
    """One seed's curves and timings."""

    evals: list[tuple[int, float]] = field(default_factory=list)  # (steps done, eval mean)
    reward_errors: int = 0
    build_s: float = 0.0
    rl_s: float = 0.0
    rl_cpu_s: float = 0.0


def problems_dataset(problems: list[word_problems.Problem], name: str) -> PromptDataset:
    return PromptDataset(name, [p.prompt for p in problems], [p.answer for p in problems])


class ChatRL:
    """The model, tokenizer, chat format and reward of one run, and its step and eval."""

    def __init__(self, model_dir: Path, scorer: RewardScorer, learning_rate: float,
                 max_new_tokens: int) -> None:
        self.model = load_policy(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.chat = ChatFormat(self.tokenizer)
        self.eos_ids = eos_token_ids(model_dir, self.tokenizer)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.scorer = scorer
        self.max_new_tokens = max_new_tokens
        self.learning_rate = learning_rate
        # One mini-batch: every group streams, whatever the step's prompt count.
        self.trainer = grpo.make_trainer(self.model, learning_rate, max_new_tokens, 1,
                                         self.pad_id)
        self._ids: dict[str, list[int]] = {}

    def _prompt_ids(self, prompt: str) -> list[int]:
        if prompt not in self._ids:
            self._ids[prompt] = self.chat.render(prompt).prompt_token_ids
        return self._ids[prompt]

    async def _rollout(self, items: list[tuple[str, str | None]], keys: list[DrawKey]
                       ) -> tuple[list[list[int]], list[list[int]], list[float], int]:
        prompts = [self._prompt_ids(p) for p, _ in items]
        self.model.eval()
        responses = generate(self.model, prompts, self.max_new_tokens, 1.0, self.eos_ids, keys,
                             self.pad_id)
        texts = [self.chat.decode(r) for r in responses]
        rewards, errors = await self.scorer.score_many(
            [(p, t, a) for (p, a), t in zip(items, texts, strict=True)]
        )
        return prompts, responses, rewards, errors

    async def step(self, data: PromptDataset, seed: int, step: int, n: int, group: int
                   ) -> tuple[float, int]:
        """One GRPO step; returns the mean train reward and the reward errors."""
        drawn = data.draw(seed, step, n)
        items = [(e.prompt, e.answer) for e in drawn for _ in range(group)]
        keys = [DrawKey(seed, step, g, j) for g in range(len(drawn)) for j in range(group)]
        prompts, responses, rewards, errors = await self._rollout(items, keys)
        self.model.train()
        grpo.train_step(self.trainer, prompts, responses, rewards, group, self.eos_ids,
                        learning_rate_at(step, self.learning_rate))
        self.model.eval()
        return statistics.fmean(rewards), errors

    async def evaluate(self, data: PromptDataset, seed: int) -> float:
        items = [(e.prompt, e.answer) for e in data.examples()]
        keys = [eval_key(seed, 0, i) for i in range(len(items))]  # as a run's eval draws
        _, _, rewards, _ = await self._rollout(items, keys)
        return statistics.fmean(rewards)


def default_splits() -> tuple[PromptDataset, PromptDataset]:
    """The word problems as generated (equal to the files in examples/data/, tested)."""
    train, held_out = word_problems.splits()
    return problems_dataset(train, "train"), problems_dataset(held_out, "eval")


async def check_seed(
    data_dir: Path,
    seed: int,
    datasets: tuple[PromptDataset, PromptDataset] | None = None,
    steps: int = DEFAULT_STEPS,
    prompts_per_step: int = DEFAULT_PROMPTS_PER_STEP,
    samples_per_prompt: int = DEFAULT_SAMPLES_PER_PROMPT,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    eval_every: int = DEFAULT_EVAL_EVERY,
    window: int = grpo.DEFAULT_WINDOW,
) -> ChatCheckResult:
    """Build (or reuse) tiny-chat for ``seed``, then run GRPO on the word problems."""
    result = ChatCheckResult(seed=seed, window=window)
    started = time.perf_counter()
    model_dir = build_tiny_chat(data_dir, seed)
    result.build_s = time.perf_counter() - started
    train_ds, eval_ds = datasets or default_splits()
    async with RewardScorer("math") as scorer:
        rl = ChatRL(model_dir, scorer, learning_rate, max_new_tokens)
        wall, cpu = time.perf_counter(), time.process_time()
        for step in range(steps):
            if step % eval_every == 0:
                result.evals.append((step, await rl.evaluate(eval_ds, seed)))
            mean, errors = await rl.step(train_ds, seed, step, prompts_per_step,
                                         samples_per_prompt)
            result.step_rewards.append(mean)
            result.reward_errors += errors
        result.evals.append((steps, await rl.evaluate(eval_ds, seed)))
        result.rl_s = time.perf_counter() - wall
        result.rl_cpu_s = time.process_time() - cpu
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--prompts-per-step", type=int, default=DEFAULT_PROMPTS_PER_STEP)
    parser.add_argument("--samples-per-prompt", type=int, default=DEFAULT_SAMPLES_PER_PROMPT)
    parser.add_argument("--lr", type=float, default=DEFAULT_LEARNING_RATE)
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    parser.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY)
    parser.add_argument("--min-gain", type=float, default=grpo.DEFAULT_MIN_GAIN)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--train-file", type=Path, default=None,
                        help="JSONL/JSON/Parquet/CSV with prompt and answer (default: generated)")
    parser.add_argument("--eval-file", type=Path, default=None)
    parser.add_argument("--curves", action="store_true", help="print every step's reward")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    datasets = None
    if args.train_file or args.eval_file:
        train_ds, eval_ds = default_splits()
        if args.train_file:
            train_ds = load_prompts(DatasetSpec(str(args.train_file)), require_answer=True)
        if args.eval_file:
            eval_ds = load_prompts(DatasetSpec(str(args.eval_file)), require_answer=True)
        datasets = (train_ds, eval_ds)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or Path(tmp)
        for seed in args.seeds:
            res = asyncio.run(check_seed(
                data_dir, seed, datasets, steps=args.steps, prompts_per_step=args.prompts_per_step,
                samples_per_prompt=args.samples_per_prompt, learning_rate=args.lr,
                max_new_tokens=args.max_new_tokens, eval_every=args.eval_every,
            ))
            ok = res.gain >= args.min_gain
            failed += not ok
            evals = " ".join(f"{s}:{v:.3f}" for s, v in res.evals)
            print(
                f"seed {seed}: train first{res.window} {res.first:.3f} last{res.window} "
                f"{res.last:.3f} gain {res.gain:+.3f} | eval {evals} | reward errors "
                f"{res.reward_errors} | build {res.build_s:.1f}s, RL {res.rl_s:.1f}s "
                f"(cpu {res.rl_cpu_s:.1f}s), total {res.build_s + res.rl_s:.1f}s "
                f"{'ok' if ok else 'FAIL'}",
                flush=True,
            )
            if args.curves:
                print("  " + " ".join(f"{r:.2f}" for r in res.step_rewards), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
