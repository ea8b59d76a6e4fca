"""The run spec: the body of ``POST /v1/runs``, what the manager stores, what the trainer runs.

Contract: :class:`RunSpec` is declared here and nowhere else, so its field names, defaults and
bounds are written once. Every field has a default and a bound; adding a field is one line in
it. Each boundary decodes it with :func:`shared.protocol.decode` (the REST handler included,
where a bad field or a bad combination of knobs is a 422), and past that it is only ever read
as typed attributes. :class:`shared.protocol.ActiveRun` carries it to the trainer.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from shared.algorithm import AlgorithmConfig

Tracker = Literal["tensorboard", "wandb", "mlflow"]


class SeedingSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    mode: Literal["adaptive", "fixed", "off"] = "off"  # how the seeding window is chosen
    window_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0  # fixed (or first) window


Key = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]  # a dataset column
DataPath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
# "math", "exact" or "python:<module>:<function>": the names are checked here, at submit;
# whether the function imports is known only where the trainer's reward path is.
RewardName = Annotated[str, msgspec.Meta(
    pattern=r"^(math|exact|python:[A-Za-z_][\w.]*:[A-Za-z_]\w*)$", max_length=512)]


# Agentic runs (trainer_svc.inputs.envs): "" (none: one response per prompt, as without), a
# built-in environment, or "python:<module>:<factory>" from the trainer's reward path.
BUILTIN_ENVS = ("calculator", "python")
ENV_PATTERN = re.compile(r"python:[A-Za-z_][\w.]*:[A-Za-z_]\w*")
MAX_TURNS = 32
MAX_STALENESS = 8  # steps rolled out ahead of training: AReaL's experiments stop at 8 too


class DatasetSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    path: DataPath  # JSONL/JSON/Parquet/CSV file or dataset directory, as the trainer sees it
    prompt_key: Key = "prompt"  # column holding the prompt string
    answer_key: Key = "answer"  # column holding the answer the reward compares with
    split: Key = "train"  # a split, or a slice such as "train[:90%]"


class EvalSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    path: DataPath  # held-out prompts; never trained on
    every: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 10  # evaluate before these steps
    prompt_key: Key = "prompt"
    answer_key: Key = "answer"
    split: Key = "train"


# Qwen2's (and Llama's) attention and MLP projections: every linear layer of a decoder block.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ModuleName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][\w.]*$", max_length=256)]


class LoraSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """LoRA (Hu et al. 2021) through PEFT: adapters of ``rank`` on the named linear layers of a
    frozen base; the update is scaled by ``alpha / rank`` (docs/algorithms.md, LoRA)."""

    rank: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 8
    alpha: Annotated[float, msgspec.Meta(gt=0.0, le=65536.0)] = 16.0
    # Kept for PEFT's config (adapter_config.json); only 0 is accepted (RunSpec._check_lora).
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    # Module names (or name suffixes) PEFT matches against the model's linear layers.
    target_modules: Annotated[list[ModuleName], msgspec.Meta(min_length=1, max_length=64)] = (
        msgspec.field(default_factory=lambda: list(LORA_TARGETS)))


class RunSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/runs``; every field has a default, unknown fields are rejected."""

    # "tiny" (the embedded model), "tiny-chat" (the embedded text model), "tiny-chat-tools"
    # (tiny-chat warmed up to call the calculator env), an emu preset, or a path to an HF
    # model directory
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] = "tiny"
    task: Literal["arith-seq"] = "arith-seq"
    # The RL objective (shared.algorithm); each knob below left out takes its paper default.
    algorithm: Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp",
                       "reinforce_pp_baseline", "gspo"] = "grpo"
    # Defaults: the embedded task's tuned run (trainer_svc.selfcheck measures them: 40 steps of
    # 16 x 8 lift the last-5 mean reward 0.21-0.30 above the first-5 on seeds 0-5).
    steps: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 40
    prompts_per_step: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    # group size; 1 only with reinforce_pp (the others compare a response with its group)
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=1, le=512)] = 8
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=32768)] = 8
    # AdamW with a 5-step linear warm-up (trainer_svc.selfcheck.grpo.DEFAULT_LEARNING_RATE,
    # tuned there)
    learning_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 6e-4
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 1.0
    # Sampling and prompts are drawn from it (invariant 5), never from the run id.
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    seeding: SeedingSpec = msgspec.field(default_factory=SeedingSpec)
    # Asynchronous training (docs/async.md): steps n+1..n+staleness roll out while step n
    # trains, and no trained token is older than `staleness` weight versions; 0: synchronous,
    # on-policy, as before the field existed.
    staleness: Annotated[int, msgspec.Meta(ge=0, le=MAX_STALENESS)] = 0
    # Weight versions kept for the user (GET /v1/runs/{id}/checkpoints, rlboost export): every
    # save_every-th one and the final one (0: the final one only); of those, the newest
    # keep_last stay (0: all). The trainer checkpoints every step anyway, to resume from.
    save_every: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    keep_last: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    # Experiment trackers the trainer logs every step record to, offline, under the data dir.
    trackers: Annotated[list[Tracker], msgspec.Meta(max_length=3)] = msgspec.field(
        default_factory=list)
    # Prompts (and answers) from a dataset instead of the built-in task; needs a model with a
    # text tokenizer (not "tiny").
    dataset: DatasetSpec | None = None
    reward: RewardName | None = None  # with a dataset; None there means "math"
    chat_template: bool | None = None  # None: use the tokenizer's template when it has one
    system_prompt: Annotated[str, msgspec.Meta(max_length=65536)] | None = None
    eval: EvalSpec | None = None  # held-out prompts generated every eval.every steps
    # --- algorithm knobs: None = the algorithm's default (AlgorithmConfig.for_run) ---
    clip_ratio_low: float | None = None  # ratio clipped below at 1 - this
    clip_ratio_high: float | None = None  # and above at 1 + this (DAPO's clip-higher)
    loss_agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                      "seq_mean_token_sum_norm"] | None = None  # per-token losses -> step loss
    kl_coef: float | None = None  # KL(pi || initial policy) loss weight; > 0 loads a reference
    kl_estimator: Literal["k1", "k2", "k3"] | None = None  # k1 with kl_coef > 0 is refused
    entropy_coef: float | None = None  # entropy bonus weight
    overlong_buffer: int | None = None  # DAPO: tokens before max_new_tokens where a penalty ramps
    updates_per_step: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None  # passes per step
    minibatches: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None  # steps per pass
    dynamic_sampling: bool | None = None  # DAPO: train only on groups whose rewards differ
    # Correct for the engine's sampling policy differing from the trainer's (numerics, or a
    # stale version): "tis" or "decoupled", from each token's behaviour log-prob.
    off_policy: Literal["none", "tis", "decoupled"] | None = None
    off_policy_cap: float | None = None  # the correction's weight cap (None: its default)
    # Dynamic sampling's bound on generation (veRL's max_num_gen_batches): a step draws at most
    # this many batches of prompts_per_step prompts; short of informative groups then, it
    # trains on those it has and its record says so (dynamic_sampling_capped).
    max_gen_batches: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 4
    # --- agentic runs: the model acts, an environment answers, up to max_turns model turns ---
    env: Annotated[str, msgspec.Meta(max_length=512)] = ""  # see BUILTIN_ENVS above
    max_turns: Annotated[int, msgspec.Meta(ge=1, le=MAX_TURNS)] = 1  # model turns; 1: one
    max_tool_s: Annotated[float, msgspec.Meta(gt=0.0, le=300.0)] = 10.0  # per tool call
    # An observation longer than this many tokens is cut to it (and counted).
    max_observation_tokens: Annotated[int, msgspec.Meta(ge=1, le=32768)] = 256
    # LoRA adapters on a frozen base instead of full fine-tuning (None: every weight trains).
    lora: LoraSpec | None = None

    def __post_init__(self) -> None:
        # A ValueError here is a validation error to msgspec's decoder: a bad combination of
        # knobs is a 422 at the REST boundary, like any other bad field.
        self.algorithm_config()
        self._check_data()
        self._check_env()
        self._check_lora()

    def algorithm_config(self) -> AlgorithmConfig:
        """The objective this run trains with: knobs, paper defaults scaled to the run."""
        # dynamic_sampling is off in every preset, DAPO's included (shared.algorithm): a
        # spec that leaves it out gets False, as max_prompts and the services read it.
        return AlgorithmConfig.for_run(
            {name: getattr(self, name) for name in _ALGORITHM_FIELDS},
            max_new_tokens=self.max_new_tokens, groups_per_step=self.prompts_per_step,
            samples_per_prompt=self.samples_per_prompt)

    @property
    def max_prompts(self) -> int:
        """The most prompts one step may generate (dynamic sampling extends up to it)."""
        return self.prompts_per_step * (self.max_gen_batches if self.dynamic_sampling else 1)

    def _check_data(self) -> None:
        if self.dataset is None:
            for name in ("reward", "eval", "system_prompt", "chat_template"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} needs a dataset (the built-in task "
                                     f"{self.task!r} has its own reward and prompts)")
        elif self.model == "tiny":
            raise ValueError("model 'tiny' knows only the arith-seq task's 14 tokens; use "
                             "'tiny-chat' or an HF model directory with a dataset")

    def _check_env(self) -> None:
        if self.env and self.env not in BUILTIN_ENVS and not ENV_PATTERN.fullmatch(self.env):
            raise ValueError(f"env {self.env[:100]!r}: unknown; use one of "
                             f"{', '.join(BUILTIN_ENVS)} or python:<module>:<factory>")
        if self.env and self.dataset is None and self.model != "emu":
            # (the emulated model's environments read the task's prompts as ids)
            raise ValueError("env needs a dataset (an environment reads the prompt's text)")
        if not self.env and self.max_turns > 1:
            raise ValueError(f"max_turns {self.max_turns} needs an env (without one a "
                             "response is one turn)")
        if self.staleness and (self.dynamic_sampling or self.max_turns > 1):
            # Dynamic sampling extends and closes the step the trainer is at, and the tool
            # loop answers that step's calls only: neither follows steps rolled out ahead.
            raise ValueError("staleness > 0 is not supported with dynamic_sampling or "
                             "max_turns > 1 yet")
        if self.max_turns > 1 and self.dynamic_sampling:
            # Closing a dynamic step aborts responses in flight; one waiting for its
            # environment's answer is in neither the leased nor the pending set it walks.
            raise ValueError("dynamic_sampling is not supported with max_turns > 1 yet")

    def _check_lora(self) -> None:
        if self.lora is None:
            return
        if emulated_model(self.model):
            raise ValueError(f"lora needs a real model; {self.model!r} is emulated (no weights)")
        if self.lora.dropout > 0.0:
            # Every log-prob the trainer takes is taken with dropout off (the ratio must
            # compare one function with itself), so LoRA dropout would never apply.
            raise ValueError("lora.dropout must be 0: the trainer scores with dropout off")

    def min_version(self, step: int) -> int:
        """The oldest weight version a token of ``step`` may come from (invariant 2)."""
        return max(0, step - self.staleness)

    @property
    def reward_name(self) -> str:
        """The reward a dataset run is scored with."""
        return self.reward or "math"


_ALGORITHM_FIELDS = ("algorithm", "clip_ratio_low", "clip_ratio_high", "loss_agg", "kl_coef",
                     "kl_estimator", "entropy_coef", "overlong_buffer", "updates_per_step",
                     "minibatches", "dynamic_sampling", "off_policy", "off_policy_cap")


def emulated_model(model: str) -> bool:
    """Whether a run's ``model`` names an emu preset ("emu", "emu-8b", ...): generated by the
    emu engine alone, as no real engine has its weights (placeholders)."""
    return model == "emu" or model.startswith("emu-")


def engine_mismatch(engine: str, model: str) -> str | None:
    """Why an instance whose engine is ``engine`` cannot serve a run of ``model``; None if it
    can. The emu engine's tokens are ids of no real vocabulary (a tiny model's 14 ids among
    them would be chance), and a real engine cannot load an emu preset's placeholders."""
    if (engine == "emu") != emulated_model(model):
        return f"engine {engine[:32]} cannot serve model {model[:200]}"
    return None
