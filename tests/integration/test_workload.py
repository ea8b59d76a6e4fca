"""A run's workload: dataset prompts through the chat template, rewards in worker processes,
and every bad input a spec can name failing fast with an error that says what and why."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.protocol import decode
from shared.sources import default_dataset_roots
from shared.spec import RunSpec
from trainer_svc.embedded import task
from trainer_svc.embedded import tiny_chat as tc
from trainer_svc.errors import RunSpecError
from trainer_svc.workload import DatasetWorkload, TaskWorkload, open_workload

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "data" / "word-problems-train.jsonl"
USER_REWARDS = '''
def final_digit(prompt, response, answer):
    if "boom" in response:
        raise RuntimeError("user code failed")
    return float(response.strip().endswith(answer.rsplit("#### ", 1)[1]))
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tiny-chat with a three-step warm-up: its tokenizer and template are the real ones."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tc, "WARMUP_STEPS", 3)
        yield tc.build_tiny_chat(tmp_path_factory.mktemp("data"), seed=0)


def spec(**fields: Any) -> RunSpec:
    body = {"model": "tiny-chat", "dataset": {"path": str(TRAIN)}, "prompts_per_step": 3,
            **fields}
    return decode(json.dumps(body).encode(), RunSpec)


async def open_(run: RunSpec, tmp_path: Path, reward_path: list[str] | None = None) -> Any:
    # The test's own directory stands for RLBOOST_DATA_DIR, as the default roots have it.
    return await open_workload(run, tmp_path, reward_path or [], 5.0,
                               dataset_roots=default_dataset_roots(tmp_path))


async def test_prompts_are_drawn_by_seed_and_templated(model_dir: Path, tmp_path: Path) -> None:
    run = spec(system_prompt="Answer with #### and the number.")
    work = await open_(run, tmp_path)
    try:
        assert isinstance(work, DatasetWorkload)
        work.use_model(model_dir, task.reward)
        first = work.prompts(4)
        assert [p.prompt for p in first] == [e.prompt for e in work.train.draw(run.seed, 4, 3)]
        assert [p.prompt for p in work.prompts(4)] == [p.prompt for p in first]
        assert [p.prompt for p in work.prompts(5)] != [p.prompt for p in first]
        p = first[0]
        assert p.prompt_text.startswith(f"{tc.IM_START}system\nAnswer with #### and the number.")
        assert f"{tc.IM_START}user\n{p.prompt}{tc.IM_END}" in p.prompt_text
        assert p.prompt_text.endswith(f"{tc.IM_START}assistant\n") and p.answer
        assert work.chat is not None
        assert p.token_ids == work.chat.tokenizer(p.prompt_text,
                                                  add_special_tokens=False)["input_ids"]
        assert work.eos_token_id == tc.token_id(work.chat.tokenizer, tc.IM_END)
        # The math reward on the dataset's own answer: right; on a wrong number: wrong.
        right = work.chat.tokenizer(p.answer, add_special_tokens=False)["input_ids"]
        scored = await work.score(p, [[*right, work.eos_token_id], [5]])
        assert scored.rewards[0] == 1.0 and scored.texts[0] == p.answer
        assert scored.errors == 0
    finally:
        await work.close()


async def test_a_user_reward_that_raises_scores_zero_and_is_counted(
        model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "rewards").mkdir()
    (tmp_path / "rewards" / "i12a_wl_rewards.py").write_text(USER_REWARDS)
    work = await open_(spec(reward="python:i12a_wl_rewards:final_digit"), tmp_path,
                       [str(tmp_path / "rewards")])
    try:
        work.use_model(model_dir, task.reward)
        p = work.prompts(0)[0]
        assert p.answer is not None
        tok: Any = work.chat.tokenizer  # type: ignore[attr-defined]
        value = p.answer.rsplit("#### ", 1)[1]
        responses = [tok(t, add_special_tokens=False)["input_ids"]
                     for t in (f"so {value}", "boom", "no")]
        scored = await work.score(p, responses)
        assert scored.rewards == [1.0, 0.0, 0.0] and scored.errors == 1
        assert scored.texts == [f"so {value}", "boom", "no"]
    finally:
        await work.close()


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_a_missing_file_names_its_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(RunSpecError, match=rf"{missing}.*no such file"):
        await open_(spec(dataset={"path": str(missing)}), tmp_path)


async def test_data_outside_the_dataset_roots_is_refused_unread(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    outside = write_jsonl(elsewhere / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    (root / "link.jsonl").symlink_to(outside)  # inside by its name, outside by its target
    for path in (str(outside), str(root / "link.jsonl"), str(root / ".." / "elsewhere" /
                                                            "d.jsonl"), "/etc/passwd"):
        for run in (spec(dataset={"path": path}),
                    spec(eval={"path": path, "every": 2})):
            with pytest.raises(RunSpecError, match=r"outside the dataset roots"):
                await open_(run, root)
    # The same file is read once a root holds it.
    work = await open_workload(spec(dataset={"path": str(outside)}), root, [], 5.0,
                               dataset_roots=[elsewhere])
    try:
        assert [e.prompt for e in work.train.examples()] == ["1+1?"]
    finally:
        await work.close()


async def test_a_missing_key_names_the_key_and_the_columns(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}])
    with pytest.raises(RunSpecError, match=r"key 'prompt'.*no column 'prompt'.*question"):
        await open_(spec(dataset={"path": str(data)}), tmp_path)
    with pytest.raises(RunSpecError, match=r"key 'solution'"):
        await open_(spec(dataset={"path": str(data), "prompt_key": "question",
                                  "answer_key": "solution"}), tmp_path)


async def test_an_empty_dataset_says_so(tmp_path: Path) -> None:
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    with pytest.raises(RunSpecError, match=rf"{data}.*the dataset is empty"):
        await open_(spec(dataset={"path": str(data)}), tmp_path)


async def test_a_bad_eval_set_fails_the_run_too(tmp_path: Path) -> None:
    missing = tmp_path / "held-out.jsonl"
    with pytest.raises(RunSpecError, match=str(missing)):
        await open_(spec(eval={"path": str(missing), "every": 2}), tmp_path)


async def test_an_unimportable_reward_names_the_function_and_the_cause(tmp_path: Path) -> None:
    with pytest.raises(RunSpecError, match=r"python:no_such_mod_i12a:fn.*No module named"):
        await open_(spec(reward="python:no_such_mod_i12a:fn"), tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "i12a_has_no_fn.py").write_text("x = 1\n")
    with pytest.raises(RunSpecError, match=r"has no attribute 'fn'"):
        await open_(spec(reward="python:i12a_has_no_fn:fn"), tmp_path, [str(tmp_path / "r")])


async def test_the_built_in_task_keeps_its_prompts_and_reward(tmp_path: Path) -> None:
    run = RunSpec(prompts_per_step=4, seed=3)
    work = await open_(run, tmp_path)
    assert isinstance(work, TaskWorkload)
    work.use_model(None, task.reward)
    prompts = work.prompts(2)
    assert [p.token_ids for p in prompts] == task.make_prompts(3, 2, 4)
    ref = task.reference_response(prompts[0].token_ids)
    scored = await work.score(prompts[0], [ref])
    assert scored.rewards == [1.0] and work.eos_token_id == task.EOS_ID
    assert not work.eval_due(0)


async def test_eval_is_due_every_n_steps_and_samples_the_given_weights(
        model_dir: Path, tmp_path: Path) -> None:
    held_out = write_jsonl(tmp_path / "held-out.jsonl",
                           [{"prompt": f"What is {i} plus 1?", "answer": f"#### {i + 1}"}
                            for i in range(5)])
    work = await open_(spec(eval={"path": str(held_out), "every": 3}, max_new_tokens=4),
                       tmp_path)
    try:
        work.use_model(model_dir, task.reward)
        assert [s for s in range(7) if work.eval_due(s)] == [0, 3, 6]
        first = await work.evaluate(3, model_dir)
        assert first.responses == 5 and 0.0 <= first.reward_mean <= 1.0 and first.errors == 0
        assert await work.evaluate(3, model_dir) == first  # seeded by (run seed, step)
    finally:
        await work.close()
