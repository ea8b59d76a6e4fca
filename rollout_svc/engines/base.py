"""The interface every generation engine keeps: token ids in, token events out.

The engine knows nothing about NATS, Redis, leases or tokenizers; it's purely token id
sequences. The instance service drives it: it calls ``step()`` over and over in one worker
thread while ``add``/``abort`` arrive from the event-loop thread, so those two only touch an
``Inbox`` (a lock and two lists) that ``step()`` empties when it starts.

Contract every engine keeps:

* **Keyed sampling (invariant 5).** The token at response position ``pos`` of a request is
  ``shared.sampling.pick(cumulative_probs, uniform(seed, step, prompt_index, sample_index, pos))``
  over softmax(logits / temperature) in float64 on the CPU (temperature 0: argmax). Nothing
  depends on the batch, the instance or how often the response moved, so a request resumed
  after its ``committed_token_ids`` on another engine draws exactly what it would have.
* **Positions count committed tokens.** ``max_new_tokens`` is the whole response budget; a
  request resumed after k tokens emits positions k, k+1, ...; EOS is emitted as the last token
  with finish reason ``"stop"``, and the token at position ``max_new_tokens - 1`` ends with
  ``"length"``.
* **Every EOS stops.** EOS is ``eos_token_id`` or any of ``stop_token_ids``: at ``add`` the engine
  puts there the ``eos_token_id`` of the loaded model's ``generation_config.json``
  (:func:`generation_eos_ids`; chat models list their end-of-turn token there beside the
  tokenizer's EOS), so a chat model's turn ends where the model ends it.
* **Behaviour log-probs.** Each sampled token's event carries ``logprob``: the log-probability
  of that token under the distribution the engine drew it from, ``log_softmax(logits * s)``
  with ``s = 1 / temperature``, the scaling the trainer scores with
  (``trainer_svc.learn.algorithms.logprobs.logit_scale``). Greedy decoding (temperature 0) has
  ``s = 1``: the argmax token's log-prob under the model's own distribution, never the 0 of a
  point mass, as the trainer scores greedy responses at T = 1. It is the value off-policy
  corrections take as the behaviour policy's, so it is computed from the very logits the token
  was drawn from, not re-scored later. ``None`` means the engine does not know it.
* **Already finished on arrival.** A request whose committed tokens end in EOS or fill the
  budget generates nothing: its only event re-states the last committed token with
  ``finished=True``, so the caller learns it is complete (the manager drops the token itself
  as a duplicate of a committed one). That event's ``logprob`` is ``None``: nothing was sampled,
  and the committed token's log-prob was reported, and committed, where it was.
* **On-policy.** ``add`` refuses a request whose ``weight_version`` is not the loaded one, and
  ``load`` refuses to swap weights under queued or active work: drain (or finish) first.
* **Abort is final.** After ``abort(id)`` returns, no event for that id comes out of ``step()``
  (an event computed by a step already in flight is filtered before it returns).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from shared.errors import RlboostError
from shared.protocol import FinishReason


@dataclass(slots=True)
class GenRequest:
    request_id: str
    prompt_token_ids: list[int]
    committed_token_ids: list[int]  # response tokens already committed elsewhere: resume after them
    max_new_tokens: int  # total response budget INCLUDING committed tokens
    temperature: float  # 0 = greedy (argmax)
    seed: int  # run seed: first coordinate of the sampling key
    step: int  # RL step: second coordinate of the sampling key
    prompt_index: int  # third coordinate of the sampling key
    sample_index: int  # fourth coordinate (the position is the fifth)
    eos_token_id: int  # sampling it ends the response with finish reason "stop"
    weight_version: int  # must equal the engine's loaded version (on-policy guard)
    stop_token_ids: frozenset[int] = frozenset()  # more ids that end it as EOS does ("stop")


@dataclass(slots=True)
class TokenEvent:
    request_id: str
    token_id: int
    position: int  # index in the response (0-based, committed tokens count)
    finished: bool  # True on the response's last token
    finish_reason: FinishReason | None  # "stop" (EOS, included as this token) | "length"
    # Behaviour log-prob of token_id where it was sampled (module doc); None: not sampled here.
    logprob: float | None = None


class EngineError(RlboostError):
    """A request or load the engine cannot honour (bad request, version mismatch, bad model)."""


class EngineUnavailable(EngineError, NotImplementedError):
    """The named engine exists in the design but cannot run in this build."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"engine {name!r} is not available: {problem}")
        self.name = name
        self.problem = problem


