"""TorchEngine on a tiny random Qwen2: keyed sampling, batching, resume, abort, EOS, swaps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rollout_svc.engines import (
    EngineError,
    GenRequest,
    TokenEvent,
    create_engine,
    generation_eos_ids,
    torch_engine,
)
from rollout_svc.engines.torch_engine import TorchEngine
from shared.generation import DrawKey, generate

VOCAB = 16
EOS = 15


def _save_model(path: Path, seed: int, layers: int = 2) -> Path:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("models")
    return (
        _save_model(root / "v1", seed=1),
        _save_model(root / "v2", seed=2),
        _save_model(root / "deep", seed=3, layers=3),
    )


def _req(i: int, committed: list[int] | None = None, **kw: object) -> GenRequest:
    fields: dict[str, object] = dict(
        request_id=f"r{i}",
        prompt_token_ids=[(3 * i + j) % 14 + 1 for j in range(2 + 3 * i % 7)],
        committed_token_ids=committed or [],
        max_new_tokens=12,
        temperature=1.0,
        seed=11,
        step=0,
        prompt_index=i,
        sample_index=i % 3,
        eos_token_id=EOS,
        weight_version=1,
    )
    fields.update(kw)
    return GenRequest(**fields)  # type: ignore[arg-type]


def _engine(model_dir: Path, version: int = 1, **options: object) -> TorchEngine:
    # One thread: on a small shared CPU the intra-op pool costs more than tiny matmuls gain.
    engine = TorchEngine(threads=1, **options)  # type: ignore[arg-type]
    engine.load(model_dir, "run", version)
    return engine


def _run(engine: TorchEngine, reqs: list[GenRequest]) -> dict[str, list[TokenEvent]]:
    for req in reqs:
        engine.add(req)
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in reqs}
    while engine.has_work():
        for event in engine.step():
            out[event.request_id].append(event)
    return out


def _tokens(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events]


def _check_well_formed(req: GenRequest, events: list[TokenEvent]) -> None:
    start = len(req.committed_token_ids)
    assert [e.position for e in events] == list(range(start, start + len(events)))
    assert [e.finished for e in events] == [False] * (len(events) - 1) + [True]
    last = events[-1]
    if last.finish_reason == "stop":
        assert last.token_id == req.eos_token_id
    else:
        assert last.finish_reason == "length" and last.position == req.max_new_tokens - 1
    assert req.eos_token_id not in _tokens(events[:-1])


def test_batched_generation_equals_each_request_alone(model_dirs: tuple[Path, ...]) -> None:
    reqs = [_req(i) for i in range(6)] + [_req(6, temperature=0.0)]
    batched = _run(_engine(model_dirs[0], max_batch=4), reqs)  # two waves, ragged prompts
    for req in reqs:
        alone = _run(_engine(model_dirs[0]), [req])[req.request_id]
        assert _tokens(batched[req.request_id]) == _tokens(alone)
        _check_well_formed(req, alone)
    reasons = {events[-1].finish_reason for events in batched.values()}
    assert reasons == {"stop", "length"}, "the fixture should exercise both endings"


def test_resume_from_committed_prefix_continues_identically(
    model_dirs: tuple[Path, ...],
) -> None:
    reqs = [_req(i, max_new_tokens=20) for i in range(4)]
    full = {rid: _tokens(ev) for rid, ev in _run(_engine(model_dirs[0]), reqs).items()}
    engine = _engine(model_dirs[0])  # a different engine: the "other instance"
    resumed = 0
    for i, req in enumerate(reqs):
        response = full[req.request_id]
        for k in sorted({1, len(response) // 2, len(response) - 1} - {0}):
            moved = _req(i, response[:k], max_new_tokens=20, request_id=f"{req.request_id}@{k}")
            got = _run(engine, [moved])[moved.request_id]
            _check_well_formed(moved, got)
            assert _tokens(got) == response[k:]
            resumed += 1
    assert resumed >= 4


def test_cached_batched_logits_equal_unbatched_full_forward(
    model_dirs: tuple[Path, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[tuple[str, int], torch.Tensor] = {}
    real = torch_engine.sample_token

    def recording(logits: torch.Tensor, temperature: float, key: DrawKey, position: int) -> int:
        seen[(f"r{key.prompt_index}", position)] = logits.clone()  # _req(i) keys prompt i
        return real(logits, temperature, key, position)

    monkeypatch.setattr(torch_engine, "sample_token", recording)
    reqs = [_req(i, max_new_tokens=10) for i in range(5)]
    reqs[2].committed_token_ids = [3, 4, 5]
    engine = _engine(model_dirs[0])
    out = _run(engine, reqs)
    model = engine._model
    checked = 0
    with torch.inference_mode():
        for req in reqs:
            response = req.committed_token_ids + _tokens(out[req.request_id])
            for event in out[req.request_id]:
                context = req.prompt_token_ids + response[: event.position]
                full = model(input_ids=torch.tensor([context])).logits[0, -1]
                torch.testing.assert_close(
                    seen[(req.request_id, event.position)], full, atol=1e-5, rtol=1e-5
                )
                checked += 1
    assert checked == len(seen) and checked > 10


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_each_event_carries_the_logprob_of_its_sampling_distribution(
    model_dirs: tuple[Path, ...], temperature: float
) -> None:
    """Every token's logprob is log_softmax(logits * s)[token] with s = 1/T (1 when greedy), as
    the trainer scores it: checked against a float64 teacher-forced forward of the whole
    prompt + response. Tolerance 1e-4: the existing check above holds the engine's cached,
    batched logits within 1e-5 of the full forward's; log_softmax moves by at most twice the
    largest logit change times s (<= 2 here), and float32 rounding adds ~1e-6 at these
    magnitudes. A wrong scale (1/T at T=0.5 is 2x) or a neighbour's token is off by >> 1e-2."""
    reqs = [_req(i, max_new_tokens=10, temperature=temperature) for i in range(5)]
    reqs[2].committed_token_ids = [3, 4, 5]  # resumed: positions start at 3
    engine = _engine(model_dirs[0], max_batch=3)  # two waves
    out = _run(engine, reqs)
    model = engine._model
    scale = 1.0 if temperature == 0 else 1.0 / temperature
    checked, wrong_scale = 0, 0.0
    with torch.inference_mode():
        for req in reqs:
            events = out[req.request_id]
            response = req.committed_token_ids + _tokens(events)
            ids = torch.tensor([req.prompt_token_ids + response])
            logits = model(input_ids=ids).logits[0, :-1].double()
            expected = torch.log_softmax(logits * scale, dim=-1).gather(-1, ids[0, 1:, None])
            unscaled = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])
            start = len(req.prompt_token_ids) - 1
            for event in events:
                assert event.logprob is not None and event.logprob <= 0.0
                at = start + event.position
                assert abs(event.logprob - float(expected[at])) <= 1e-4, (req, event)
                wrong_scale = max(wrong_scale, abs(event.logprob - float(unscaled[at])))
                checked += 1
            if not req.committed_token_ids:
                # The draws are unchanged: the trainer's sampler gives the same ids.
                key = DrawKey(req.seed, req.step, req.prompt_index, req.sample_index)
                again = generate(model, [req.prompt_token_ids], req.max_new_tokens, temperature,
                                 {EOS}, [key])[0]
                assert _tokens(events) == again
    assert checked > 20
    # The tolerance tells the scale apart: unscaled log-probs would be far off it.
    assert scale == 1.0 or wrong_scale > 1e-2


