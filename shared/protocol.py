"""The wire protocol: every message that crosses NATS, and the one codec that moves it.

Contract: a message is a ``msgspec.Struct`` declared here and nowhere else; it goes on the wire
with :func:`encode` and comes off with :func:`decode`, which validates types while parsing and
raises :class:`ProtocolError` for anything malformed (the caller counts and drops it). JSON via
msgspec rather than orjson + a separate validator: one pass both parses and type-checks, so a
malformed message can never reach service logic half-validated. Tensors never ride the bus;
only token ids and metadata do. Subjects are built by :mod:`shared.names`.

The run spec (:class:`RunSpec`) is declared here too: it is the body of ``POST /v1/runs``,
what the manager stores, and what :class:`ActiveRun` carries to the trainer, so its field
names, defaults and bounds are written once. Each boundary decodes it with :func:`decode`
(the REST handler included), and past that it is only ever read as typed attributes.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shared.algorithm import AlgorithmConfig
from shared.errors import ProtocolError
from shared.names import INSTANCE_ID_MAX, INSTANCE_ID_PATTERN, REQUEST_ID_PATTERN

InstanceKind = Literal["reserved", "spot"]
InstanceState = Literal["starting", "loading", "ready", "draining"]
FinishReason = Literal["stop", "length"]
# Checked while parsing, so no handler ever sees an id that could collide in a Redis key.
InstanceId = Annotated[str, msgspec.Meta(pattern=INSTANCE_ID_PATTERN, max_length=INSTANCE_ID_MAX)]
RequestId = Annotated[str, msgspec.Meta(pattern=REQUEST_ID_PATTERN, max_length=100)]
Tracker = Literal["tensorboard", "wandb", "mlflow"]


# Entries per frame: an instance batches at most a few hundred responses; a frame past this is
# malformed, so no single message can hold a commit script (and Redis) for long.
FRAME_ENTRIES = 4096
MAC_KEY_MAX = 64  # bytes of a BLAKE2b key (a lease key is 32)
TOKEN_WIDTH = 4  # bytes of one packed token id (FrameEntry.tokens): unsigned, little-endian
if array("I").itemsize != TOKEN_WIDTH:  # every platform CPython supports has a 4-byte int
    raise ImportError(f"array('I') is not {TOKEN_WIDTH} bytes here")
_SWAP = sys.byteorder != "little"  # the wire is little-endian whatever the host is


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """``ids`` as :attr:`FrameEntry.tokens` carries them; an OverflowError for an id outside
    [0, 2^32)."""
    packed = array("I", ids)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """The ids :func:`pack_token_ids` packed; a ValueError if ``data`` is not whole ids."""
    packed = array("I")
    packed.frombytes(data)
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


class Msg(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every bus message; the tag names the type on the wire."""


# --- the run spec (REST body, stored by the manager, carried to the trainer) -----------------
# Every field has a default and a bound; adding a field is one line in RunSpec.


class SeedingSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    mode: Literal["adaptive", "fixed", "off"] = "off"  # how the seeding window is chosen
    window_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 0.0  # fixed (or first) window


Key = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]  # a dataset column
DataPath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
# "math", "exact" or "python:<module>:<function>": the names are checked here, at submit;
# whether the function imports is known only where the trainer's reward path is.
RewardName = Annotated[str, msgspec.Meta(
    pattern=r"^(math|exact|python:[A-Za-z_][\w.]*:[A-Za-z_]\w*)$", max_length=512)]


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


class RunSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Body of ``POST /v1/runs``; every field has a default, unknown fields are rejected."""

    # "tiny" (the embedded model), "tiny-chat" (the embedded text model), an emu preset, or a
    # path to an HF model directory
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] = "tiny"
    task: Literal["arith-seq"] = "arith-seq"
    # The RL objective (shared.algorithm); each knob below left out takes its paper default.
    algorithm: Literal["grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp",
                       "reinforce_pp_baseline", "gspo"] = "grpo"
    # Defaults: the embedded task's tuned run (trainer_svc.selfcheck measures them: 40 steps of
    # 16 x 8 lift the last-5 mean reward 0.21-0.30 above the first-5 on seeds 0-5).
    steps: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 40
    prompts_per_step: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    samples_per_prompt: Annotated[int, msgspec.Meta(ge=1, le=512)] = 8  # group size
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=32768)] = 8
    # AdamW with a 5-step linear warm-up (trainer_svc.selfcheck.grpo.DEFAULT_LEARNING_RATE, tuned there)
    learning_rate: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 6e-4
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=10.0)] = 1.0
    # Sampling and prompts are drawn from it (invariant 5), never from the run id.
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    seeding: SeedingSpec = msgspec.field(default_factory=SeedingSpec)
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
    kl_estimator: Literal["k1", "k2", "k3"] | None = None
    entropy_coef: float | None = None  # entropy bonus weight
    overlong_buffer: int | None = None  # DAPO: tokens before max_new_tokens where a penalty ramps
    updates_per_step: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None  # passes per step
    minibatches: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None  # steps per pass
    dynamic_sampling: bool | None = None  # DAPO: train only on groups whose rewards differ
    # Dynamic sampling's bound on generation (veRL's max_num_gen_batches): a step draws at most
    # this many batches of prompts_per_step prompts; short of informative groups then, it
    # trains on those it has and its record says so (dynamic_sampling_capped).
    max_gen_batches: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 4

    def __post_init__(self) -> None:
        # A ValueError here is a validation error to msgspec's decoder: a bad combination of
        # knobs is a 422 at the REST boundary, like any other bad field.
        self.algorithm_config()
        self._check_data()

    def algorithm_config(self) -> AlgorithmConfig:
        """The objective this run trains with: knobs, paper defaults scaled to the run."""
        cfg = AlgorithmConfig.for_run(
            {name: getattr(self, name) for name in _ALGORITHM_FIELDS},
            max_new_tokens=self.max_new_tokens, groups_per_step=self.prompts_per_step)
        # Only when asked, though DAPO's paper has it: it changes what a step costs (more
        # prompts generated, some responses aborted), which a user should choose knowingly.
        return cfg if self.dynamic_sampling else cfg.with_(dynamic_sampling=False)

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

    @property
    def reward_name(self) -> str:
        """The reward a dataset run is scored with."""
        return self.reward or "math"


_ALGORITHM_FIELDS = ("algorithm", "clip_ratio_low", "clip_ratio_high", "loss_agg", "kl_coef",
                     "kl_estimator", "entropy_coef", "overlong_buffer", "updates_per_step",
                     "minibatches", "dynamic_sampling")


# --- rollout instance <-> manager -------------------------------------------------------------


class Held(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: RequestId  # which response the instance is working on
    epoch: int  # lease epoch (fencing token) it was assigned under
    buffered: int = 0  # tokens generated but not yet published: what a hard loss wastes
    published: int = 0  # response positions published so far (committed once ingested)


class Heartbeat(Msg):
    instance_id: InstanceId  # stable name of the instance; must equal its subject's last token
    kind: InstanceKind  # reserved machines seed; spot ones come and go
    engine: str  # torch | sglang | emu
    state: InstanceState  # only "ready" instances get work
    run_id: str | None = None  # weight namespace of the loaded version
    weight_version: int | None = None  # version currently loaded in the engine
    held: list[Held] = []  # responses in flight; their leases are renewed by this beat
    capacity: int = 1  # responses it can generate concurrently
    pid: int = 0  # for operators and fault tests
    metrics_port: int = 0  # where the instance serves /metrics (0 = not served)
    # Random per process start: a beat that was in flight when this process released its
    # work must not re-register it, while a restart under the same id must be let in.
    session: str = ""


class Target(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run_id: str  # weight namespace
    weight_version: int  # the version the current step must be generated with


class HeartbeatReply(Msg):
    target: Target | None = None  # the version to load now, if any
    revoke: list[str] = []  # request ids the instance must stop generating (lease lost)


class Assignment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str  # "{run}:{step}:{prompt}:{sample}"
    run_id: str
    step: int
    prompt_index: int
    sample_index: int
    weight_version: int  # must equal the instance's loaded version
    epoch: int  # fencing token to stamp on every frame entry
    # hex HMAC key of this lease (request, epoch): only its holder reads it, on its own subject,
    # and every frame entry it sends carries a MAC under it (entry_mac), so none can be forged
    lease_key: str = ""
    prompt_token_ids: list[int]
    committed_token_ids: list[int]  # tokens already committed: resume after them (migration)
    max_new_tokens: int  # total response budget, committed tokens included
    temperature: float
    seed: int  # run seed; sampling is keyed by (seed, step, prompt, sample, position)
    eos_token_id: int


class Assign(Msg):
    items: list[Assignment]


class Revoke(Msg):
    """Stop generating these now (load balancing moved them); their leases are already gone.
    With ``flush`` (the seeding hand-off) the leases still hold: publish what is buffered for
    them first, then hand them back with a Release (reason ``handoff``)."""

    request_ids: list[str]
    flush: bool = False




class Release(Msg):
    instance_id: InstanceId  # must equal its subject's last token
    held: list[Held]  # responses handed back (preemption notice or clean exit)
    leaving: bool = True  # the instance deregisters after this
    reason: Literal["preempt", "shutdown", "abort", "handoff"] = "shutdown"
    session: str = ""  # the leaving process's Heartbeat.session


class FrameEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The new tokens of one response in a :class:`TokenFrame`.

    The ids travel packed (:func:`pack_token_ids`: unsigned 32-bit little-endian, base64 in
    the JSON), not as a JSON array: the manager decodes every entry of every frame, and an
    array of ids cost it a Python int per token (5.9 of its ~10.8 us an entry at 64 tokens),
    where the packed bytes decode in ~0.9 us. An id below 0 or past 2^32 cannot be sent at
    all; one outside the run's vocabulary, or bytes that are not whole ids, are dropped by
    the manager alone (:func:`manager_svc.chunk_auth.invalid`)."""

    # Not pattern-checked while decoding (that was ~0.5 us of the manager's every entry): the
    # entry's MAC is, under a key derived from this id, and the manager hands out keys of the
    # ids it leased alone, so an entry that passes it names one of those.
    request_id: Annotated[str, msgspec.Meta(max_length=100)]
    epoch: int  # rejected unless equal to the current lease epoch
    weight_version: int  # rejected unless equal to the step's version
    offset: int  # position of the first token in the response; must be the next uncommitted one
    tokens: bytes  # the new ids, pack_token_ids
    final: bool = False  # the response ends with this entry
    finish_reason: FinishReason | None = None
    mac: str = ""  # entry_mac under the lease key of its Assignment; checked before any commit

    @classmethod
    def of(cls, *, request_id: str, epoch: int, weight_version: int, offset: int,
           token_ids: Sequence[int], final: bool = False,
           finish_reason: FinishReason | None = None) -> FrameEntry:
        """An entry of these ids (unsigned 32-bit each), with no MAC yet (:func:`entry_mac`)."""
        return cls(request_id=request_id, epoch=epoch, weight_version=weight_version,
                   offset=offset, tokens=pack_token_ids(token_ids), final=final,
                   finish_reason=finish_reason)

    @property
    def whole(self) -> bool:
        """Whether ``tokens`` is a whole number of ids (anything else is never committed)."""
        return not len(self.tokens) % TOKEN_WIDTH

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // TOKEN_WIDTH

    @property
    def token_ids(self) -> list[int]:
        """The ids ``tokens`` packs (a ValueError if it is not :attr:`whole`)."""
        return unpack_token_ids(self.tokens)


