"""SGLangEngine against a stand-in that follows SGLang's HTTP API (tests/support/sglang_standin.py).

The stand-in runs as a real process on a free port and records every call, so each test checks
both what the engine emits and what it sent: input_ids = prompt + committed tokens and the
remaining budget on resume, abort_request with the stream's rid, pause -> update_weights_from_disk
(model_path, weight_version) -> continue on load, and EngineError for each way a server fails;
every EOS id of the loaded version's generation_config as a stop token, and a chat-templated
prompt passed through as input_ids, never as text.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout_svc.engines import EngineError, GenRequest, TokenEvent
from rollout_svc.engines.sglang import SGLangEngine, output_logprob
from shared.ports import free_port, wait_port
from tests.support.sglang_standin import VOCAB, standin_logprob
from trainer_svc.embedded.tiny_chat import train_tokenizer
from trainer_svc.inputs.chat import ChatFormat

EOS = 2


def model_dir(root: Path, name: str, shift: int) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"standin_shift": shift}))
    return path


def start_standin(model: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.sglang_standin", "--model-path",
                             str(model), "--port", str(port), *flags])
    wait_port(port)
    return proc


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """One stand-in (SGLang's default, cumulative streaming) for the module; tests reset it."""
    root = tmp_path_factory.mktemp("models")
    model_dir(root, "v0", 0)
    model_dir(root, "v1", 3)
    port = free_port()
    proc = start_standin(root / "v0", port)
    try:
        yield f"http://127.0.0.1:{port}", root
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def engine(standin: tuple[str, Path]) -> Iterator[SGLangEngine]:
    url, root = standin
    httpx.post(f"{url}/_standin/reset")
    eng = SGLangEngine(url=url, start_timeout_s=10)
    eng.load(root / "v0", "run", 0)
    httpx.post(f"{url}/_standin/reset")
    try:
        yield eng
    finally:
        eng.drain()
        eng.close()


def calls(url: str, path: str) -> list[dict[str, Any]]:
    return [c["body"] for c in httpx.get(f"{url}/_standin/calls").json() if c["path"] == path]


def req(rid: str, prompt: list[int], committed: list[int] | None = None, budget: int = 8,
        version: int = 0, eos: int = EOS) -> GenRequest:
    return GenRequest(request_id=rid, prompt_token_ids=prompt, committed_token_ids=committed or [],
                      max_new_tokens=budget, temperature=1.0, seed=0, step=0, prompt_index=0,
                      sample_index=0, eos_token_id=eos, weight_version=version)


NEVER = VOCAB + 1  # an EOS the stand-in never samples: the request runs until aborted


def run_all(eng: SGLangEngine, timeout_s: float = 10.0) -> dict[str, list[TokenEvent]]:
    out: dict[str, list[TokenEvent]] = {}
    end = time.monotonic() + timeout_s
    while eng.has_work():
        assert time.monotonic() < end, "engine did not finish"
        for ev in eng.step():
            out.setdefault(ev.request_id, []).append(ev)
    return out


def check_logprobs(events: list[TokenEvent]) -> None:
    """Each event carries the server's log-prob of its own token (none may be missing)."""
    assert [e.logprob for e in events] == [standin_logprob(e.token_id) for e in events]


def check_streams(engine: SGLangEngine) -> None:
    engine.add(req("a", [7, 10]))  # 11..18: the budget ends it
    engine.add(req("b", [45], budget=20))  # 46..49, 0, 1, 2: EOS ends it
    out = run_all(engine)
    a, b = out["a"], out["b"]
    assert [e.token_id for e in a] == list(range(11, 19))
    assert [e.position for e in a] == list(range(8))
    assert [e.finished for e in a] == [False] * 7 + [True] and a[-1].finish_reason == "length"
    assert [e.token_id for e in b] == [46, 47, 48, 49, 0, 1, 2]
    assert b[-1].finished and b[-1].finish_reason == "stop"
    assert not any(e.finished for e in b[:-1])
    check_logprobs(a)
    check_logprobs(b)


def test_streams_token_events_with_positions_and_finish_reasons(engine: SGLangEngine) -> None:
    check_streams(engine)


def test_streams_incremental_frames_the_same_way(tmp_path: Path) -> None:
    """SGLang's --incremental-streaming-output sends only new ids per frame; same events."""
    port = free_port()
    proc = start_standin(model_dir(tmp_path, "v0", 0), port, "--incremental-streaming-output")
    eng = SGLangEngine(url=f"http://127.0.0.1:{port}", start_timeout_s=10)
    try:
        eng.load(tmp_path / "v0", "run", 0)
        check_streams(eng)
        eng.add(req("r", [7, 10], committed=[11, 12, 13], budget=8))
        resumed = run_all(eng)["r"]
        assert [e.token_id for e in resumed] == [14, 15, 16, 17, 18]
        check_logprobs(resumed)
    finally:
        eng.close()
        proc.terminate()
        proc.wait(timeout=10)


def test_resume_sends_prompt_plus_committed_and_remaining_budget(
        engine: SGLangEngine, standin: tuple[str, Path]) -> None:
    engine.add(req("r", [7, 10], committed=[11, 12, 13], budget=8))
    events = run_all(engine)["r"]
    assert [(e.position, e.token_id) for e in events] == [(3, 14), (4, 15), (5, 16), (6, 17),
                                                          (7, 18)]
    check_logprobs(events)  # the stream's first output token is position 3's
    sent = calls(standin[0], "/generate")
    assert len(sent) == 1
    assert sent[0]["input_ids"] == [7, 10, 11, 12, 13]
    assert sent[0]["sampling_params"]["max_new_tokens"] == 5
    assert sent[0]["sampling_params"]["stop_token_ids"] == [EOS]
    assert sent[0]["stream"] is True and sent[0]["rid"].startswith("r.")
    assert sent[0]["return_logprob"] is True and "logprob_start_len" not in sent[0]


def test_every_generation_config_eos_is_a_stop_token(
        engine: SGLangEngine, standin: tuple[str, Path]) -> None:
    url, root = standin
    chat = model_dir(root, "chat", 0)
    (chat / "generation_config.json").write_text(json.dumps({"eos_token_id": [10, 5]}))
    engine.load(chat, "run", 1)
    engine.add(req("turn", [7], budget=20, version=1))  # 8, 9, then 10: the end of its turn
    engine.add(req("moved", [3], committed=[4, 5], version=1))  # ended at an EOS, then moved
    out = run_all(engine)
    assert [(e.token_id, e.position, e.finish_reason) for e in out["turn"]] == [
        (8, 0, None), (9, 1, None), (10, 2, "stop")]
    assert [(e.token_id, e.position, e.finish_reason) for e in out["moved"]] == [(5, 1, "stop")]
    sent = calls(url, "/generate")
    assert [s["sampling_params"]["stop_token_ids"] for s in sent] == [[EOS, 5, 10]]
    assert sent[0]["input_ids"] == [7] and sent[0]["sampling_params"]["max_new_tokens"] == 20


def test_a_chat_templated_prompt_goes_as_input_ids(
        engine: SGLangEngine, standin: tuple[str, Path]) -> None:
    tokenizer = train_tokenizer()
    rendered = ChatFormat(tokenizer, system_prompt="Answer briefly.").render("What is 2 + 3?")
    assert rendered.prompt in rendered.prompt_text != rendered.prompt  # the template wrote
    engine.add(req("chat", rendered.prompt_token_ids, budget=2, eos=NEVER))
    assert len(run_all(engine)["chat"]) == 2
    [sent] = calls(standin[0], "/generate")
    assert sent["input_ids"] == rendered.prompt_token_ids and "text" not in sent
    assert tokenizer.decode(sent["input_ids"]) == rendered.prompt_text


def test_finished_on_arrival_sends_nothing(engine: SGLangEngine, standin: tuple[str, Path]
                                           ) -> None:
    engine.add(req("done", [5], committed=[6, EOS]))
    events = run_all(engine)["done"]
    assert [(e.token_id, e.position, e.finished) for e in events] == [(EOS, 1, True)]
    assert calls(standin[0], "/generate") == []


def test_abort_calls_abort_request_and_silences_the_request(
        engine: SGLangEngine, standin: tuple[str, Path]) -> None:
    engine.add(req("long", [0], budget=10_000, eos=NEVER))
    got: list[TokenEvent] = []
    end = time.monotonic() + 10
    while len(got) < 3:
        assert time.monotonic() < end
        got += engine.step()
    engine.abort("long")
    assert not engine.has_work()
    time.sleep(0.2)
    assert engine.step() == []
    rid = calls(standin[0], "/generate")[0]["rid"]
    end = time.monotonic() + 5
    while not calls(standin[0], "/abort_request") and time.monotonic() < end:
        time.sleep(0.02)
    assert calls(standin[0], "/abort_request") == [{"rid": rid}]


def test_load_pauses_updates_with_version_and_continues(
        engine: SGLangEngine, standin: tuple[str, Path]) -> None:
    url, root = standin
    engine.load(root / "v1", "run", 1)
    log = [c for c in httpx.get(f"{url}/_standin/calls").json()
           if c["path"] in ("/pause_generation", "/update_weights_from_disk",
                            "/continue_generation")]
    assert [c["path"] for c in log] == ["/pause_generation", "/update_weights_from_disk",
                                        "/continue_generation"]
    assert log[1]["body"] == {"model_path": str(root / "v1"), "weight_version": "1"}
    assert engine.loaded == ("run", 1)
    assert httpx.get(f"{url}/get_weight_version").json() == {"weight_version": "1"}
    with pytest.raises(EngineError):
        engine.add(req("old", [7], version=0))  # on-policy guard
    engine.add(req("new", [7], budget=3, version=1))
    assert [e.token_id for e in run_all(engine)["new"]] == [(7 + 4) % VOCAB, 15, 19]


def test_load_refuses_under_work_and_reports_a_failed_update(
        engine: SGLangEngine, standin: tuple[str, Path]) -> None:
    url, root = standin
    engine.add(req("busy", [0], budget=10_000, eos=NEVER))
    with pytest.raises(EngineError, match="active"):
        engine.load(root / "v1", "run", 1)
    engine.abort("busy")
    with pytest.raises(EngineError, match="update_weights_from_disk"):
        engine.load(root / "missing", "run", 1)
    assert engine.loaded is None  # nothing is generated on weights in an unknown state
    assert calls(url, "/continue_generation"), "a failed update must not leave the server paused"


@pytest.mark.parametrize("status", [400, 500])
def test_generate_failures_raise_engine_error_from_step(
        engine: SGLangEngine, standin: tuple[str, Path], status: int) -> None:
    url = standin[0]
    httpx.post(f"{url}/_standin/fail", json={"status": status, "count": 5})
    engine.add(req("x", [1]))
    with pytest.raises(EngineError, match=f"HTTP {status}"):
        run_all(engine)
    # A 400 is the request's fault: no retry. A 500 is retried (resumed) before giving up.
    assert len(calls(url, "/generate")) == (1 if status == 400 else 3)


def test_a_transient_failure_resumes_the_stream(engine: SGLangEngine,
                                                standin: tuple[str, Path]) -> None:
    httpx.post(f"{standin[0]}/_standin/fail", json={"status": 503, "count": 1})
    engine.add(req("t", [7, 10]))
    events = run_all(engine)["t"]
    assert [e.token_id for e in events] == list(range(11, 19))
    check_logprobs(events)


def test_a_logprob_entry_counts_only_for_its_own_token() -> None:
    entries = [[-0.5, 11, None], [-0.25, 12, "x"], [None, 13, None], [-1, 14]]
    assert output_logprob(entries, 0, 11) == -0.5 and output_logprob(entries, 1, 12) == -0.25
    assert output_logprob(entries, 3, 14) == -1.0
    assert output_logprob(entries, 0, 12) is None  # another token's: never misattributed
    assert output_logprob(entries, 2, 13) is None and output_logprob(entries, 4, 15) is None
    assert output_logprob(None, 0, 11) is None  # a server that sends none


def test_unreachable_server_is_an_engine_error(tmp_path: Path) -> None:
    eng = SGLangEngine(url=f"http://127.0.0.1:{free_port()}", start_timeout_s=0.5)
    with pytest.raises(EngineError, match="no healthy SGLang server"):
        eng.load(model_dir(tmp_path, "v0", 0), "run", 0)
    eng.close()


def test_starts_its_own_server_at_first_load_and_stops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Set here, it would make the server report pre-temperature log-probs: it must not pass.
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    launch = (sys.executable, "-m", "tests.support.sglang_standin")
    eng = SGLangEngine(launch_cmd=launch, start_timeout_s=30)
    eng.load(model_dir(tmp_path, "v0", 0), "run", 0)
    assert eng.url is not None and eng._owned is not None
    eng.add(req("s", [7, 10], budget=3))
    events = run_all(eng)["s"]
    assert [e.token_id for e in events] == [11, 12, 13]
    check_logprobs(events)
    proc = eng._owned
    eng.close()
    assert proc.poll() is not None, "close() must stop the server it started"


def adapter(root: Path, name: str, shift: int) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "standin_shift": shift,
                                                          "target_modules": ["q_proj"]}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_adapter_versions_go_through_the_lora_api(engine: SGLangEngine,
                                                  standin: tuple[str, Path]) -> None:
    """An adapter version on the loaded base is one /load_lora_adapter, named in every
    /generate's lora_path; the next unloads the one before; a full version unloads the last;
    the base is put in place only when it is not the one loaded."""
    url, root = standin
    engine.load_adapter(root / "v0", adapter(root, "a1", 5), "run", 1)
    assert calls(url, "/update_weights_from_disk") == []  # v0 is the loaded base already
    assert calls(url, "/load_lora_adapter") == [{"lora_name": "run-v1",
                                                 "lora_path": str(root / "a1")}]
    engine.add(req("a", [7], budget=3, version=1))
    assert [e.token_id for e in run_all(engine)["a"]] == [13, 19, 25]  # base shift 0, +5
    assert calls(url, "/generate")[-1]["lora_path"] == "run-v1"

    engine.load_adapter(root / "v0", adapter(root, "a2", 1), "run", 2)
    assert calls(url, "/load_lora_adapter")[-1]["lora_name"] == "run-v2"
    assert calls(url, "/unload_lora_adapter") == [{"lora_name": "run-v1"}]
    engine.add(req("b", [7], budget=2, version=2))
    assert [e.token_id for e in run_all(engine)["b"]] == [9, 11]

    engine.load(root / "v1", "run", 3)  # a full version: no adapter any more
    assert calls(url, "/unload_lora_adapter")[-1] == {"lora_name": "run-v2"}
    engine.add(req("c", [7], budget=1, version=3))
    run_all(engine)
    assert "lora_path" not in calls(url, "/generate")[-1]

    # Over another base: that base first, then the adapter.
    engine.load_adapter(root / "v0", adapter(root, "a4", 2), "run", 4)
    assert calls(url, "/update_weights_from_disk")[-1]["model_path"] == str(root / "v0")
    assert engine.loaded == ("run", 4)
    with pytest.raises(EngineError, match="load_lora_adapter"):
        engine.load_adapter(root / "v0", root / "missing", "run", 5)
    assert engine.loaded is None
