"""The embedded text model ``"tiny-chat"``: a small Qwen2 chat model, built and cached locally.

Contract:

- ``build_tiny_chat(data_dir, seed)`` returns an HF model directory
  ``data_dir/models/tiny-chat-<hash>/`` that ``AutoModelForCausalLM.from_pretrained`` and
  ``AutoTokenizer.from_pretrained`` load offline. ``<hash>`` covers the architecture, the
  tokenizer and warm-up recipes, the word-problem generator's version and the seed; the
  result is a pure function of those. Built in a temporary sibling and renamed into place
  (:func:`~trainer_svc.embedded.model_dir.build_once`, as ``build_tiny`` is): readers see no
  directory or a complete one.
- The tokenizer is byte-level BPE trained here on the word-problem text, with exactly the
  pipeline transformers' ``Qwen2Tokenizer`` rebuilds on load (NFC, Qwen's split regex with
  single digits, ByteLevel bytes), so the directory tokenizes identically through
  ``AutoTokenizer``. Every UTF-8 string tokenizes (256 byte symbols) and decodes back to its
  NFC form. Special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>``
  (end of turn); ``generation_config.eos_token_id`` lists ``<|im_end|>`` and
  ``<|endoftext|>``. The chat template is Qwen's layout without its default system prompt.
- The warm-up is supervised training on the train split rendered through the chat template,
  loss on the answer tokens only. Each sampled target's final value is replaced by a wrong
  one with probability ``WARMUP_NOISE``: the worked equation stays right, the value after
  ``####`` is off by 1-3. The policy learns the arithmetic, then often contradicts its own
  working in the final answer: partial competence (the math reward reads the final answer)
  with headroom that RL can take by one shared habit, copying the equation's result. This is
  ``tiny``'s noisy warm-up carried over to text.
- The build runs on one intra-op thread and restores torch's thread count and global RNG.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from trainer_svc.embedded import word_problems
from trainer_svc.embedded.model_dir import build_once

log = logging.getLogger(__name__)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]  # ids 0, 1, 2
# transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX: on load it rebuilds this pipeline, so the
# trained merges must be learnt over the same pre-tokens.
QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A cap: the train text runs out of pairs first, at 477 ids (3 specials, 256 bytes, 218
# merges), by which point every word of the problems is one token.
VOCAB_SIZE = 512

# ~455k parameters. Two layers learned these problems faster per CPU second than three or
# four (greedy eval after 900 noise-free warm-up steps of 32: 0.85 in 59 CPU s, against 0.81
# in 69 s for three layers; four reached 0.76 after 600 steps in 62 s).
TINY_CHAT_ARCH: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 384,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
# With these (selfcheck.chat, seeds 0-2) the built policy's worked equation is right on
# 91-96 % of eval problems, its final answer on 43-50 % at temperature 1; 40 GRPO steps take
# the final answer to 0.88-0.94. The build is ~55 CPU s on one thread.
WARMUP_NOISE = 0.5
WARMUP_STEPS = 900
WARMUP_BATCH = 32
WARMUP_LR = 3e-3
# Bump when the recipe changes in a way the hash inputs do not capture.
BUILDER_VERSION = 1


def tiny_chat_key(seed: int) -> str:
    """The cache key (directory suffix) of the tiny-chat model built with ``seed``."""
    spec = {
        "arch": TINY_CHAT_ARCH,
        "tokenizer": [VOCAB_SIZE, SPECIAL_TOKENS, QWEN_SPLIT, CHAT_TEMPLATE],
        "warmup": [WARMUP_NOISE, WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR],
        "data": [word_problems.GENERATOR_VERSION, word_problems.DEFAULT_SEED,
                 word_problems.DEFAULT_TRAIN, word_problems.DEFAULT_EVAL],
        "builder": BUILDER_VERSION,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def corpus() -> list[str]:
    train, _ = word_problems.splits()
    # The chat scaffolding is in the corpus so "user", "assistant" and "\n" merge too.
    return [f"user\n{p.prompt}\nassistant\n{p.answer}\n" for p in train]


def train_tokenizer(
    vocab_size: int = VOCAB_SIZE, texts: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on ``texts`` (the train split's text, :func:`corpus`, unless
    given);
    deterministic for a fixed corpus."""
    core = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus() if texts is None else texts, trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one special token (the trainer adds them first: 0, 1, 2)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{token!r} maps to {found!r}, not one id")
    return found