class TokenFrame(Msg):
    """One flush of a rollout instance: the new tokens of all its responses, one entry each.

    One message and one commit script per flush rather than per response: the per-message
    costs (publish, ack, decode, script call) were the manager's ceiling. Each entry keeps its
    own MAC under its own lease's key (a frame mixes leases, and a per-frame MAC would need a
    per-instance key the manager does not have), so a frame authenticates exactly as strongly
    as one message per response did; the manager drops a bad entry, not its frame."""

    instance_id: InstanceId  # must equal the last token of the subject it was published on
    entries: Annotated[list[FrameEntry], msgspec.Meta(min_length=1, max_length=FRAME_ENTRIES)]
    kind: InstanceKind = "spot"  # who generated it: the seeding controller measures both sides


# --- trainer <-> manager ----------------------------------------------------------------------


class TrainerPoll(Msg):
    trainer_id: str


class ActiveRun(Msg):
    run_id: str | None = None  # None: nothing to do
    spec: RunSpec | None = None  # the run's spec; None with run_id
    step: int = 0  # next step to run (== weight version it uses)
    state: str = "queued"


class StepStart(Msg):
    run_id: str
    step: int
    weight_version: int
    prompt_token_ids: list[list[int]]  # one per prompt; each is sampled samples_per_prompt times
    eos_token_id: int
    vocab_size: int = 0  # token ids >= this are dropped at ingest (0: not checked)