def test_abort_stops_events_for_that_request(model_dirs: tuple[Path, ...]) -> None:
    engine = _engine(model_dirs[0])
    reqs = [_req(i, max_new_tokens=30, eos_token_id=99) for i in range(3)]  # no early stop
    queued = _req(7, max_new_tokens=30, eos_token_id=99)
    for req in reqs:
        engine.add(req)
    first = engine.step()
    assert {e.request_id for e in first} == {"r0", "r1", "r2"}
    engine.add(queued)  # waits for the next wave
    engine.abort("r1")
    engine.abort("r7")
    rest: list[TokenEvent] = []
    while engine.has_work():
        rest += engine.step()
    assert "r1" not in {e.request_id for e in rest} and "r7" not in {e.request_id for e in rest}
    assert len([e for e in rest if e.request_id == "r0"]) == 29


def test_drain_returns_queued_and_active_ids(model_dirs: tuple[Path, ...]) -> None:
    engine = _engine(model_dirs[0], max_batch=2)
    for i in range(3):
        engine.add(_req(i, eos_token_id=99))
    engine.step()  # r0, r1 active; r2 queued
    engine.add(_req(5))
    assert sorted(engine.drain()) == ["r0", "r1", "r2", "r5"]
    assert not engine.has_work() and engine.step() == []


