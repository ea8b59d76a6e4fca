"""In-process proof that GRPO improves the tiny policy: no services, no network.

Each RL step draws ``prompts_per_step`` prompts with ``task.make_prompts(seed, step, n)``,
samples ``samples_per_prompt`` responses per prompt at temperature 1 from the current
policy, scores them with ``task.reward``, feeds every group to the trainer's
:class:`~trainer_svc.learn.step_trainer.StepTrainer` with GRPO's defaults
(:func:`trainer_svc.selfcheck.grpo.train_step`) and takes one optimizer step. This is the math
the trainer service runs, minus the transport, so a regression here is a regression there.

The check passes when the mean reward of the last ``window`` steps beats the first
``window`` steps by at least ``min_gain``. Run it with ``python -m trainer_svc.selfcheck``
(``--seeds 0 1 2 3``, ``--data-dir``); it prints one line per seed and exits non-zero on
failure. Sampling is the rollout's keyed draw (:func:`shared.generation.generate`), keyed by
(seed, step, prompt, sample, position) as a run's rollout is, so a run is reproducible and
leaves the global RNG alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.generation import DrawKey, generate
from trainer_svc.embedded import task
from trainer_svc.embedded.tiny import build_tiny
from trainer_svc.learn.checkpoint import load_policy
from trainer_svc.learn.schedule import DEFAULT_LR_WARMUP_STEPS, learning_rate_at
from trainer_svc.selfcheck import grpo


@dataclass(slots=True, kw_only=True)
class SelfCheckResult(grpo.RewardCurve):
    """One simulated run's reward curve, and how long it took."""

    seconds: float = 0.0


def run_rl(
    model: torch.nn.Module,
    seed: int,
    steps: int = grpo.DEFAULT_STEPS,
    prompts_per_step: int = grpo.DEFAULT_PROMPTS_PER_STEP,
    samples_per_prompt: int = grpo.DEFAULT_SAMPLES_PER_PROMPT,
    learning_rate: float = grpo.DEFAULT_LEARNING_RATE,
    lr_warmup_steps: int = DEFAULT_LR_WARMUP_STEPS,
    max_new_tokens: int = task.DEFAULT_MAX_NEW_TOKENS,
    window: int = grpo.DEFAULT_WINDOW,
) -> SelfCheckResult:
    """Train ``model`` in place with GRPO for ``steps`` steps; returns per-step mean rewards."""
    trainer = grpo.make_trainer(model, learning_rate, max_new_tokens, prompts_per_step,
                                task.PAD_ID)
    result = SelfCheckResult(seed=seed, window=window)
    started = time.perf_counter()
    for step in range(steps):
        prompts = task.make_prompts(seed, step, prompts_per_step)
        # One batched sampling call for the whole step; groups are consecutive rows.
        flat = [p for p in prompts for _ in range(samples_per_prompt)]
        keys = [DrawKey(seed, step, g, j) for g in range(len(prompts))
                for j in range(samples_per_prompt)]
        model.eval()
        responses = generate(model, flat, max_new_tokens, 1.0, [task.EOS_ID], keys, task.PAD_ID)
        model.train()
        rewards = [task.reward(p, r) for p, r in zip(flat, responses, strict=True)]
        grpo.train_step(trainer, flat, responses, rewards, samples_per_prompt, {task.EOS_ID},
                        learning_rate_at(step, learning_rate, lr_warmup_steps))
        result.step_rewards.append(statistics.fmean(rewards))
    model.eval()
    result.seconds = time.perf_counter() - started
    return result


def check_seed(data_dir: Path, seed: int, **kwargs: int | float) -> SelfCheckResult:
    """Build (or reuse) the tiny model for ``seed`` and run the simulated RL loop on it."""
    model = load_policy(build_tiny(data_dir, seed))
    return run_rl(model, seed, **kwargs)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=grpo.DEFAULT_STEPS)
    parser.add_argument("--lr", type=float, default=grpo.DEFAULT_LEARNING_RATE)
    parser.add_argument("--min-gain", type=float, default=grpo.DEFAULT_MIN_GAIN)
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    # A CLI entry point owns its process: these ops are too small to split across threads,
    # and on a shared machine spinning intra-op workers made each run 5-10x slower.
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or Path(tmp)
        failed = 0
        for seed in args.seeds:
            res = check_seed(data_dir, seed, steps=args.steps, learning_rate=args.lr)
            ok = res.gain >= args.min_gain
            failed += not ok
            print(
                f"seed {seed}: first{res.window} {res.first:.3f} last{res.window} {res.last:.3f} "
                f"gain {res.gain:+.3f} ({res.seconds:.1f}s) {'ok' if ok else 'FAIL'}",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