def tiny_chat_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=token_id(tokenizer, ENDOFTEXT),
        bos_token_id=None,
        eos_token_id=token_id(tokenizer, IM_END),
        **TINY_CHAT_ARCH,
    )


def _noisy_answer(problem: word_problems.Problem, rng: random.Random) -> str:
    """The answer text; with probability WARMUP_NOISE the value after ``####`` is wrong."""
    if rng.random() >= WARMUP_NOISE:
        return problem.answer
    wrong = max(0, problem.value + rng.choice([-3, -2, -1, 1, 2, 3]))
    if wrong == problem.value:
        wrong = problem.value + 1
    working = problem.answer.rsplit("####", 1)[0]
    return f"{working}#### {wrong}"


def _encode_examples(
    tokenizer: PreTrainedTokenizerFast, problems: list[word_problems.Problem]
) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


# A warm-up target: the trained turns after one problem's rendered prompt, as (ids, trained)
# pieces (an observation between model turns is a piece with no loss); it may draw from rng.
Target = Callable[[word_problems.Problem, random.Random], list[tuple[list[int], bool]]]


def answer_target(tokenizer: PreTrainedTokenizerFast) -> Target:
    """tiny-chat's target: one assistant turn, the noisy answer, then its end of turn."""
    im_end = token_id(tokenizer, IM_END)

    def target(problem: word_problems.Problem, rng: random.Random) -> list[tuple[list[int], bool]]:
        text = _noisy_answer(problem, rng)
        return [([*tokenizer(text, add_special_tokens=False)["input_ids"], im_end], True)]

    return target


def warm_up(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int,
            target: Target | None = None, stream: str = "tiny-chat-warmup") -> float:
    """Supervised warm-up on noisy answers (module docstring), or on ``target``'s turns drawn
    from the RNG ``stream``; returns the last batch loss."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(model, tokenizer, target or answer_target(tokenizer), f"{stream}/{seed}")
    finally:
        torch.set_num_threads(threads)


def _fit(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, target: Target,
         stream: str) -> float:
    train, _ = word_problems.splits()
    prompts = _encode_examples(tokenizer, train)
    pad = token_id(tokenizer, ENDOFTEXT)
    rng = random.Random(stream)
    opt = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / WARMUP_STEPS)
    )
    model.train()
    loss = torch.zeros(())
    for _ in range(WARMUP_STEPS):
        rows = [rng.randrange(len(train)) for _ in range(WARMUP_BATCH)]
        pieces = [target(train[r], rng) for r in rows]
        seqs: list[list[int]] = []
        trained: list[list[bool]] = []
        for r, turns in zip(rows, pieces, strict=True):
            seqs.append(prompts[r] + [t for ids, _ in turns for t in ids])
            trained.append([False] * len(prompts[r])
                           + [on for ids, on in turns for _ in ids])
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        for i, (s, mask) in enumerate(zip(seqs, trained, strict=True)):
            row = torch.tensor(s)
            ids[i, : len(s)] = row
            labels[i, : len(s)] = torch.where(torch.tensor(mask), row, -100)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss.detach())


def build_into(out_dir: Path, seed: int, name: str,
               tokenizer: PreTrainedTokenizerFast | None = None,
               target: Callable[[PreTrainedTokenizerFast], Target] = answer_target,
               stream: str = "tiny-chat-warmup") -> None:
    """Write the model ``name`` into ``out_dir``: ``tokenizer`` (tiny-chat's unless given),
    a fresh model warmed up on ``target(tokenizer)``, tiny-chat's generation config."""
    started = time.perf_counter()
    tokenizer = tokenizer or train_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(tiny_chat_config(tokenizer))
    loss = warm_up(model, tokenizer, seed, target(tokenizer), stream)
    ids = [token_id(tokenizer, t) for t in (IM_END, ENDOFTEXT)]
    # Plain sampling for anyone calling generate(): transformers' default top_k=50 would
    # sample from a distribution other than the one the trainer's log-probs describe.
    model.generation_config = GenerationConfig(
        eos_token_id=ids, pad_token_id=ids[1], do_sample=True, temperature=1.0, top_k=0, top_p=1.0
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info("built %s in %.1fs (warm-up loss %.3f)", name, time.perf_counter() - started, loss)


def build_tiny_chat(data_dir: Path, seed: int) -> Path:
    """Build (or return the cached) tiny-chat model directory for ``seed`` under ``data_dir``."""
    final = Path(data_dir) / "models" / f"tiny-chat-{tiny_chat_key(seed)}"
    return build_once(final, lambda out_dir: build_into(out_dir, seed, final.name))