def test_eos_and_length_endings(model_dirs: tuple[Path, ...]) -> None:
    engine = _engine(model_dirs[0])
    greedy = _tokens(_run(engine, [_req(0, temperature=0.0, eos_token_id=99)])["r0"])
    assert len(greedy) == 12
    # EOS is the first greedy token: stop at position 0 with EOS included.
    stop = _run(engine, [_req(0, temperature=0.0, eos_token_id=greedy[0])])["r0"]
    assert [(e.token_id, e.position, e.finish_reason) for e in stop] == [(greedy[0], 0, "stop")]
    unused = next(t for t in range(VOCAB) if t not in greedy)
    length = _run(engine, [_req(0, temperature=0.0, eos_token_id=unused)])["r0"]
    assert _tokens(length) == greedy and length[-1].finish_reason == "length"
    # Already finished on arrival: one closing event re-stating the last committed token.
    done = _run(engine, [_req(1, committed=[4, EOS]), _req(2, committed=[4] * 12)])
    assert done["r1"] == [TokenEvent("r1", EOS, 1, True, "stop")]
    assert done["r2"] == [TokenEvent("r2", 4, 11, True, "length")]


@pytest.mark.parametrize("listed", [False, True])
def test_every_generation_config_eos_stops(model_dirs: tuple[Path, ...], tmp_path: Path,
                                           listed: bool) -> None:
    """A chat model ends its turn with a token of generation_config, not the request's EOS."""
    free = _tokens(_run(_engine(model_dirs[0]), [_req(0, eos_token_id=99)])["r0"])
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    model = shutil.copytree(model_dirs[0], tmp_path / "chat")
    ends = [98, free[k]] if listed else free[k]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    engine = _engine(model)
    events = _run(engine, [_req(0, eos_token_id=99)])["r0"]
    assert _tokens(events) == free[:k + 1]  # the same keyed draws, cut at the model's EOS
    assert events[-1].finish_reason == "stop" and not any(e.finished for e in events[:-1])
    moved = _run(engine, [_req(1, committed=[4, free[k]], eos_token_id=99)])["r1"]
    assert moved == [TokenEvent("r1", free[k], 1, True, "stop")]


@pytest.mark.parametrize(("config", "ids"), [
    ({"eos_token_id": 7}, {7}), ({"eos_token_id": [7, 3]}, {3, 7}), ({}, set()),
    ({"eos_token_id": None}, set()), ({"eos_token_id": ["7", -1, True]}, set()), ([], set()),
])
def test_generation_eos_ids(tmp_path: Path, config: object, ids: set[int]) -> None:
    assert generation_eos_ids(tmp_path) == frozenset()  # no file
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert generation_eos_ids(tmp_path) == ids


def test_weight_swap_in_place_and_fallback(model_dirs: tuple[Path, ...]) -> None:
    v1, v2, deep = model_dirs
    reqs = [_req(i) for i in range(4)]
    engine = _engine(v1)
    before = _tokens(_run(engine, reqs)["r0"])
    model = engine._model
    engine.load(v2, "run", 2)
    assert engine.loaded == ("run", 2) and engine._model is model  # swapped in place
    with pytest.raises(EngineError):
        engine.add(_req(0))  # still asks for version 1
    reqs2 = [_req(i, weight_version=2) for i in range(4)]
    after = {k: _tokens(v) for k, v in _run(engine, reqs2).items()}
    fresh = {k: _tokens(v) for k, v in _run(_engine(v2, version=2), reqs2).items()}
    assert after == fresh  # the in-place swap is exactly a fresh load
    assert after["r0"] != before or after != {
        k: _tokens(v) for k, v in _run(_engine(v1), reqs).items()
    }
    engine.load(deep, "run", 3)  # a different architecture: full reload
    assert engine._model is not model and engine._model.config.num_hidden_layers == 3
    engine.add(_req(0, weight_version=3))
    engine.step()
    with pytest.raises(EngineError):
        engine.load(v1, "run", 4)  # refuses under active work


def test_create_engine() -> None:
    assert create_engine("torch", max_batch=3).max_batch == 3  # type: ignore[attr-defined]
    sglang = create_engine("sglang", url="http://127.0.0.1:9")  # attaches lazily, at load
    assert sglang.name == "sglang" and sglang.loaded is None
    with pytest.raises(EngineError):
        create_engine("vllm")
    with pytest.raises(EngineError):
        TorchEngine().add(_req(0))  # nothing loaded
