"""The GPU engine: an SGLang server driven over its HTTP API, weights updated in place.

Contract (see ``rollout_svc.engines.base``): token ids in, ``TokenEvent``s out; the engine
knows nothing about NATS or tokenizers. It never imports ``sglang``: it talks to a server, either
one it starts itself (``python -m sglang.launch_server`` on a free loopback port, at the first
``load``, with that version's directory as the model) or one it attaches to
(``RLBOOST_SGLANG_URL``).

* **Streaming.** Each request is one streamed ``POST /generate`` with ``input_ids`` = prompt +
  committed tokens, so a migrated response resumes after its committed tokens (re-prefilled), and
  ``max_new_tokens`` = what is left of the budget. Output token ids become events at positions
  that count committed tokens. Every EOS id (the request's and the ``generation_config.json``
  ones of the loaded version) is passed as ``stop_token_ids`` and arrives as the last token. The
  prompt ids are the trainer's, chat template applied: the server never sees text (it runs with
  ``--skip-tokenizer-init``), so nothing is templated or tokenized twice.
* **Abort** drops the request's stream and sends ``POST /abort_request`` with its rid; after
  ``abort`` returns no event for it leaves ``step()``.
* **Weights.** ``load`` refuses under queued or active work (like every engine), then
  ``/pause_generation`` -> ``/update_weights_from_disk`` (``model_path``, ``weight_version``) ->
  ``/continue_generation``, and checks ``/get_weight_version`` where the server has it.
* **Adapters.** ``load_adapter`` (an adapter-only version of a LoRA run) puts the base in place
  as ``load`` does, only when it is not the base already loaded, then ``POST
  /load_lora_adapter`` (``lora_name`` ``<run>-v<version>``, ``lora_path`` the pulled adapter
  directory) and ``POST /unload_lora_adapter`` of the adapter before it; every ``/generate``
  names the loaded adapter in ``lora_path``. A server this engine starts for an adapter
  version gets ``--enable-lora`` with the adapter's rank and target modules; an attached
  server must have been started with LoRA enabled (SGLang's ``--enable-lora``,
  ``--max-lora-rank``, ``--lora-target-modules``). SGLang runs the adapter beside the base
  weights (its LoRA kernels), so its logits are the merged model's up to rounding, not bit for
  bit as the torch engine's are.
* **Errors.** A failed load raises :class:`EngineError` from ``load``; a stream that fails
  (server gone, a 4xx, an error frame) after a few resumed retries raises it from ``step()``,
  which takes the instance down so its leases go back to the manager.

* **Behaviour log-probs.** Every ``/generate`` asks ``return_logprob``; SGLang answers in
  ``meta_info.output_token_logprobs``, one ``[logprob, token_id, text]`` per output token of the
  stream so far (``text`` is null without a tokenizer), cumulative in every frame: the tokenizer
  manager extends its per-request lists with each batch and re-states them whole, with
  incremental streaming too. The event at output index k takes entry k, where its token id
  agrees; otherwise (a server that omits them) ``logprob`` is None. What SGLang reports is the
  trainer's convention (base contract), read in ``python/sglang/srt/layers/sampler.py``: a
  sampled token's log-prob is taken in the ``Sampler`` from ``softmax(logits / T)``, the
  distribution it draws from (since sgl-project/sglang#2664, "return the real logprob used in
  sampling"; top-p renormalisation would enter it too, which is why this engine sends
  ``top_p = 1``), in float32 with -inf clamped to the dtype's minimum; a greedy request
  (``sampling_params.py`` turns T = 0 into T = 1 with ``top_k = 1``) gets
  ``log_softmax(logits)``, the model's own distribution, as the trainer's ``logit_scale(0) = 1``
  scores it. One exception: with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set (sgl-project/sglang#8375)
  the server reports pre-temperature log-probs, which are not the behaviour policy's at T != 1,
  so a server this engine starts never inherits that variable; an attached one must not set it.

**Determinism is not exact with SGLang**: the server samples with its own RNG on the GPU, not
with rlboost's keyed draws, so a migrated response continues on-policy (same weights, same
committed prefix) but not with the tokens an unmoved one would have drawn. Invariants 1-4 hold;
invariant 5's token-for-token oracle is an ``emu``/``torch`` property.

SGLang API as read in sgl-project/sglang: ``python/sglang/srt/entrypoints/http_server.py``
(endpoints, SSE framing ``data: {json}`` ... ``data: [DONE]``, ``success``/``message`` replies),
``python/sglang/srt/managers/io_struct.py`` (``GenerateReqInput``, ``AbortReq``,
``UpdateWeightFromDiskReqInput.weight_version``, ``LoadLoRAAdapterReqInput``:
``lora_name``, ``lora_path``; ``UnLoadLoRAAdapterReqInput``: ``lora_name``; replies
``success``, ``error_message``), ``docs/advanced_features/lora.ipynb`` (dynamic loading, the
``--enable-lora`` flags), the tokenizer manager's output processing
(``output_ids`` are cumulative per frame unless ``--incremental-streaming-output``;
``meta_info.completion_tokens`` counts them either way) and ``docs/basic_usage/sampling_params.md``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from rollout_svc.engines.base import (
    EngineError,
    GenRequest,
    TokenEvent,
    check_request,
    finish_reason,
    finished_on_arrival,
    generation_eos_ids,
    with_stops,
)
from shared.ports import free_port

log = logging.getLogger(__name__)

LAUNCH_CMD: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
STEP_WAIT_S = 0.05  # step() blocks this long for a token rather than spin the worker thread
STREAM_RETRIES = 3  # resumed re-sends of a stream that broke before its end
# Make SGLang report pre-temperature log-probs (module doc): never passed to a server started here.
ORIGINAL_LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")


class _StreamError(Exception):
    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


class SGLangEngine:
    name = "sglang"
    # Unknown (0): the server's decode steps are not visible over its HTTP API; a hung server
    # is found by the manager's per-lease progress check instead.
    decode_steps = 0

    def __init__(
        self,
        url: str | None = None,
        max_batch: int = 32,  # SGLang batches continuously itself; kept for create_engine's call
        launch_args: Sequence[str] = (),
        launch_cmd: Sequence[str] = LAUNCH_CMD,
        start_timeout_s: float = 900.0,
        request_timeout_s: float = 300.0,
    ) -> None:
        self.max_batch = max_batch
        self.url = url.rstrip("/") if url else None
        self._launch_args = list(launch_args)
        self._launch_cmd = list(launch_cmd)
        self._start_timeout_s = start_timeout_s
        self._timeout = httpx.Timeout(request_timeout_s, connect=5.0)
        self._owned: subprocess.Popen[bytes] | None = None
        self._healthy = False
        self._loaded: tuple[str, int] | None = None
        self._stops: frozenset[int] = frozenset()  # the loaded model's EOS ids
        self._model_dir: Path | None = None  # the weights the server holds (a base, or whole)
        self._lora: str | None = None  # the adapter every /generate names, when one is loaded
        # Shared between the caller's threads and the stream loop; _ready wakes step().
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._events: list[TokenEvent] = []
        self._live: dict[str, object] = {}  # request id -> ticket of its current stream
        self._error: EngineError | None = None
        self._rids = itertools.count()
        # Streams run as tasks of one event loop in a daemon thread; only that thread touches
        # _tasks, _current_rid and the async client.
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._current_rid: dict[str, str] = {}
        self._client: httpx.AsyncClient | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-streams",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- weights ---------------------------------------------------------------------------

    @property
    def loaded(self) -> tuple[str, int] | None:
        return self._loaded

    def load(self, model_dir: Path | None, run_id: str, version: int) -> None:
        if model_dir is None:
            raise EngineError("the sglang engine needs a model directory")
        with self._lock:
            if self._live or self._events:
                raise EngineError("cannot swap weights under queued or active requests")
        self._loaded = None  # add() refuses everything while the weights are in flux
        if self.url is None:
            self._launch(Path(model_dir))
        self._wait_healthy()
        try:
            with httpx.Client(base_url=self._base(), timeout=self._timeout) as client:
                self._lora_swap(client, None)
                self._swap(client, Path(model_dir), version)
        except httpx.HTTPError as exc:
            raise EngineError(f"sglang at {self.url}: {type(exc).__name__}: {exc}") from None
        self._stops = generation_eos_ids(Path(model_dir))
        self._loaded = (run_id, version)

    def load_adapter(self, base_dir: Path, adapter_dir: Path, run_id: str, version: int
                     ) -> None:
        with self._lock:
            if self._live or self._events:
                raise EngineError("cannot swap weights under queued or active requests")
        self._loaded = None
        if self.url is None:
            self._launch(base_dir, _lora_args(adapter_dir))
        self._wait_healthy()
        try:
            with httpx.Client(base_url=self._base(), timeout=self._timeout) as client:
                if self._model_dir != base_dir:
                    self._lora_swap(client, None)
                    self._swap(client, base_dir, version)
                self._lora_swap(client, (f"{run_id}-v{version}", adapter_dir))
        except httpx.HTTPError as exc:
            raise EngineError(f"sglang at {self.url}: {type(exc).__name__}: {exc}") from None
        self._stops = generation_eos_ids(base_dir)
        self._loaded = (run_id, version)

    def _lora_swap(self, client: httpx.Client, new: tuple[str, Path] | None) -> None:
        """Load adapter ``new`` (name, directory), then unload the one before, if any."""
        old, self._lora = self._lora, None
        if new is not None:
            resp = client.post("/load_lora_adapter",
                               json={"lora_name": new[0], "lora_path": str(new[1])})
            body = _json(resp)
            if resp.status_code != 200 or not body.get("success", False):
                raise EngineError(f"load_lora_adapter({new[1]}) failed: "
                                  f"{body.get('error_message') or resp.text[:200]}")
        if old is not None and (new is None or old != new[0]):
            resp = client.post("/unload_lora_adapter", json={"lora_name": old})
            if resp.status_code != 200:  # it only holds memory: the new one is in use
                log.warning("unload_lora_adapter(%s): HTTP %d", old, resp.status_code)
        self._lora = new[0] if new is not None else None

    def _swap(self, client: httpx.Client, model_dir: Path, version: int) -> None:
        # Nothing of ours runs (checked above), so "abort" only clears strays; a server older
        # than pause/continue answers 404 and update_weights_from_disk flushes the cache itself.
        paused = client.post("/pause_generation", json={"mode": "abort"}).status_code == 200
        try:
            resp = client.post("/update_weights_from_disk", json={
                "model_path": str(model_dir), "weight_version": str(version)})
            body = _json(resp)
            if resp.status_code != 200 or not body.get("success", False):
                raise EngineError(f"update_weights_from_disk({model_dir}) failed: "
                                  f"{body.get('message') or resp.text[:200]}")
        finally:
            if paused:
                client.post("/continue_generation", json={})
        self._model_dir = model_dir
        resp = client.get("/get_weight_version")
        if resp.status_code == 200 and _json(resp).get("weight_version") != str(version):
            raise EngineError(f"sglang reports weight version {_json(resp).get('weight_version')!r}"
                              f" after loading {version}")

    def _launch(self, model_dir: Path, extra: Sequence[str] = ()) -> None:
        port = free_port()
        argv = [*self._launch_cmd, "--model-path", str(model_dir), "--host", "127.0.0.1",
                "--port", str(port), "--skip-tokenizer-init", *extra, *self._launch_args]
        log.info("starting the SGLang server: %s", " ".join(argv))
        # Its output goes to ours (the instance's log); its own session, so close() can take
        # down the whole process tree SGLang spawns (scheduler, detokenizer).
        env = {k: v for k, v in os.environ.items() if k not in ORIGINAL_LOGPROB_ENV}
        if len(env) < len(os.environ):
            log.warning("not passing %s to the SGLang server: its log-probs must be those of "
                        "the tempered distribution it samples", "/".join(ORIGINAL_LOGPROB_ENV))
        self._owned = subprocess.Popen(argv, start_new_session=True, env=env)
        self.url = f"http://127.0.0.1:{port}"

    def _wait_healthy(self) -> None:
        if self._healthy:
            return
        end = time.monotonic() + self._start_timeout_s
        with httpx.Client(base_url=self._base(), timeout=httpx.Timeout(30.0, connect=1.0)) as c:
            while time.monotonic() < end:
                if self._owned is not None and self._owned.poll() is not None:
                    raise EngineError(f"the SGLang server exited with {self._owned.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if c.get("/health").status_code == 200:
                        self._healthy = True
                        return
                time.sleep(0.25)
        raise EngineError(f"no healthy SGLang server at {self.url} after {self._start_timeout_s}s")

    def _base(self) -> str:
        assert self.url is not None
        return self.url

    # -- requests --------------------------------------------------------------------------

    def add(self, req: GenRequest) -> None:
        check_request(req, self._loaded)
        req = with_stops(req, self._stops)
        done = finished_on_arrival(req)
        ticket = object()
        with self._lock:
            if done is not None:
                self._events.append(done)
                self._ready.notify_all()
                return
            self._live[req.request_id] = ticket
        self._loop.call_soon_threadsafe(self._start, req, ticket)

    def abort(self, request_id: str) -> None:
        with self._lock:
            had = self._live.pop(request_id, None) is not None
            self._events = [e for e in self._events if e.request_id != request_id]
        if had:
            self._loop.call_soon_threadsafe(self._cancel, request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._live or self._events or self._error)

    def step(self) -> list[TokenEvent]:
        with self._lock:
            if not self._events and self._error is None:
                self._ready.wait(STEP_WAIT_S)
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            events, self._events = self._events, []
        return events

    def drain(self) -> list[str]:
        with self._lock:
            ids = list(self._live)
            self._live.clear()
            self._events.clear()
        for request_id in ids:
            self._loop.call_soon_threadsafe(self._cancel, request_id)
        return ids

    def close(self) -> None:
        """Stop the streams and, if this engine started the server, the server."""
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        proc, self._owned = self._owned, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    # -- the stream loop (runs in the engine's thread) ---------------------------------------

    async def _shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        await self._loop.shutdown_asyncgens()  # finalise abandoned streams before the loop stops

    def _start(self, req: GenRequest, ticket: object) -> None:
        self._cancel(req.request_id, notify_server=False)
        task = self._loop.create_task(self._run(req, ticket))
        self._tasks[req.request_id] = task
        task.add_done_callback(lambda t: self._tasks.pop(req.request_id, None)
                               if self._tasks.get(req.request_id) is t else None)

    def _cancel(self, request_id: str, notify_server: bool = True) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()
        rid = self._current_rid.pop(request_id, None)
        if notify_server and rid is not None:
            self._loop.create_task(self._post_abort(rid))

    async def _post_abort(self, rid: str) -> None:
        try:
            await self._http().post("/abort_request", json={"rid": rid})
        except httpx.HTTPError as exc:  # the stream is gone on our side either way
            log.warning("abort_request(%s) failed: %s", rid, exc)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self._base(), timeout=self._timeout)
        return self._client

    def _emit(self, ticket: object, event: TokenEvent) -> bool:
        """Hand an event to step(), unless the request was aborted or re-added meanwhile."""
        with self._lock:
            if self._live.get(event.request_id) is not ticket:
                return False
            self._events.append(event)
            if event.finished:
                del self._live[event.request_id]
            self._ready.notify_all()
            return True

    async def _run(self, req: GenRequest, ticket: object) -> None:
        tokens = [*req.prompt_token_ids, *req.committed_token_ids]
        position = len(req.committed_token_ids)
        failures = 0
        while True:
            # A fresh rid per stream: an abort_request for an old stream of the same response
            # (migrated back here, or resent) must never hit the new one.
            rid = f"{req.request_id}.{next(self._rids)}"
            self._current_rid[req.request_id] = rid
            before = position
            try:
                async with contextlib.aclosing(self._generate(rid, tokens, req, position)) as gen:
                    async for token, logprob in gen:
                        reason = finish_reason(req, token, position)
                        event = TokenEvent(req.request_id, token, position, reason is not None,
                                           reason, logprob=logprob)
                        if not self._emit(ticket, event) or reason is not None:
                            return
                        tokens.append(token)
                        position += 1
            except asyncio.CancelledError:
                raise
            except (httpx.HTTPError, _StreamError) as exc:
                retryable = getattr(exc, "retryable", True)
                failures += 1
                if not retryable or failures >= STREAM_RETRIES:
                    self._fail(req.request_id, ticket, f"generate {rid}: {exc}")
                    return
                log.warning("stream %s broke (%s); resuming at position %d", rid, exc, position)
                await asyncio.sleep(0.2 * failures)
                continue
            finally:
                if self._current_rid.get(req.request_id) == rid:
                    del self._current_rid[req.request_id]
            # The stream ended short of EOS and budget (every EOS id of generation_config is a
            # stop of ours too, so a server that stops on some other token of its own): go on
            # from here; no progress at all is a fault.
            if position == before:
                failures += 1
                if failures >= STREAM_RETRIES:
                    self._fail(req.request_id, ticket, f"generate {rid}: ended with no tokens")
                    return

    def _fail(self, request_id: str, ticket: object, message: str) -> None:
        with self._lock:
            if self._live.get(request_id) is not ticket:
                return
            del self._live[request_id]
            self._error = EngineError(message)
            self._ready.notify_all()

    async def _generate(self, rid: str, tokens: list[int], req: GenRequest, position: int
                        ) -> AsyncGenerator[tuple[int, float | None], None]:
        """The new output token ids of one streamed /generate, in order, with their log-probs."""
        stops = sorted({req.eos_token_id, *req.stop_token_ids})
        body = {
            "rid": rid,
            "input_ids": tokens,
            "stream": True,
            "return_logprob": True,  # output tokens only: logprob_start_len stays -1
            **({"lora_path": self._lora} if self._lora is not None else {}),
            "sampling_params": {
                "max_new_tokens": req.max_new_tokens - position,
                "temperature": req.temperature,
                # Pure temperature sampling: on-policy RL must not inherit a model's
                # generation_config top-p/top-k defaults, which SGLang may apply.
                "top_p": 1.0,
                "top_k": -1,
                "min_p": 0.0,
                "stop_token_ids": stops,
            },
        }
        seen = 0
        last_reason: Any = None
        logprobs: Any = None  # the last frame's output_token_logprobs
        async with self._http().stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:300]
                raise _StreamError(f"HTTP {resp.status_code}: {text}",
                                   retryable=resp.status_code >= 500)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                frame = orjson.loads(payload)
                if "error" in frame:
                    raise _StreamError(f"error frame: {frame['error']}", retryable=False)
                ids: list[int] = frame.get("output_ids") or []
                meta: dict[str, Any] = frame.get("meta_info") or {}
                # Cumulative or incremental frames alike end at completion_tokens.
                total = int(meta.get("completion_tokens", seen + len(ids)))
                fresh = ids[max(0, len(ids) - (total - seen)):] if total > seen else []
                logprobs = meta.get("output_token_logprobs")
                for k, token in enumerate(fresh, start=total - len(fresh)):
                    yield int(token), output_logprob(logprobs, k, int(token))
                seen = total
                last_reason = meta.get("finish_reason")
                if isinstance(last_reason, dict) and last_reason.get("type") == "abort":
                    raise _StreamError(f"aborted by the server: {last_reason}", retryable=True)
        # A server that trims the matched stop token from output_ids still says so here.
        if isinstance(last_reason, dict) and last_reason.get("type") == "stop" \
                and last_reason.get("matched") in stops:
            matched = int(last_reason["matched"])
            yield matched, output_logprob(logprobs, seen, matched)


def _lora_args(adapter_dir: Path) -> list[str]:
    """SGLang's flags for serving adapters shaped like the one in ``adapter_dir``."""
    try:
        config = orjson.loads((adapter_dir / "adapter_config.json").read_bytes())
        targets = config["target_modules"]
        targets = [targets] if isinstance(targets, str) else [str(t) for t in targets]
        return ["--enable-lora", "--max-lora-rank", str(int(config["r"])),
                "--lora-target-modules", *targets]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"cannot read {adapter_dir}/adapter_config.json: {exc}") from None


def output_logprob(entries: Any, index: int, token: int) -> float | None:
    """Entry ``index`` of ``meta_info.output_token_logprobs`` if it is ``token``'s, else None."""
    if not isinstance(entries, list) or not 0 <= index < len(entries):
        return None
    entry = entries[index]
    if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token:
        return None
    value = entry[0]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
