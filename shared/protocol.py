"""The wire protocol: every message that crosses NATS, and the one codec that moves it.

Contract: a message is a ``msgspec.Struct`` declared here and nowhere else; it goes on the wire
with :func:`encode` and comes off with :func:`decode`, which validates types while parsing and
raises :class:`ProtocolError` for anything malformed (the caller counts and drops it). JSON via
msgspec rather than orjson + a separate validator: one pass both parses and type-checks, so a
malformed message can never reach service logic half-validated. Tensors never ride the bus;
only token ids and metadata do. Subjects are built by :mod:`shared.names`.

Wire messages only: the run spec they carry is :mod:`shared.spec`'s, a frame entry's MAC is
:mod:`shared.mac`'s and a step's digest :mod:`shared.digest`'s.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from shared.errors import ProtocolError
from shared.names import INSTANCE_ID_MAX, INSTANCE_ID_PATTERN, REQUEST_ID_PATTERN
from shared.spec import MAX_TURNS, RunSpec
from shared.turns import Turn

# The version of this module's messages. An instance speaking another one is refused at its
# first heartbeat with both versions named (:class:`Refused`), not dropped beat by beat as
# malformed. Raise it with any change an older peer cannot decode.
PROTOCOL_VERSION = 2  # 2: frame entries carry behaviour log-probs

InstanceKind = Literal["reserved", "spot"]
InstanceState = Literal["starting", "loading", "ready", "draining"]
FinishReason = Literal["stop", "length"]
# Checked while parsing, so no handler ever sees an id that could collide in a Redis key.
InstanceId = Annotated[str, msgspec.Meta(pattern=INSTANCE_ID_PATTERN, max_length=INSTANCE_ID_MAX)]
RequestId = Annotated[str, msgspec.Meta(pattern=REQUEST_ID_PATTERN, max_length=100)]
# Bounds of what an instance sends, checked while parsing: a field past one is malformed, so no
# handler, Redis key or Lua script sees an oversized value from a hostile or broken instance.
HELD_MAX = 4096  # responses one instance holds at once (its capacity's bound too)
Short = Annotated[str, msgspec.Meta(max_length=64)]  # engine, run id, session, ...
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # epochs, token counts, versions


# Entries per frame: an instance batches at most a few hundred responses; a frame past this is
# malformed, so no single message can hold a commit script (and Redis) for long.
FRAME_ENTRIES = 4096
TOKEN_WIDTH = 4  # bytes of one packed token id (FrameEntry.tokens): unsigned, little-endian
if array("I").itemsize != TOKEN_WIDTH:  # every platform CPython supports has a 4-byte int
    raise ImportError(f"array('I') is not {TOKEN_WIDTH} bytes here")
_SWAP = sys.byteorder != "little"  # the wire is little-endian whatever the host is


def _pack(typecode: str, values: Sequence[Any]) -> bytes:
    packed = array(typecode, values)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes) -> list[Any]:
    packed = array(typecode)
    packed.frombytes(data)  # a ValueError if data is not whole items
    if _SWAP:
        packed.byteswap()
    return packed.tolist()


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """``ids`` as :attr:`FrameEntry.tokens` carries them; an OverflowError for an id outside
    [0, 2^32)."""
    return _pack("I", ids)


def unpack_token_ids(data: bytes) -> list[int]:
    """The ids :func:`pack_token_ids` packed; a ValueError if ``data`` is not whole ids."""
    return _unpack("I", data)


def pack_logprobs(values: Sequence[float]) -> bytes:
    """Behaviour log-probs as :attr:`FrameEntry.logprobs` carries them: float32, little-endian,
    one per token (float32 is what engines compute them in; the trainer's ratio needs no
    more)."""
    return _pack("f", values)


def unpack_logprobs(data: bytes) -> list[float]:
    """The values :func:`pack_logprobs` packed; a ValueError if ``data`` is not whole floats."""
    return _unpack("f", data)


class Msg(msgspec.Struct, tag=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every bus message; the tag names the type on the wire."""


# --- rollout instance <-> manager -------------------------------------------------------------


