"""A stand-in for an SGLang server: the endpoints rlboost's sglang engine uses, over real HTTP.

It follows SGLang's documented native API as read in sgl-project/sglang:
``python/sglang/srt/entrypoints/http_server.py`` (routes; ``/generate`` with ``stream`` answers
``text/event-stream`` frames ``data: {json}\\n\\n`` closed by ``data: [DONE]\\n\\n``, and an
``{"error": {"message"}}`` frame on a bad request; ``/update_weights_from_disk`` answers
``{success, message, num_paused_requests}`` with 200 or 400; ``/abort_request`` and
``/pause_generation``/``/continue_generation`` answer 200; ``/get_weight_version``),
``python/sglang/srt/managers/io_struct.py`` (the fields of ``GenerateReqInput``, ``AbortReq``,
``UpdateWeightFromDiskReqInput`` incl. ``weight_version``; pause modes ``abort|retract|in_place``),
the tokenizer manager's output processing (``output_ids`` cumulative per frame, or only the new
ones with ``--incremental-streaming-output``; ``meta_info`` with ``id``, ``finish_reason``
``{"type": "stop", "matched": id}`` / ``{"type": "length", "length": n}`` / ``{"type": "abort"}``,
``prompt_tokens``, ``completion_tokens``, ``weight_version``; with ``return_logprob``,
``output_token_logprobs``: a ``[logprob, token_id, text]`` triple per output token so far, ``text``
null without a tokenizer, re-stated whole in every frame, incremental streaming or not, as the
tokenizer manager's ``add_logprob_to_meta_info`` does) and
``docs/basic_usage/sampling_params.md`` (sampling parameter names). Unknown request fields are
refused with 400, as SGLang's dataclass validation does, so a misspelt field fails a test.

The "model" is deterministic: next token = (last input or output token + 1 + shift) % VOCAB,
where ``shift`` is ``standin_shift`` in the model directory's ``config.json`` — so a test sees
which weights generated a token; its reported log-prob is :func:`standin_logprob` of the token,
shifted as SGLang's pre-temperature value would differ when the server runs with
``SGLANG_RETURN_ORIGINAL_LOGPROB`` set. Generation stops at a stop token (EOS included in
``output_ids``, as SGLang does): one of the request's ``stop_token_ids`` or, as SGLang's
scheduler adds the model's own, an ``eos_token_id`` of the model directory's
``generation_config.json``; or at ``max_new_tokens``.

Adapters: ``/load_lora_adapter`` (``lora_name``, ``lora_path``, ``pinned``; the directory must
hold ``adapter_config.json``) and ``/unload_lora_adapter`` (``lora_name``) answer
``{success, error_message, loaded_adapters}``, 200 or 400, as SGLang's
``LoadLoRAAdapterReqOutput``; a ``/generate`` naming an adapter in ``lora_path`` that is not
loaded is a 400. An adapter adds ``standin_shift`` of its ``adapter_config.json`` to the
model's, so a test sees which adapter generated a token.

Test hooks, not SGLang: ``GET /_standin/calls`` (every call with its JSON body, in order),
``POST /_standin/reset``, ``POST /_standin/fail`` (``{"status": 500, "count": n}``: the next n
``/generate`` calls fail).
Run: ``python -m tests.support.sglang_standin --model-path DIR --port P``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

VOCAB = 50
GENERATE_FIELDS = {"text", "input_ids", "input_embeds", "sampling_params", "rid", "stream",
                   "return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path",
                   "return_text_in_logprobs", "custom_logit_processor", "bootstrap_host"}
SAMPLING_FIELDS = {"max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k",
                   "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "min_new_tokens", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                   "spaces_between_special_tokens", "n", "json_schema", "regex", "ebnf",
                   "custom_params", "sampling_seed"}
UPDATE_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version",
                 "is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph",
                 "token_step", "flush_cache"}


@dataclass
class State:
    model_path: str
    incremental: bool
    token_delay_s: float
    shift: int = 0
    original_logprob: bool = False  # SGLANG_RETURN_ORIGINAL_LOGPROB was set
    weight_version: str = "default"
    paused: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    adapters: dict[str, int] = field(default_factory=dict)  # loaded adapter -> its shift
    fail_status: int = 0
    fail_count: int = 0


def standin_logprob(token: int, original: bool = False) -> float:
    """The log-prob the stand-in reports for ``token``: made up, distinct per token mod 5;
    ``original``: the pre-temperature one SGLANG_RETURN_ORIGINAL_LOGPROB asks for."""
    return -(1 + token % 5) / 8 - (1.0 if original else 0.0)


def model_eos(model_path: str) -> set[int]:
    """The model's own EOS ids (generation_config.json), which SGLang stops on unasked."""
    try:
        value = json.loads((Path(model_path) / "generation_config.json").read_text())
    except (OSError, ValueError):
        return set()
    ids = value.get("eos_token_id")
    return set(ids) if isinstance(ids, list) else {ids} if isinstance(ids, int) else set()


