"""The embedded CPU engine: any HF causal LM run by torch with a KV cache, in waves.

Contract (see ``rollout_svc.engines.base``): token ids in, ``TokenEvent``s out, one token per active
request per ``step()``; sampling is keyed by (seed, step, prompt, sample, position) so the
output does not depend on batching or on where a response resumes. The engine knows nothing
about NATS; it's purely token id sequences.

Batching is by *waves*, the simplest scheme that is exactly right with one ``DynamicCache``:
when nothing is active, up to ``max_batch`` queued requests are left-padded (prompt plus
committed tokens), prefilled together, and then decoded one token per ``step()``. A request
that finishes or is aborted stays in the batch as padding, emitting nothing, until the whole
wave is done; requests added meanwhile wait for the next wave. Continuous batching would need
per-row cache surgery, which a CPU engine for small models does not earn.

Each event carries the token's behaviour log-prob (base contract), ``log_softmax(logits * s)``
of the very logits the token was drawn from, in float32 as the trainer scores it.

The draw, the prefill and the decode step are :mod:`shared.generation`'s, the one sampler the
trainer's eval and self-checks run too; this module schedules them and keeps the requests.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rollout_svc.engines.base import (
    EngineError,
    GenRequest,
    Inbox,
    TokenEvent,
    check_request,
    finish_reason,
    generation_eos_ids,
    queue_or_close,
    with_stops,
)
from shared.generation import Batch, DrawKey, decode, prefill, sample_token

# Config keys that differ between two saves of the same architecture and must not force a
# full reload when they do.
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")


@dataclass(slots=True)
class _Row:
    req: GenRequest
    key: DrawKey  # the request's sampling key
    position: int  # response position of the token this row samples next
    done: bool = False  # finished or aborted: padding until the wave ends


@dataclass(slots=True)
class _Wave:
    rows: list[_Row]
    batch: Batch  # the rows' KV cache, mask, positions and last tokens


class TorchEngine:
    name = "torch"

    def __init__(
        self,
        device: str = "cpu",
        max_batch: int = 32,
        dtype: torch.dtype | str = torch.float32,
        threads: int | None = None,
    ) -> None:
        if max_batch < 1:
            raise EngineError("max_batch must be >= 1")
        resolved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if not isinstance(resolved, torch.dtype):
            raise EngineError(f"unknown dtype {dtype!r}")
        if threads is not None:
            # Process-wide, so only when asked and only at construction, never at import.
            # For tiny models on a small shared CPU, threads=1 is several times faster: the
            # intra-op pool's wake-ups cost more than the matmuls it splits.
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.dtype = resolved
        self._model: Any = None  # a transformers PreTrainedModel; untyped upstream
        self._loaded: tuple[str, int] | None = None
        self._base: tuple[Path, dict[str, torch.Tensor]] | None = None  # adapter versions'
        self._stops: frozenset[int] = frozenset()  # the loaded model's EOS ids
        self._inbox = Inbox()
        self._queue: deque[GenRequest] = deque()
        self._wave: _Wave | None = None
        self._stepping = threading.Lock()  # step, drain and load never overlap
        self.decode_steps = 0  # completed forward passes: the heartbeat's sign of life

    # -- weights ---------------------------------------------------------------------------

    @property
    def loaded(self) -> tuple[str, int] | None:
        return self._loaded

    def load(self, model_dir: Path | None, run_id: str, version: int) -> None:
        if model_dir is None:
            raise EngineError("the torch engine needs a model directory")
        with self._stepping:
            if self._wave is not None or self._queue or self._inbox.pending_ids():
                raise EngineError("cannot swap weights under queued or active requests")
            if self._model is None or not self._swap_in_place(Path(model_dir)):
                self._model = self._full_load(Path(model_dir))
            self._stops = generation_eos_ids(Path(model_dir))
            self._loaded = (run_id, version)

    def load_adapter(self, base_dir: Path, adapter_dir: Path, run_id: str, version: int
                     ) -> None:
        """Merge the adapter into a CPU copy of the base (read once and kept), then copy the
        result into the live model as a full version's weights would be: bit for bit the
        trainer's merged model (:mod:`shared.weights.adapter`), so samples are those of a
        run that ships merged models. Merging rather than running PEFT's layers keeps one
        forward path, the plain model's, for every version and every kind of run."""
        from shared.weights.adapter import AdapterError, merge_adapter, read_base

        try:
            if self._base is None or self._base[0] != base_dir:
                self._base = (base_dir, read_base(base_dir))
            state = merge_adapter(self._base[1], adapter_dir)
        except (AdapterError, OSError) as exc:
            raise EngineError(f"cannot apply {adapter_dir} to {base_dir}: {exc}") from exc
        with self._stepping:
            if self._wave is not None or self._queue or self._inbox.pending_ids():
                raise EngineError("cannot swap weights under queued or active requests")
            if self._model is None or not self._swap_in_place(base_dir, state):
                self._model = self._full_load(base_dir)
                if not self._swap_in_place(base_dir, state):
                    raise EngineError(f"{adapter_dir}: merged weights do not fit {base_dir}")
            self._stops = generation_eos_ids(base_dir)
            self._loaded = (run_id, version)

    def _full_load(self, model_dir: Path) -> Any:
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype)
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load model from {model_dir}: {exc}") from exc
        return model.to(self.device).eval()

    def _swap_in_place(self, model_dir: Path,
                       state: dict[str, torch.Tensor] | None = None) -> bool:
        """Copy a new checkpoint (``state``, or ``model_dir``'s weights) into the live model;
        False if only a full load will do."""
        try:
            config = AutoConfig.from_pretrained(model_dir).to_dict()
        except (OSError, ValueError):
            return False
        current = self._model.config.to_dict()
        for key in _VOLATILE_CONFIG_KEYS:
            config.pop(key, None)
            current.pop(key, None)
        files = sorted(model_dir.glob("*.safetensors"))
        if config != current or not (files or state):
            return False
        if state is None:
            state = {}
            for file in files:
                state.update(load_file(file))
        # Check the keys before copying anything, so a mismatch leaves the model untouched.
        params = dict(self._model.state_dict(keep_vars=True))
        if not set(state) <= set(params):
            return False
        # A key the checkpoint leaves out is fine only if it is tied to one it has
        # (lm_head.weight shares embed_tokens.weight in tied models).
        given = {params[k].data_ptr() for k in state}
        if any(params[k].data_ptr() not in given for k in set(params) - set(state)):
            return False
        with torch.no_grad():
            self._model.load_state_dict(state, strict=False)
        return True

    # -- requests ---------------------------------------------------------------------------

    def add(self, req: GenRequest) -> None:
        check_request(req, self._loaded)
        self._inbox.put(with_stops(req, self._stops))

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    def has_work(self) -> bool:
        active = self._wave is not None and not all(r.done for r in self._wave.rows)
        return active or bool(self._queue) or bool(self._inbox.pending_ids())

    def drain(self) -> list[str]:
        with self._stepping:
            ids = [r.req.request_id for r in self._wave.rows if not r.done] if self._wave else []
            ids += [r.request_id for r in self._queue]
            ids += self._inbox.clear()
            self._wave = None
            self._queue.clear()
        return ids

    # -- generation -------------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        with self._stepping, torch.inference_mode():
            events = self._admit()
            if self._wave is not None and all(r.done for r in self._wave.rows):
                self._wave = None  # frees the cache
            if self._wave is None and self._queue:
                events += self._prefill()
                self.decode_steps += 1
            elif self._wave is not None:
                events += self._decode()
                self.decode_steps += 1
            late = self._inbox.late_aborts()
        return [e for e in events if e.request_id not in late]

    def _admit(self) -> list[TokenEvent]:
        pending, aborted = self._inbox.take()
        if aborted:
            self._queue = deque(r for r in self._queue if r.request_id not in aborted)
            for row in self._wave.rows if self._wave else []:
                if row.req.request_id in aborted:
                    row.done = True
        return queue_or_close(pending, self._queue)

    def _prefill(self) -> list[TokenEvent]:
        reqs = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
        seqs = [r.prompt_token_ids + r.committed_token_ids for r in reqs]
        logits, batch = prefill(self._model, seqs, self.device)
        rows = [_Row(r, _key(r), len(r.committed_token_ids)) for r in reqs]
        self._wave = _Wave(rows, batch)
        return self._sample(logits)

    def _decode(self) -> list[TokenEvent]:
        wave = self._wave
        assert wave is not None
        return self._sample(decode(self._model, wave.batch))

    def _sample(self, logits: torch.Tensor) -> list[TokenEvent]:
        wave = self._wave
        assert wave is not None
        live = [i for i, row in enumerate(wave.rows) if not row.done]  # the rest is padding
        tokens = [
            sample_token(logits[i], wave.rows[i].req.temperature, wave.rows[i].key,
                         wave.rows[i].position)
            for i in live
        ]
        logprobs = behaviour_logprobs(
            logits[live], [wave.rows[i].req.temperature for i in live], tokens)
        events: list[TokenEvent] = []
        for i, token, logprob in zip(live, tokens, logprobs, strict=True):
            row = wave.rows[i]
            reason = finish_reason(row.req, token, row.position)
            events.append(TokenEvent(row.req.request_id, token, row.position,
                                     reason is not None, reason, logprob=logprob))
            wave.batch.last[i] = token
            row.position += 1
            row.done = reason is not None
        if all(r.done for r in wave.rows):
            self._wave = None
        return events


def behaviour_logprobs(logits: torch.Tensor, temperatures: list[float], tokens: list[int]
                       ) -> list[float]:
    """Each row's ``log_softmax(logits * s)[token]`` in float32, ``s = 1 / T`` (1 for greedy).

    The trainer's scaling (``trainer_svc.learn.algorithms.logprobs.logit_scale``, restated here
    because services never import each other) and precision: half-precision logits are upcast
    before the softmax, as the trainer upcasts them. One log_softmax over the rows, one value
    gathered from each.
    """
    if not tokens:
        return []
    scales = torch.tensor([1.0 if t == 0 else 1.0 / t for t in temperatures],
                          dtype=torch.float32, device=logits.device)
    logp = torch.log_softmax(logits.float() * scales[:, None], dim=-1)
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    return [float(v) for v in logp.gather(-1, index)[:, 0].tolist()]


def _key(req: GenRequest) -> DrawKey:
    return DrawKey(req.seed, req.step, req.prompt_index, req.sample_index)