class Engine(Protocol):
    name: str
    # Completed decode steps since the process started, monotonic; 0 = none yet or unknown
    # (an engine that cannot tell). The heartbeat carries it: a count that stops while the
    # instance holds work is a hung engine (the manager drains it).
    decode_steps: int

    def load(self, model_dir: Path | None, run_id: str, version: int) -> None: ...

    # An adapter-only version (docs/weights.md "LoRA versions"): PEFT's adapter in
    # ``adapter_dir`` over the full model in ``base_dir``; refused like ``load`` under work.
    def load_adapter(self, base_dir: Path, adapter_dir: Path, run_id: str, version: int
                     ) -> None: ...

    @property
    def loaded(self) -> tuple[str, int] | None: ...

    def add(self, req: GenRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[TokenEvent]: ...

    def drain(self) -> list[str]: ...


def finish_reason(req: GenRequest, token_id: int, position: int) -> FinishReason | None:
    """Why the response ends at this token, or None if it goes on."""
    if token_id == req.eos_token_id or token_id in req.stop_token_ids:
        return "stop"
    if position + 1 >= req.max_new_tokens:
        return "length"
    return None


def generation_eos_ids(model_dir: Path) -> frozenset[int]:
    """The ``eos_token_id`` of ``model_dir/generation_config.json`` (an int or a list of them);
    empty when there is no such file or field."""
    try:
        config = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = value if isinstance(value, list) else [value]
    return frozenset(i for i in ids if type(i) is int and i >= 0)


def with_stops(req: GenRequest, stops: frozenset[int]) -> GenRequest:
    """``req`` that also ends on ``stops`` (the loaded model's EOS ids)."""
    if stops <= req.stop_token_ids:
        return req
    return dataclasses.replace(req, stop_token_ids=req.stop_token_ids | stops)


def finished_on_arrival(req: GenRequest) -> TokenEvent | None:
    """The closing event of a request that has nothing left to generate, else None."""
    done = req.committed_token_ids
    if not done:
        return None
    reason = finish_reason(req, done[-1], len(done) - 1)
    if reason is None:
        return None
    return TokenEvent(req.request_id, done[-1], len(done) - 1, True, reason)


def queue_or_close(pending: list[GenRequest], queue: deque[GenRequest]) -> list[TokenEvent]:
    """Queue each of ``pending`` that has tokens left to generate; the closing events of the
    rest (:func:`finished_on_arrival`), which generate nothing."""
    events: list[TokenEvent] = []
    for req in pending:
        closing = finished_on_arrival(req)
        if closing is None:
            queue.append(req)
        else:
            events.append(closing)
    return events


def check_request(req: GenRequest, loaded: tuple[str, int] | None) -> None:
    """Reject what no engine can generate correctly, at ``add`` time, in the caller's thread."""
    if loaded is None:
        raise EngineError(f"{req.request_id}: no weights loaded")
    if req.weight_version != loaded[1]:
        raise EngineError(
            f"{req.request_id}: wants weight version {req.weight_version}, engine holds {loaded[1]}"
        )
    if not req.prompt_token_ids:
        raise EngineError(f"{req.request_id}: empty prompt")
    if req.max_new_tokens < 1:
        raise EngineError(f"{req.request_id}: max_new_tokens must be >= 1")
    if req.temperature < 0:
        raise EngineError(f"{req.request_id}: negative temperature")


class Inbox:
    """The only state shared between the caller's threads and the thread running ``step()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[GenRequest] = []
        self._aborted: set[str] = set()

    def put(self, req: GenRequest) -> None:
        with self._lock:
            self._pending.append(req)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._pending = [r for r in self._pending if r.request_id != request_id]
            # Recorded even if it was only pending: a step in flight may have taken it already.
            self._aborted.add(request_id)

    def take(self) -> tuple[list[GenRequest], set[str]]:
        """Everything added and aborted since the last take; aborts apply before the adds."""
        with self._lock:
            pending, self._pending = self._pending, []
            aborted, self._aborted = self._aborted, set()
        return pending, aborted

    def late_aborts(self) -> set[str]:
        """Aborts that arrived while a step ran: its events for these ids must not leave."""
        with self._lock:
            return set(self._aborted)

    def pending_ids(self) -> list[str]:
        with self._lock:
            return [r.request_id for r in self._pending]

    def clear(self) -> list[str]:
        with self._lock:
            ids = [r.request_id for r in self._pending]
            self._pending = []
            self._aborted = set()
        return ids