class Sample(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str
    prompt_index: int
    sample_index: int
    weight_version: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    finish_reason: str
    instances: list[str]  # instances that contributed tokens, in order
    reward: float | None = None  # filled in from the trainer's step report
    # Filled in from the report too, where the model has a tokenizer:
    prompt: str | None = None  # the dataset's prompt string, before any template
    prompt_text: str | None = None  # as fed to the model, template applied
    response_text: str | None = None  # decoded, special tokens skipped: what the reward saw
    answer: str | None = None  # the dataset's answer


class Digest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    responses: int
    tokens: int
    sha256: str


class GroupDone(Msg):
    run_id: str
    step: int
    prompt_index: int
    samples: list[Sample] = []  # empty when they would not fit in one message


# Replies and events stay under this many encoded bytes: NATS refuses messages over its
# max_payload, 1 MB by default, and a step can hold far more samples than that.
MESSAGE_BUDGET = 768 * 1024


class StepExtend(Msg):
    """Dynamic sampling: add prompts ``first_index ..`` to a step that is short of informative
    groups. Applied once: a retry (same ``first_index``) after it was applied is acknowledged."""

    run_id: str
    step: int
    first_index: int  # the step's prompt count before this extension
    prompt_token_ids: list[list[int]]  # each sampled samples_per_prompt times, like StepStart's


class StepClose(Msg):
    """Dynamic sampling: the step trains on exactly the groups ``keep``. Every other response of
    the step leaves it (in flight: aborted); then the barrier. Applied once, like StepExtend."""

    run_id: str
    step: int
    keep: list[int]  # prompt indices of the groups trained on (complete, rewards not all equal)
    filtered: list[int] = []  # complete groups dropped because their rewards are all equal
    capped: bool = False  # max_gen_batches was reached short of prompts_per_step kept groups


class StepSamplesQuery(Msg):
    run_id: str
    step: int
    # Paged: a step can hold more samples than one NATS message (1 MB by default) carries, and
    # a status poll needs none of them. Samples are in request-id order.
    offset: int = 0
    limit: int = 0  # at most this many samples in the reply (0: status only)


class StepSamples(Msg):
    run_id: str
    step: int
    complete: bool  # True once the barrier for the step has been reached
    train_now: bool = True  # the reserved side has stopped generating: training may start
    samples: list[Sample] = []  # completed samples [offset, offset + limit) of the query
    done: int = 0  # completed samples so far
    digest: Digest | None = None
    prompts: int = 0  # prompts in the step so far (dynamic sampling extends it)
    groups_done: list[int] = []  # complete groups (dynamic sampling only, before the barrier)


class Handoff(Msg):
    """The seeding window of a step is over: the reserved side switches to training."""

    run_id: str
    step: int


class Barrier(Msg):
    run_id: str
    step: int
    digest: Digest


class SampleReward(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt_index: int
    sample_index: int
    reward: float
    response_text: str | None = None  # decoded response (None: the model has no tokenizer)


class PromptText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One prompt of a step as text: sent once per prompt, not once per sample."""

    prompt_index: int
    prompt: str  # the dataset's string (the built-in task: its decoded tokens)
    prompt_text: str  # as fed to the model
    answer: str | None = None


class StepFinish(Msg):
    run_id: str
    step: int
    new_version: int  # version published after the optimizer step
    digest: Digest  # what the trainer trained on; must equal the barrier's
    rewards: list[SampleReward]
    loss: float
    train_s: float
    trainer_idle_s: float = 0.0
    publish_s: float = 0.0  # of train_s: writing the new version (and checkpoint), uploading it
    checkpoints: list[int] = []  # versions kept for the user after this step (save_every)
    stats: dict[str, float] = {}  # training statistics, names from STEP_STATS
    prompts: list[PromptText] = []  # the step's prompts as text, where there is a tokenizer
    reward_errors: int = 0  # reward calls that raised or timed out (each scored 0)
    eval_reward_mean: float | None = None  # held-out prompts at this step's version, if due
    eval_responses: int = 0  # how many held-out responses that mean is over


# What a StepFinish's stats may hold; the manager copies these, and only these, into the step
# record (trainer_svc.learn.algorithms.stats says what each means).
STEP_STATS = frozenset({
    "kl", "entropy", "clip_fraction", "grad_norm", "advantage_mean", "advantage_std",
    "response_len_mean", "response_len_max", "truncated_fraction", "streamed_fraction",
    "optimizer_steps", "peak_memory_bytes", "tokens_per_s_train",
})


class StepRecordQuery(Msg):
    run_id: str
    step: int


class StepRecord(Msg):
    """A finished step's record, as ``GET /v1/runs/{id}/steps`` serves it (None: not yet)."""

    run_id: str
    step: int
    record: dict[str, Any] | None = None


class RunWarning(Msg):
    """Something the run goes on without (a tracker that did not start), shown to the user."""

    run_id: str
    warning: str


class RunFailed(Msg):
    run_id: str
    error: str


class Ack(Msg):
    ok: bool = True
    detail: str = ""
    retryable: bool = False  # the request may succeed if sent again (e.g. Redis restarting)


class WeightsAnnounce(Msg):
    run_id: str
    weight_version: int


# --- codec -----------------------------------------------------------------------------------

T = TypeVar("T")
_encoder = msgspec.json.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, kind: type[T]) -> T:
    """Parse and validate ``data`` as ``kind``; anything else is a :class:`ProtocolError`."""
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError(kind.__name__, str(exc)) from exc


def decode_command(data: bytes) -> Assign | Revoke:
    """What arrives on an instance's own subject: new work, or work taken away."""
    try:
        return msgspec.json.decode(data, type=Assign | Revoke)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError("instance command", str(exc)) from exc


def entry_mac(lease_key: str, instance_id: str, entry: FrameEntry) -> str:
    """Keyed BLAKE2b-256 under the lease key (hex) over everything a commit of ``entry``
    depends on (the sending instance included), canonically encoded: its other fields as a
    JSON array (field order fixed, no whitespace), then the packed ids as they travel (the
    array ends where they begin, so no two entries share a body). Knowing a request id and
    epoch is not enough to produce it: the key is derived from a secret of the manager's."""
    try:
        key = bytes.fromhex(lease_key)
    except ValueError:
        key = b""
    return entry_digest(key if len(key) <= MAC_KEY_MAX else b"", instance_id, entry).hex()


def entry_digest(key: bytes, instance_id: str, entry: FrameEntry) -> bytes:
    """:func:`entry_mac` as raw bytes under a raw key (at most MAC_KEY_MAX bytes). The manager
    checks every entry of every frame: BLAKE2b in its keyed mode (a MAC by design, no inner
    and outer hash) took 1.0 us over a 64-token entry where HMAC-SHA256 took 2.0."""
    head = _encoder.encode([entry.request_id, instance_id, entry.epoch, entry.weight_version,
                            entry.offset, entry.final, entry.finish_reason])
    return hashlib.blake2b(head + entry.tokens, key=key, digest_size=32).digest()


# One response's part of a Digest: (prompt index, sample index, SHA-256 of the response's row,
# its token count). Kept by the manager for each response a completed group announced, so the
# barrier hashes those without reading them back (a done response never changes).
RowDigest = tuple[int, int, bytes, int]


def sample_digest(samples: list[Sample]) -> Digest:
    """Digest of a step's training data: order-independent, over ids and tokens only.

    Both the manager (at the barrier) and the trainer (over what it trained on) compute it in
    this one format, so equality means the same responses, each once, with the same tokens.
    """
    return csv_digest([(s.prompt_index, s.sample_index, s.weight_version,
                        token_csv(s.prompt_token_ids), token_csv(s.response_token_ids))
                       for s in samples])


def token_json(ids: list[int]) -> bytes:
    """Token ids as a JSON array, "[1,2,3]": around what Redis stores (:func:`token_csv`);
    the manager encodes each entry's ids once, and splices the array's inside into its commit."""
    return _encoder.encode(ids)


def token_csv(ids: list[int]) -> str:
    """Token ids as Redis stores them, "1,2,3": msgspec prints the list as JSON, ~13x faster
    than a join over str() (the manager does this for every entry it commits)."""
    return _encoder.encode(ids)[1:-1].decode()


def csv_digest(rows: list[tuple[int, int, int, str, str]]) -> Digest:
    """:func:`sample_digest` of (prompt index, sample index, weight version, prompt tokens,
    response tokens) rows whose tokens are comma-separated text, as Redis stores them."""
    return rows_digest([row_digest(*row) for row in rows])


def row_digest(p: int, s: int, version: int, prompt: str, response: str) -> RowDigest:
    """One row of :func:`csv_digest`: its hash covers the ids, the version and every token."""
    body = f"{p}:{s}:{version}|{prompt}|{response};".encode()
    tokens = response.count(",") + 1 if response else 0
    return p, s, hashlib.sha256(body).digest(), tokens


def rows_digest(rows: list[RowDigest]) -> Digest:
    """The digest of a step from its rows' parts, whatever their order: the hash of their
    hashes in (prompt, sample) order, and the totals."""
    h = hashlib.sha256()
    for _, _, row_hash, _ in sorted(rows, key=lambda r: (r[0], r[1])):
        h.update(row_hash)
    return Digest(responses=len(rows), tokens=sum(r[3] for r in rows), sha256=h.hexdigest())
