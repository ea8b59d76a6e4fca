"""Runs on a real dataset: tiny-chat on the shipped word problems through REST, the torch
engine and real brokers, scored by ``math`` and by a user's ``python:`` reward; and every bad
input a spec can name failing its run within seconds while the queue goes on.

Each sample's reward is recomputed here, in this process, from the text the samples endpoint
serves (the dataset's prompt, the decoded response, the answer), and the prompts from the run
seed through the model's own tokenizer and chat template; invariants 1-3 hold on top.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run, step_records
from trainer_svc.embedded.tiny_chat import tiny_chat_key
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids
from trainer_svc.inputs.data import DatasetSpec, load_prompts
from trainer_svc.inputs.rewards import math_reward

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "data" / "word-problems-train.jsonl")
HELD_OUT = str(ROOT / "examples" / "data" / "word-problems-eval.jsonl")
MODULE = "i12a_judge_rewards"
USER_REWARDS = '''
def judge(prompt, response, answer):
    """1.0 for the right final number; raises on every response of a length divisible by 3."""
    if len(response) % 3 == 0:
        raise ValueError(f"cannot judge {response!r}")
    return float(response.rsplit("####", 1)[-1].strip() == answer.rsplit("#### ", 1)[1])
'''
TINY_RUN = {"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2}
BASE = {"model": "tiny-chat", "dataset": {"path": TRAIN}, "steps": 2, "prompts_per_step": 4,
        "samples_per_prompt": 4, "max_new_tokens": 16, "learning_rate": 2e-4, "seed": 0}


@pytest.fixture
def reward_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rewards"
    d.mkdir()
    (d / f"{MODULE}.py").write_text(USER_REWARDS)
    return d


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path, reward_dir: Path) -> Iterator[Cluster]:
    # The test's bad files lie in tmp_path: a dataset root beside the shipped examples.
    c = start_cluster(tmp_path, brokers, spot=1, reserved=1,
                      env={"RLBOOST_REWARD_PATH": str(reward_dir),
                           "RLBOOST_DATASET_ROOTS": f"{tmp_path}:{ROOT / 'examples'}"})
    try:
        yield c
    finally:
        c.stop()


def user_judge(reward_dir: Path) -> Callable[[str, str, str | None], float]:
    sys.path.insert(0, str(reward_dir))
    try:
        fn: Callable[[str, str, str | None], float] = importlib.import_module(MODULE).judge
    finally:
        sys.path.remove(str(reward_dir))
    return fn


def raises(fn: Callable[[str, str, str | None], float], s: dict[str, Any]) -> bool:
    try:
        fn(s["prompt"], s["response_text"], s["answer"])
    except ValueError:
        return True
    return False


def test_tiny_chat_learns_from_the_word_problems_with_math_and_user_rewards(
        cluster: Cluster, tmp_path: Path, reward_dir: Path) -> None:
    math_spec = {**BASE, "reward": "math", "eval": {"path": HELD_OUT, "every": 2}}
    user_spec = {**BASE, "reward": f"python:{MODULE}:judge"}
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        ids = [client.post("/v1/runs", json=s).json()["id"] for s in (math_spec, user_spec)]
        # The first includes building tiny-chat: about a minute of CPU, ten under heavy load.
        finals = [wait_run(client, i, timeout_s=1500, cluster=cluster) for i in ids]
        assert [f["state"] for f in finals] == ["succeeded", "succeeded"], finals

        model_dir = tmp_path / "data" / "models" / f"tiny-chat-{tiny_chat_key(0)}"
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        chat = ChatFormat(tokenizer)
        ends = eos_token_ids(model_dir, tokenizer)  # engines stop on each EOS id
        train = load_prompts(DatasetSpec(TRAIN), require_answer=True)

        def prompts(step: int) -> list[list[int]]:
            return [chat.render(e.prompt).prompt_token_ids for e in train.draw(0, step, 4)]

        def math_of(s: dict[str, Any]) -> float:
            return math_reward(s["prompt"], s["response_text"], s["answer"])

        judge = user_judge(reward_dir)

        def judge_of(s: dict[str, Any]) -> float:
            return 0.0 if raises(judge, s) else judge(s["prompt"], s["response_text"], s["answer"])

        checked = []
        for run_id, spec, reward in ((ids[0], math_spec, math_of), (ids[1], user_spec, judge_of)):
            by_step = check_run(client, run_id, spec, prompts=prompts, eos_id=ends,
                                sample_reward=reward)
            checked.append(by_step)
            for step, samples in by_step.items():
                drawn = train.draw(0, step, 4)
                for s in samples:
                    example = drawn[s["prompt_index"]]
                    assert (s["prompt"], s["answer"]) == (example.prompt, example.answer)
                    assert s["prompt_text"] == chat.render(example.prompt).prompt_text
                    assert s["response_text"] == chat.decode(s["response_token_ids"])

        math_records = step_records(client, ids[0])
        assert [r["reward_errors"] for r in math_records] == [0, 0]
        assert 0.0 <= math_records[0]["eval_reward_mean"] <= 1.0
        assert math_records[0]["eval_responses"] == 200  # the whole held-out file, step 0 only
        assert "eval_reward_mean" not in math_records[1]

        # A reward that raises: those samples score 0, each call is counted, the run goes on.
        failing = {step: sum(raises(judge, s) for s in samples)
                   for step, samples in checked[1].items()}
        assert sum(failing.values()) > 0, "the judge never raised: the test proves nothing"
        assert [r["reward_errors"] for r in step_records(client, ids[1])] == \
            [failing[0], failing[1]]
        metric = re.search(r"^rlboost_reward_errors_total (\S+)$", client.get("/metrics").text,
                           re.M)
        assert metric and float(metric.group(1)) == sum(failing.values())


def test_bad_data_and_reward_specs_fail_fast_and_the_queue_goes_on(
        cluster: Cluster, tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "questions.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    missing = str(tmp_path / "nope.jsonl")
    (tmp_path / "link.jsonl").symlink_to(ROOT / "pyproject.toml")  # a root's name, not its file
    bad = [
        ({**BASE, "dataset": {"path": str(tmp_path / "link.jsonl")}},
         ["link.jsonl", "outside the dataset roots"]),
        ({**BASE, "reward": "python:math_verify:parse"},  # installed, not on the reward path
         ["python:math_verify:parse", "No module named 'math_verify' in the reward path"]),
        ({**BASE, "dataset": {"path": missing}}, [missing, "no such file"]),
        ({**BASE, "dataset": {"path": str(tmp_path / "questions.jsonl")}},
         ["questions.jsonl", "'prompt'", "question"]),
        ({**BASE, "dataset": {"path": str(tmp_path / "empty.jsonl")}},
         ["empty.jsonl", "the dataset is empty"]),
        ({**BASE, "reward": "python:i12a_not_there:fn"},
         ["python:i12a_not_there:fn", "No module named"]),
    ]
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        refused = client.post("/v1/runs", json={**BASE, "reward": "maths"})
        assert refused.status_code == 422 and "reward" in str(refused.json()["detail"])
        refused = client.post("/v1/runs", json={**BASE, "dataset": {"path": "/etc/passwd"}})
        assert refused.status_code == 422 and "outside the dataset roots" in refused.text
        # A run first, so the clock below starts with a trainer that is up (importing torch
        # alone can take a minute on a loaded machine).
        first = client.post("/v1/runs", json=TINY_RUN).json()["id"]
        assert wait_run(client, first, timeout_s=300, cluster=cluster)["state"] == "succeeded"
        submitted = time.monotonic()
        ids = [client.post("/v1/runs", json=spec).json()["id"] for spec, _ in bad]
        good = client.post("/v1/runs", json=TINY_RUN).json()["id"]
        for run_id, (_, words) in zip(ids, bad, strict=True):
            final = wait_run(client, run_id, timeout_s=60, cluster=cluster)
            assert final["state"] == "failed", final
            for word in words:
                assert word in final["error"], (word, final["error"])
        assert time.monotonic() - submitted < 60, "bad specs must fail before any model build"
        assert wait_run(client, good, timeout_s=240, cluster=cluster)["state"] == "succeeded"
