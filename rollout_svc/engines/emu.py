"""An emulated GPU engine: a latency model and tokens that are a pure function of the request.

EMULATION. Nothing here runs a model; any figure made with it must say so. It exists so scale,
fault and scheduling experiments (hundreds of instances, preemptions at any token) run on one
CPU machine, with an exact oracle: ``expected_tokens(req)`` is the response a fault-free run
produces, and a response resumed from any committed prefix, on any engine instance, in any
batch, continues with exactly those tokens.

Contract (see ``rollout_svc.engines.base``): token ids in, ``TokenEvent``s out; the engine knows
nothing about NATS; it's purely token id sequences.

* Token at position ``pos``: ``int(u * 1e9 + weight_version * 7919) % (vocab_size - 3) + 3``
  with ``u = uniform(seed, step, prompt, sample, pos)`` (ids 0..2 stay free for pad/bos/eos),
  nudged off ``eos_token_id`` so EOS only ever appears where the length model puts it.
* Behaviour log-prob of the token at ``pos``: ``log1p(-v)`` with ``v`` a 53-bit blake2b draw
  keyed by (seed, step, prompt, sample, pos, token, weight_version) (:meth:`EmuEngine.logprob_at`):
  a pure function of the request, the position and the token, so it is the same in every
  process and on every instance a response migrates to, and it changes with the weights as a
  real behaviour policy's does. Distributed as ``-Exp(1)`` (mean -1 nat, finite: at least
  ``log(2**-53)``, about -36.7; 0.0 only for ``v = 0``, a token that was certain). It does not
  depend on the temperature, as emu tokens do not: it is a stand-in, not a softmax.
* Length: lognormal (long-tailed, like reasoning RL: most responses short, a few run into the
  budget), keyed by ``uniform(seed, step, prompt, sample, -1 - weight_version)`` so it never
  shares a draw with a token and changes with the weights. A length L within the budget ends
  with EOS at position L - 1 (``"stop"``); a longer one is cut at ``max_new_tokens``
  (``"length"``).
* Turns (agentic runs): an emu observation ends with :data:`TURN_MARK` (an id no content
  token takes), so the model turn after it starts right after its last occurrence among the
  committed ids. Each model turn has a length of its own, keyed as above with the turn's start
  folded into the version coordinate (0 for the first turn: single-turn lengths are
  unchanged), and ends in EOS at its start + length - 1; so a turn's tokens and end are a pure
  function of the request and the turn's start, wherever the response moved.
* Time: each ``step()`` sleeps ``time_scale * (decode_s_base + decode_s_per_seq * batch)`` plus
  the prefill of requests that joined in it (continuous batching: they join at any step). With
  ``true_context`` a sequence's KV read is charged at its own context (prompt + modelled
  position) instead of the preset's constant :data:`~rollout_svc.engines.emu_models.CONTEXT_TOKENS`,
  as :func:`sim.engine.step_seconds` charges it in the paper regime.
* Token scale (``token_scale`` m > 1): every emitted token stands for m modelled tokens, so a
  reasoning-length response (thousands of decode steps) costs the control plane a few dozen
  tokens. The length model draws the modelled length L (its mean m times the budget's share, the
  budget m times ``max_new_tokens``); the response has ceil(L / m) tokens and ends where L ends.
  A ``step()`` runs up to m modelled decode steps, fewer when a running response's modelled end
  comes first, so a slot frees at the decode step it would on the modelled GPU; each response
  emits a token whenever its modelled progress passes a multiple of m (or its end). What a
  resumed response re-prefills, and its context, count m modelled tokens per committed token.
* Host time: what a busy engine's steps take beyond those sleeps (its service's loop, and
  waiting for a core when many processes share few) is measured and logged every
  ``HOST_LOG_STEPS`` busy steps, in emulated ms (:class:`~rollout_svc.engines.emu_meters.
  HostMeter`): how far the emulation runs behind its own model. So is how long a slot that
  frees with no work waiting stays empty until the next request comes (``RefillMeter``): the
  control plane's round trip as a GPU would see it. ``make bench-sim-check`` charges both.
* Faults (tests only): ``stall_after_s`` seconds after its first decode step the engine stops
  producing tokens for good (a hung GPU: its steps return nothing and ``decode_steps`` stops,
  while its process goes on heartbeating); ``slow_after_s`` seconds after it, every modelled
  step takes ``slow_factor`` times as long (an overloaded host).
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from rollout_svc.engines.base import (
    EngineError,
    GenRequest,
    Inbox,
    TokenEvent,
    check_request,
    queue_or_close,
)
from rollout_svc.engines.emu_meters import HostMeter, RefillMeter
from rollout_svc.engines.emu_models import CONTEXT_TOKENS, response_length
from shared.protocol import FinishReason
from shared.sampling import uniform
from shared.turns import EMU_FIRST_TOKEN, EMU_TURN_MARK

log = logging.getLogger("rollout.emu")

_FIRST_TOKEN = EMU_FIRST_TOKEN  # ids below this are reserved (pad/bos/eos in most vocabularies)
# The last id of every emu observation (trainer_svc.agentic.EmuTurns): below _FIRST_TOKEN, so no
# sampled token is ever taken for it.
TURN_MARK = EMU_TURN_MARK
# A model turn's start is folded into its length key's version coordinate this far up, far past
# any weight version, so no two turns of a response (nor two versions) share a length draw.
_TURN_KEY = 1 << 24

# Latency model. ASSUMPTION, not measurement: an 8B dense model in bf16 served by SGLang on
# one H100 (3.35 TB/s HBM, ~990 dense bf16 TFLOP/s: shared.hardware), reasoning-length
# contexts of a few thousand tokens. Replace with numbers measured on the target hardware
# before quoting them.
#
# Decode floor per step: reading 16 GB of weights at ~3.35 TB/s is ~5 ms; with kernel launch
# and scheduler overhead SGLang sits near 10 ms at batch 1.
DECODE_S_BASE = 0.010
# Each running sequence adds its KV-cache reads: Llama-3-8B keeps 128 KiB/token (GQA, bf16),
# so ~4k tokens of context is ~0.5 GB/step, ~0.15 ms at full bandwidth; ~0.3 ms with the
# attention kernel's real efficiency. Batch 64 then costs ~30 ms/step, the figure commonly
# quoted for an 8B model at moderate batch on an H100.
DECODE_S_PER_SEQ = 0.0003
# Prefill is compute-bound: 2 * 8e9 FLOP/token at ~50 % of 990 TFLOP/s is ~32 us/token
# (~30k tokens/s), charged for prompt + committed tokens when a request joins.
PREFILL_S_PER_TOKEN = 3.0e-5
# In-place weight update (SGLang update_weights_from_disk) of a 16 GB checkpoint that is
# already on local disk or in page cache: a few GB/s into HBM. Pulling it over the network is
# the weight service's cost, not this one.
LOAD_S = 4.0
# Length model: mean response = MEAN_LEN_FRAC * max_new_tokens unless ``mean_len`` is given;
# sigma 1.0 puts the median at ~0.6 of the mean and ~3 % of responses into the budget at the
# default fraction, the long tail that makes rollout stragglers (RLBoost section 2).
MEAN_LEN_FRAC = 0.25
LEN_SIGMA = 1.0


# The log-prob draw's key and its hash's personalisation, so it shares no digest with
# shared.sampling.uniform's token and length draws.
_LOGPROB_KEY = struct.Struct("<qqqqqqq")
_LOGPROB_PERSON = b"rlboost-emu-lp"

# How long a hung engine's step() waits before it returns nothing: the service's loop calls it
# again at once while work is queued, and this keeps that loop from spinning a core.
STALL_POLL_S = 0.05


@dataclass(slots=True)
class _Active:
    req: GenRequest
    position: int  # next response position to emit
    length: int  # response length the length model gives this request (EOS included)
    progress: int  # modelled tokens generated (token_scale per emitted token)
    end: int  # modelled position where the current turn, or the budget, ends


class EmuEngine:
    name = "emu"

    def __init__(
        self,
        time_scale: float = 1.0,
        prefill_s_per_token: float = PREFILL_S_PER_TOKEN,
        decode_s_base: float = DECODE_S_BASE,
        decode_s_per_seq: float = DECODE_S_PER_SEQ,
        max_batch: int = 64,
        vocab_size: int = 32000,
        mean_len: float | None = None,
        max_len_cap: int | None = None,
        len_sigma: float = LEN_SIGMA,
        load_s: float = LOAD_S,
        stall_after_s: float | None = None,
        slow_after_s: float | None = None,
        slow_factor: float = 1.0,
        true_context: bool = False,
        token_scale: int = 1,
    ) -> None:
        if time_scale < 0 or max_batch < 1 or vocab_size <= _FIRST_TOKEN + 1 or len_sigma <= 0 \
                or token_scale < 1:
            raise EngineError("bad emu engine options")
        self.time_scale = time_scale
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_base = decode_s_base
        self.decode_s_per_seq = decode_s_per_seq
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.mean_len = mean_len  # None: MEAN_LEN_FRAC of each request's budget
        self.max_len_cap = max_len_cap  # a natural length never exceeds this (ends in EOS)
        self.len_sigma = len_sigma
        self.load_s = load_s
        self.stall_after_s = stall_after_s
        self.slow_after_s = slow_after_s
        self.slow_factor = slow_factor
        self.true_context = true_context
        self.token_scale = token_scale
        self.decode_steps = 0  # completed decode steps: the heartbeat's sign of life
        self.modelled_s = 0.0  # modelled GPU seconds of every step so far (unscaled)
        self._serving_since: float | None = None  # monotonic time of the first decode step
        self._interrupt = threading.Event()  # set by drain(): a slowed step ends at once
        # Set by add() and abort(): a token-scaled step may end early to take work in.
        self._arrived = threading.Event()
        self._loaded: tuple[str, int] | None = None
        self._inbox = Inbox()
        self._queue: deque[GenRequest] = deque()  # waiting for a free batch slot
        self._active: dict[str, _Active] = {}
        self._stepping = threading.Lock()
        self.host = HostMeter(time_scale)
        self.refill = RefillMeter(time_scale)

    # -- the pure functions (the oracle) ------------------------------------------------------

    def token_at(self, req: GenRequest, position: int) -> int:
        """The content token at ``position``; never ``req.eos_token_id``."""
        u = uniform(req.seed, req.step, req.prompt_index, req.sample_index, position)
        span = self.vocab_size - _FIRST_TOKEN
        token = int(u * 1e9 + req.weight_version * 7919) % span + _FIRST_TOKEN
        if token == req.eos_token_id:
            token = (token - _FIRST_TOKEN + 1) % span + _FIRST_TOKEN
        return token

    @staticmethod
    def logprob_at(req: GenRequest, position: int, token: int) -> float:
        """The behaviour log-prob reported for ``token`` at ``position`` (module doc)."""
        digest = hashlib.blake2b(
            _LOGPROB_KEY.pack(req.seed, req.step, req.prompt_index, req.sample_index, position,
                              token, req.weight_version),
            digest_size=8, person=_LOGPROB_PERSON).digest()
        v = (int.from_bytes(digest, "little") >> 11) / float(1 << 53)
        return math.log1p(-v)

    @staticmethod
    def turn_start(req: GenRequest) -> int:
        """Where the request's current model turn starts: after the last observation among its
        committed ids (0: the first turn, or a single-turn response)."""
        ids = req.committed_token_ids
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == TURN_MARK:
                return i + 1
        return 0

    def modelled_length(self, req: GenRequest) -> int:
        """The current model turn's length in modelled tokens (>= 1; EOS included): the length
        model's draw, its mean and cap ``token_scale`` times those of emitted tokens."""
        mean = self.mean_len if self.mean_len is not None else MEAN_LEN_FRAC * req.max_new_tokens
        cap = None if self.max_len_cap is None else self.max_len_cap * self.token_scale
        return response_length(
            req.seed, req.step, req.prompt_index, req.sample_index,
            req.weight_version + self.turn_start(req) * _TURN_KEY, mean * self.token_scale,
            self.len_sigma, cap)

    def natural_length(self, req: GenRequest) -> int:
        """Where the current model turn ends (EOS included) without a budget: its start plus
        its own length (>= 1) in emitted tokens."""
        return self.turn_start(req) + -(-self.modelled_length(req) // self.token_scale)

    def event_at(self, req: GenRequest, position: int, length: int) -> TokenEvent:
        """The event at ``position`` of a response whose natural length is ``length``."""
        if position == length - 1 and length <= req.max_new_tokens:
            return TokenEvent(req.request_id, req.eos_token_id, position, True, "stop",
                              logprob=self.logprob_at(req, position, req.eos_token_id))
        reason: FinishReason | None = "length" if position + 1 >= req.max_new_tokens else None
        token = self.token_at(req, position)
        return TokenEvent(req.request_id, token, position, reason is not None, reason,
                          logprob=self.logprob_at(req, position, token))

    def expected_tokens(self, req: GenRequest) -> list[int]:
        """The full response (from position 0) a fault-free run produces."""
        length = self.natural_length(req)
        return [
            self.event_at(req, pos, length).token_id
            for pos in range(min(length, req.max_new_tokens))
        ]

    # -- the Engine interface -------------------------------------------------------------------

    @property
    def loaded(self) -> tuple[str, int] | None:
        return self._loaded

    def load(self, model_dir: Path | None, run_id: str, version: int) -> None:
        del model_dir  # no weights: the version is all that changes the tokens
        with self._stepping:
            if self._active or self._queue or self._inbox.pending_ids():
                raise EngineError("cannot swap weights under queued or active requests")
            self._sleep(self.load_s)
            self._loaded = (run_id, version)

    def load_adapter(self, base_dir: Path, adapter_dir: Path, run_id: str, version: int
                     ) -> None:
        # A run spec refuses lora for an emulated model: no version of one is an adapter.
        raise EngineError("the emu engine has no weights to apply an adapter to")

    def add(self, req: GenRequest) -> None:
        check_request(req, self._loaded)
        self._inbox.put(req)
        self.refill.filled(time.monotonic())
        self._arrived.set()

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)
        self._arrived.set()

    def has_work(self) -> bool:
        busy = bool(self._active) or bool(self._queue) or bool(self._inbox.pending_ids())
        if not busy:
            self.host.idle()  # the service waits for work now: not host time
        return busy

    def drain(self) -> list[str]:
        self._interrupt.set()
        with self._stepping:
            self._interrupt.clear()
            ids = list(self._active) + [r.request_id for r in self._queue]
            ids += self._inbox.clear()
            self._active.clear()
            self._queue.clear()
            self.host.idle()
            self.refill.reset()
        return ids

    def step(self) -> list[TokenEvent]:
        with self._stepping:
            self.host.begin(time.monotonic())
            self._arrived.clear()  # what arrives from here on is in the inbox after take()
            pending, aborted = self._inbox.take()
            for request_id in aborted:
                self._active.pop(request_id, None)
            self._queue = deque(r for r in self._queue if r.request_id not in aborted)
            events = queue_or_close(pending, self._queue)
            prefill_tokens = 0
            while self._queue and len(self._active) < self.max_batch:
                req = self._queue.popleft()
                act = self._admit(req)
                prefill_tokens += len(req.prompt_token_ids) + act.progress
                self._active[req.request_id] = act
            if self._active:
                if self._stalled():
                    time.sleep(STALL_POLL_S)  # hung: nothing comes out, nothing advances
                    return []
                # Modelled decode steps this call runs: a token's worth, or up to the first
                # modelled end, where a slot frees.
                decodes = min(min(a.end - a.progress for a in self._active.values()),
                              self.token_scale)
                slowdown = self._slowdown()
                prefill_s = self.prefill_s_per_token * prefill_tokens
                modelled = (prefill_s + self._decode_seconds(decodes)) * slowdown
                if slowdown > 1.0:
                    # Minutes a step at 10,000x: drain() cuts it short, so the process can leave.
                    self._interrupt.wait(self.time_scale * modelled)
                elif decodes > 1:
                    decodes = self._decode(prefill_s, decodes)
                    modelled = prefill_s + self._decode_seconds(decodes)
                else:
                    self._sleep(modelled)
                self.host.slept(self.time_scale * modelled, decodes)
                self.modelled_s += modelled
                self.decode_steps += 1
                for act in self._active.values():
                    act.progress += decodes
            ended = 0
            for request_id, act in list(self._active.items()):
                # A token once the progress passes its last modelled position (or the end).
                while min(self.token_scale * (act.position + 1), act.end) <= act.progress:
                    event = self.event_at(act.req, act.position, act.length)
                    events.append(event)
                    act.position += 1
                    if event.finished:
                        del self._active[request_id]
                        ended += 1
                        break
            # Slots this step freed with no work waiting for them: the control plane's to fill.
            waiting = len(self._active) + len(self._queue) + len(self._inbox.pending_ids())
            self.refill.freed(time.monotonic(), min(ended, max(0, self.max_batch - waiting)))
            late = self._inbox.late_aborts()
            if not self._active:
                self.host.idle()
        return [e for e in events if e.request_id not in late]

    def _admit(self, req: GenRequest) -> _Active:
        """A request entering the batch: its progress and its turn's modelled end, both in
        modelled tokens (each committed token counts ``token_scale``)."""
        m, position = self.token_scale, len(req.committed_token_ids)
        end = m * self.turn_start(req) + self.modelled_length(req)
        if end <= m * position:  # past its length (drawn at another version): to the budget
            end = m * req.max_new_tokens
        return _Active(req, position, self.natural_length(req), m * position,
                       min(end, m * req.max_new_tokens))

    def _decode_seconds(self, decodes: int) -> float:
        """``decodes`` modelled decode steps of the running batch: the weights' read each
        step, and each sequence's KV read, at the preset's constant context or, with
        ``true_context``, at its own (prompt + modelled position, growing a token a step).
        Every running sequence runs all of them (a step stops at the first modelled end)."""
        first, growth = self._decode_cost()
        return decodes * first + growth * decodes * (decodes - 1) / 2

    def _decode_cost(self) -> tuple[float, float]:
        """The batch's first decode step, and what each further one adds (its context
        grows a token per sequence)."""
        if not self.true_context:
            return self.decode_s_base + self.decode_s_per_seq * len(self._active), 0.0
        per_token = self.decode_s_per_seq / CONTEXT_TOKENS
        context = sum(len(a.req.prompt_token_ids) + a.progress for a in self._active.values())
        return self.decode_s_base + per_token * context, per_token * len(self._active)

    def _decode(self, prefill_s: float, decodes: int) -> int:
        """Sleep the prefill and ``decodes`` modelled decode steps; returns how many ran. A
        request that arrives while a slot is free (or an abort that frees one for waiting
        work) ends them at the next decode-step boundary, where a GPU engine would take it
        in, as :func:`sim.engine.advance` cuts a segment."""
        if self.time_scale <= 0:
            return decodes
        start = time.monotonic()
        end = start + self.time_scale * (prefill_s + self._decode_seconds(decodes))
        while (left := end - time.monotonic()) > 0:
            if not self._arrived.wait(left):
                break
            self._arrived.clear()
            if not self._room_for_waiting():
                continue
            elapsed = (time.monotonic() - start) / self.time_scale - prefill_s
            done = 1
            while done < decodes and self._decode_seconds(done) < elapsed:
                done += 1
            self._sleep_until(start + self.time_scale * (prefill_s + self._decode_seconds(done)))
            return done
        return decodes

    def _room_for_waiting(self) -> bool:
        """Work waits (arrived, or queued here) and a slot is, or is being, freed for it."""
        waiting = bool(self._queue) or bool(self._inbox.pending_ids())
        running = len(self._active.keys() - self._inbox.late_aborts())
        return waiting and running < self.max_batch

    def _sleep_until(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)

    def _serving_s(self) -> float:
        """Wall seconds since the first decode step (the clock of the fault settings)."""
        now = time.monotonic()
        if self._serving_since is None:
            self._serving_since = now
        return now - self._serving_since

    def _stalled(self) -> bool:
        return self.stall_after_s is not None and self._serving_s() >= self.stall_after_s

    def _slowdown(self) -> float:
        slow = self.slow_after_s is not None and self._serving_s() >= self.slow_after_s
        return self.slow_factor if slow else 1.0

    def _sleep(self, seconds: float) -> None:
        if self.time_scale > 0 and seconds > 0:
            time.sleep(self.time_scale * seconds)