class Held(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: RequestId  # which response the instance is working on
    epoch: Count  # lease epoch (fencing token) it was assigned under
    buffered: Count = 0  # tokens generated but not yet published: what a hard loss wastes
    published: Count = 0  # response positions published so far (committed once ingested)


class Heartbeat(Msg):
    instance_id: InstanceId  # stable name of the instance; must equal its subject's last token
    kind: InstanceKind  # reserved machines seed; spot ones come and go
    engine: Short  # torch | sglang | emu
    state: InstanceState  # only "ready" instances get work
    run_id: Short | None = None  # weight namespace of the loaded version
    weight_version: Count | None = None  # version currently loaded in the engine
    # responses in flight; their leases are renewed by this beat
    held: Annotated[list[Held], msgspec.Meta(max_length=HELD_MAX)] = []
    capacity: Annotated[int, msgspec.Meta(ge=1, le=HELD_MAX)] = 1  # generated concurrently
    pid: Count = 0  # for operators and fault tests
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0  # its /metrics (0 = none)
    # Random per process start: a beat that was in flight when this process released its
    # work must not re-register it, while a restart under the same id must be let in.
    session: Short = ""
    protocol: Count = PROTOCOL_VERSION  # the sender's PROTOCOL_VERSION (absent: 0, before it)
    decode_steps: Count = 0  # the engine's completed decode steps (monotonic; 0 = unknown)


class Target(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    run_id: str  # weight namespace
    weight_version: int  # the version the current step must be generated with


class HeartbeatReply(Msg):
    target: Target | None = None  # the version to load now, if any
    revoke: list[str] = []  # request ids the instance must stop generating (lease lost)


class Refused(Msg):
    """The answer to a heartbeat in another protocol version: the instance must not serve.
    Tagged and tiny, so that any version reads it (:func:`decode_beat_reply`)."""

    detail: str  # why, both versions named
    protocol: int = PROTOCOL_VERSION  # the manager's version


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
    # responses handed back (preemption notice or clean exit)
    held: Annotated[list[Held], msgspec.Meta(max_length=HELD_MAX)]
    leaving: bool = True  # the instance deregisters after this
    # update: an asynchronous run's instance hands its responses back to load newer weights
    reason: Literal["preempt", "shutdown", "abort", "handoff", "update"] = "shutdown"
    session: Short = ""  # the leaving process's Heartbeat.session


class FrameEntry(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The new tokens of one response in a :class:`TokenFrame`.

    The ids travel packed (:func:`pack_token_ids`: unsigned 32-bit little-endian, base64 in
    the JSON), not as a JSON array: the manager decodes every entry of every frame, and an
    array costs it a Python int per token where packed bytes decode whole. An id below 0 or
    past 2^32 cannot be sent at all; one outside the run's vocabulary, or bytes that are not
    whole ids, are dropped by the manager alone (:func:`manager_svc.chunk_auth.invalid`)."""

    # Not pattern-checked while decoding (every entry would pay for it): the entry's MAC is,
    # under a key derived from this id, and the manager hands out keys of the ids it leased
    # alone, so an entry that passes it names one of those.
    request_id: Annotated[str, msgspec.Meta(max_length=100)]
    epoch: int  # rejected unless equal to the current lease epoch
    weight_version: int  # rejected unless equal to the step's version
    offset: int  # position of the first token in the response; must be the next uncommitted one
    # the new ids, pack_token_ids; at most a 256k-token flush, far past any max_new_tokens
    tokens: Annotated[bytes, msgspec.Meta(max_length=TOKEN_WIDTH << 18)]
    final: bool = False  # the response ends with this entry
    finish_reason: FinishReason | None = None
    # entry_mac under the lease key of its Assignment; checked before any commit
    mac: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # Each new token's behaviour log-prob (pack_logprobs: one float32 per token), as the
    # engine sampled it; empty where the engine gives none. Committed with the tokens.
    logprobs: Annotated[bytes, msgspec.Meta(max_length=TOKEN_WIDTH << 18)] = b""

    @classmethod
    def of(cls, *, request_id: str, epoch: int, weight_version: int, offset: int,
           token_ids: Sequence[int], final: bool = False,
           finish_reason: FinishReason | None = None,
           logprobs: Sequence[float] = ()) -> FrameEntry:
        """An entry of these ids (unsigned 32-bit each), with no MAC yet (:func:`entry_mac`)."""
        return cls(request_id=request_id, epoch=epoch, weight_version=weight_version,
                   offset=offset, tokens=pack_token_ids(token_ids), final=final,
                   finish_reason=finish_reason, logprobs=pack_logprobs(logprobs))

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

    @property
    def logprob_values(self) -> list[float]:
        """The log-probs ``logprobs`` packs (a ValueError if it is not whole floats)."""
        return unpack_logprobs(self.logprobs)


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
    # Multi-turn (shared.turns): the response's turns, and the loss mask they give (1: a model
    # token, trained; 0: an observation token). Empty: one model turn, every token trained.
    turns: list[Turn] = []
    loss_mask: list[int] = []
    # Each response token's behaviour log-prob, as the engine that sampled it reported it (an
    # observation token: 0.0). Empty where any token's is unknown (an engine that gives none).
    behaviour_logprobs: list[float] = []
    # An asynchronous run's response (spec staleness > 0): [first token, weight version] per
    # run of tokens one version made, in order; empty: weight_version made every token.
    token_versions: list[list[int]] = []
    # An agentic response's environment's own reward, where its environment gave one: the
    # trainer scores the response with it rather than the run's reward function.
    env_reward: float | None = None


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
    "optimizer_steps", "peak_memory_bytes", "tokens_per_s_train", "trained_tokens",
    "off_policy_weight", "off_policy_capped_fraction", "behaviour_log_ratio_abs",
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


# --- manager <-> tool pool (agentic runs; docs/agentic.md) ------------------------------------


class ToolCall(Msg):
    """A model turn of ``request_id`` ended: its environment is asked for the answer. Carries
    the response's committed ids, so the tool pool (on the reserved side, with the run's
    tokenizer) decodes the action without reading the manager's state."""

    request_id: RequestId
    turn: Count  # the model turn answered, 0-based
    call_id: Annotated[str, msgspec.Meta(max_length=120)]  # shared.names.call_id
    response_token_ids: list[int]  # everything after the prompt so far, the turn's end included
    action_start: Count  # where the turn's own ids begin in response_token_ids
    # The committed turns before this one (model and observation turns, as samples carry
    # them): what a tool worker that lost the episode's environment hands its ``restore``.
    history: Annotated[list[Turn], msgspec.Meta(max_length=2 * MAX_TURNS)] = []


class ToolClaim(Msg):
    """The tool pool asks for up to ``limit`` of a step's awaited calls, each held for
    ``claim_s`` (then handed out again, should no answer come)."""

    run_id: Short
    step: Count
    limit: Annotated[int, msgspec.Meta(ge=1, le=256)] = 32
    claim_s: Annotated[float, msgspec.Meta(ge=0.1, le=3600.0)] = 30.0


class ToolCalls(Msg):
    calls: list[ToolCall] = msgspec.field(default_factory=list)


class ToolResult(Msg):
    """The environment's answer to one model turn: the observation's ids (rendered by the run's
    chat template and tokenized once, on the tool pool), or the end of the response."""

    request_id: RequestId
    turn: Count
    call_id: Annotated[str, msgspec.Meta(max_length=120)]
    observation_token_ids: list[int] = msgspec.field(default_factory=list)
    observation: Annotated[str, msgspec.Meta(max_length=65536)] = ""
    done: bool = False  # the environment ended the response: no observation is appended
    reward: float | None = None  # the environment's own reward, if it gives one


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


class _Versioned(msgspec.Struct):
    """What any version of a heartbeat or its reply carries, read leniently (unknown fields
    and the tag ignored): its type and its protocol version, 0 where it predates them."""

    type: str = ""
    protocol: int = 0
    detail: str = ""
    instance_id: str = ""


def peek_version(data: bytes) -> int | None:
    """The protocol version a heartbeat declares (0: none), read before any strict decode;
    None if it is no heartbeat of any version (not an object naming its instance)."""
    try:
        peek = msgspec.json.decode(data, type=_Versioned)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return peek.protocol if peek.instance_id else None


def decode_beat_reply(data: bytes) -> HeartbeatReply | Refused:
    """A heartbeat's answer; a refusal is read leniently, so a manager of any later version
    can still say why it refuses this instance."""
    try:
        peek = msgspec.json.decode(data, type=_Versioned)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError("HeartbeatReply", str(exc)) from exc
    if peek.type == "Refused":
        return Refused(detail=peek.detail, protocol=peek.protocol)
    return decode(data, HeartbeatReply)


def decode_command(data: bytes) -> Assign | Revoke:
    """What arrives on an instance's own subject: new work, or work taken away."""
    try:
        return msgspec.json.decode(data, type=Assign | Revoke)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ProtocolError("instance command", str(exc)) from exc