def read_shift(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("standin_shift", 0))


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=400)


def create_app(state: State) -> FastAPI:
    app = FastAPI()

    def record(path: str, body: Any) -> None:
        state.calls.append({"path": path, "body": body})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "is_generation": True,
                "weight_version": state.weight_version}

    @app.get("/get_weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": state.weight_version}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        record("/generate", body)
        unknown = set(body) - GENERATE_FIELDS
        params = body.get("sampling_params") or {}
        unknown |= set(params) - SAMPLING_FIELDS
        if unknown:
            return _bad(f"unexpected fields {sorted(unknown)}")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            return _bad("input_ids must be a non-empty list of ints")
        if state.fail_count > 0:
            state.fail_count -= 1
            return JSONResponse({"error": {"message": "injected"}}, status_code=state.fail_status)
        lora = body.get("lora_path")
        if lora is not None and lora not in state.adapters:
            return _bad(f"LoRA adapter {lora!r} is not loaded")
        rid = str(body.get("rid") or uuid.uuid4().hex)
        stops = set(params.get("stop_token_ids") or []) | model_eos(state.model_path)
        budget = int(params.get("max_new_tokens", 128))
        if budget < 1:
            return _bad("max_new_tokens must be positive")
        frames = _frames(state, rid, list(ids), budget, stops, bool(body.get("return_logprob")),
                         state.adapters.get(lora, 0) if lora is not None else 0)
        if body.get("stream"):
            return StreamingResponse(_sse(frames), media_type="text/event-stream")
        last: dict[str, Any] = {}
        async for frame in frames:
            last = frame
        return JSONResponse(last)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await request.json()
        record("/abort_request", body)
        if body.get("abort_all"):
            state.aborted |= state.running
        elif body.get("rid"):
            state.aborted.add(str(body["rid"]))
        return Response(status_code=200)

    @app.post("/pause_generation")
    async def pause(request: Request) -> dict[str, str]:
        body = await request.json() if await request.body() else {}
        record("/pause_generation", body)
        if body.get("mode", "abort") == "abort":
            state.aborted |= state.running
        state.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def resume(request: Request) -> dict[str, str]:
        record("/continue_generation", await request.json() if await request.body() else {})
        state.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update(request: Request) -> JSONResponse:
        body = await request.json()
        record("/update_weights_from_disk", body)
        unknown = set(body) - UPDATE_FIELDS
        if unknown:
            return _bad(f"unexpected fields {sorted(unknown)}")
        try:
            shift = read_shift(str(body.get("model_path", "")))
        except (OSError, ValueError) as exc:
            return JSONResponse({"success": False, "message": f"Failed to load weights: {exc}",
                                 "num_paused_requests": 0}, status_code=400)
        state.shift, state.model_path = shift, str(body["model_path"])
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {state.weight_version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    def lora_reply(error: str | None) -> JSONResponse:
        return JSONResponse({"success": error is None, "error_message": error,
                             "loaded_adapters": dict.fromkeys(state.adapters, "")},
                            status_code=200 if error is None else 400)

    @app.post("/load_lora_adapter")
    async def load_lora(request: Request) -> JSONResponse:
        body = await request.json()
        record("/load_lora_adapter", body)
        unknown = set(body) - {"lora_name", "lora_path", "pinned"}
        if unknown:
            return _bad(f"unexpected fields {sorted(unknown)}")
        name = str(body.get("lora_name", ""))
        if name in state.adapters:
            return lora_reply(f"The LoRA adapter {name} is already loaded")
        try:
            config = json.loads((Path(str(body.get("lora_path"))) / "adapter_config.json")
                                .read_text())
        except (OSError, ValueError) as exc:
            return lora_reply(f"Failed to load LoRA adapter {name}: {exc}")
        state.adapters[name] = int(config.get("standin_shift", 0))
        return lora_reply(None)

    @app.post("/unload_lora_adapter")
    async def unload_lora(request: Request) -> JSONResponse:
        body = await request.json()
        record("/unload_lora_adapter", body)
        if state.adapters.pop(str(body.get("lora_name", "")), None) is None:
            return lora_reply(f"LoRA adapter {body.get('lora_name')!r} is not loaded")
        return lora_reply(None)

    @app.get("/_standin/calls")
    async def calls() -> list[dict[str, Any]]:
        return state.calls

    @app.post("/_standin/reset")
    async def reset() -> dict[str, bool]:
        state.calls.clear()
        state.aborted.clear()
        state.fail_count = 0
        return {"ok": True}

    @app.post("/_standin/fail")
    async def fail(request: Request) -> dict[str, bool]:
        body = await request.json()
        state.fail_status, state.fail_count = int(body["status"]), int(body["count"])
        return {"ok": True}

    return app


async def _frames(state: State, rid: str, ids: list[int], budget: int, stops: set[int],
                  logprobs: bool, lora_shift: int = 0) -> AsyncIterator[dict[str, Any]]:
    state.running.add(rid)
    out: list[int] = []
    try:
        last = ids[-1]
        while True:
            while state.paused and rid not in state.aborted:
                await asyncio.sleep(0.01)
            await asyncio.sleep(state.token_delay_s)
            reason: dict[str, Any] | None
            if rid in state.aborted:
                token, reason = None, {"type": "abort", "message": "Abort request " + rid}
            else:
                token = (last + 1 + state.shift + lora_shift) % VOCAB
                out.append(token)
                last = token
                reason = {"type": "stop", "matched": token} if token in stops else \
                    {"type": "length", "length": budget} if len(out) >= budget else None
            meta: dict[str, Any] = {
                "id": rid, "finish_reason": reason, "prompt_tokens": len(ids),
                "completion_tokens": len(out), "weight_version": state.weight_version}
            if logprobs:
                meta["input_token_logprobs"] = []  # logprob_start_len -1: output tokens only
                meta["output_token_logprobs"] = [
                    [standin_logprob(t, state.original_logprob), t, None] for t in out]
            fresh = [token] if state.incremental and token is not None else \
                [] if state.incremental else list(out)
            yield {"output_ids": fresh, "meta_info": meta}
            if reason is not None:
                return
    finally:
        state.running.discard(rid)


async def _sse(frames: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for frame in frames:
        yield b"data: " + json.dumps(frame).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--incremental-streaming-output", action="store_true")
    parser.add_argument("--token-delay-s", type=float, default=0.002)  # stand-in only
    args, _ = parser.parse_known_args()  # SGLang flags the stand-in has no use for
    original = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true")
    state = State(args.model_path, args.incremental_streaming_output, args.token_delay_s,
                  shift=read_shift(args.model_path), original_logprob=original)
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
