"""The embedded ``"tiny"`` policy: a small Qwen2 causal LM, warmed up to partial competence.

Contract:

- ``build_tiny(data_dir, seed)`` returns an HF model directory
  ``data_dir/models/tiny-<hash>/`` that ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained`` load offline. ``<hash>`` covers the architecture, the
  warm-up recipe, the task (name, version, vocabulary) and the seed, so a directory is never
  reused for a different model. The result is a pure function of those inputs.
- The directory is built in a temporary sibling and renamed into place
  (:func:`~trainer_svc.embedded.model_dir.build_once`): a reader sees either no directory or a
  complete one, and of two racing builders one wins and the other discards its copy.
- The warm-up is supervised training on *noisy* targets: each answer digit is replaced by a
  uniformly random digit with probability ``WARMUP_NOISE`` (EOS is kept). We fit the
  expectation of those targets directly (soft labels: ``1 - p + p/10`` on the right digit,
  ``p/10`` on each other one), which converges to the same policy without sampling noise.
  Inputs at answer positions are noised the same way, because at sampling time the policy
  conditions on its own imperfect earlier digits. The result samples roughly
  ``1 - p + p/10`` of the digits right at temperature 1: competent enough for GRPO to find
  signal in every group, far enough from perfect for RL to show.
- Nothing here changes global torch state at import time, and the build leaves it as it
  found it: the seeded init runs inside ``torch.random.fork_rng``, and the warm-up's
  one-thread setting is restored when it ends.
- ``AutoTokenizer`` loads the saved tokenizer as transformers' ``Qwen2Tokenizer`` (it forces
  that class for ``model_type == "qwen2"``); ids agree with ``task.VOCAB``, and it decodes
  without separators, which is harmless for a one-character-per-token vocabulary.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from trainer_svc.embedded import task
from trainer_svc.embedded.model_dir import build_once

TINY_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
# p = 0.5 puts the sampled per-digit accuracy near 0.55: partial, with headroom for RL.
WARMUP_NOISE = 0.5
WARMUP_STEPS = 250
WARMUP_LR = 3e-3
WARMUP_COPIES = 8  # noisy copies of each of the task's 30 prompts per warm-up batch
# Bump when the build recipe changes in a way the hash inputs above do not capture.
BUILDER_VERSION = 1


def tiny_config() -> Qwen2Config:
    """The architecture of the tiny model, with the task's vocabulary and special ids."""
    return Qwen2Config(
        vocab_size=len(task.VOCAB),
        pad_token_id=task.PAD_ID,
        bos_token_id=task.BOS_ID,
        eos_token_id=task.EOS_ID,
        **TINY_ARCH,
    )


def tiny_key(seed: int) -> str:
    """The cache key (directory suffix) of the tiny model built with ``seed``."""
    spec = {
        "arch": TINY_ARCH,
        "warmup": [WARMUP_NOISE, WARMUP_STEPS, WARMUP_LR, WARMUP_COPIES],
        "task": [task.TASK_NAME, task.TASK_VERSION, task.VOCAB, task.RESPONSE_LEN],
        "builder": BUILDER_VERSION,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the task vocabulary; digits split one per token."""
    vocab = {tok: i for i, tok in enumerate(task.VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    specials = task.VOCAB[: task.DIGIT_IDS[0]]
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=task.VOCAB[task.PAD_ID],
        bos_token=task.VOCAB[task.BOS_ID],
        eos_token=task.VOCAB[task.EOS_ID],
        sep_token=task.VOCAB[task.SEP_ID],
    )


def _warmup_batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[copies*30, 10]`` with noised answer digits, and soft answer targets."""
    prompts = task.all_prompts()
    refs = torch.tensor([p + task.reference_response(p) for p in prompts]).repeat(
        WARMUP_COPIES, 1
    )
    answer = slice(task.PROMPT_LEN, task.PROMPT_LEN + task.RESPONSE_LEN)
    noisy = refs.clone()
    flip = torch.rand(noisy[:, answer].shape, generator=gen) < WARMUP_NOISE
    random_digits = torch.randint(0, 10, noisy[:, answer].shape, generator=gen)
    noisy[:, answer] = torch.where(flip, random_digits + task.DIGIT_IDS[0], noisy[:, answer])
    # Soft targets for every predicted position of the response (answer digits and EOS).
    targets = F.one_hot(refs[:, task.PROMPT_LEN :], len(task.VOCAB)).double()
    digit_soft = torch.zeros(len(task.VOCAB), dtype=torch.float64)
    digit_soft[task.DIGIT_IDS] = WARMUP_NOISE / 10
    targets[:, : task.RESPONSE_LEN] = (
        targets[:, : task.RESPONSE_LEN] * (1 - WARMUP_NOISE) + digit_soft
    )
    return noisy, targets.float()


def warm_up(model: torch.nn.Module, seed: int) -> float:
    """Fit ``model`` to the noisy-target distribution; returns the final loss.

    Runs on one intra-op thread, restored afterwards: these ops are too small to split,
    and on a loaded machine torch's spinning worker threads made the build ~15x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(model, seed)
    finally:
        torch.set_num_threads(threads)


def _fit(model: torch.nn.Module, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed * 7919 + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    model.train()
    loss = torch.zeros(())
    for _ in range(WARMUP_STEPS):
        ids, targets = _warmup_batch(gen)
        logits = model(input_ids=ids).logits
        # Positions PROMPT_LEN-1 .. end-1 predict the response tokens.
        logp = F.log_softmax(logits[:, task.PROMPT_LEN - 1 : -1], dim=-1)
        loss = -(targets * logp).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def _build_into(out_dir: Path, seed: int) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_config())
    warm_up(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=task.BOS_ID, eos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)


def build_tiny(data_dir: Path, seed: int) -> Path:
    """Build (or return the cached) tiny model directory for ``seed`` under ``data_dir``."""
    final = Path(data_dir) / "models" / f"tiny-{tiny_key(seed)}"
    return build_once(final, lambda out_dir: _build_into(out_dir, seed))
