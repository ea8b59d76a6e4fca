"""The generated word problems: determinism, held-out eval split, answers that check out,
and the shipped example files still equal to the generator's output."""

from __future__ import annotations

import json
import re
from pathlib import Path

from trainer_svc.embedded import word_problems as wp

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_generation_is_a_pure_function_of_the_seed() -> None:
    assert wp.generate(3, 50) == wp.generate(3, 50)
    assert wp.generate(3, 50) != wp.generate(4, 50)
    assert wp.splits(1, 40, 10) == wp.splits(1, 40, 10)


def test_splits_are_disjoint_and_unique() -> None:
    train, held_out = wp.splits()
    assert (len(train), len(held_out)) == (wp.DEFAULT_TRAIN, wp.DEFAULT_EVAL)
    prompts = [p.prompt for p in train + held_out]
    assert len(set(prompts)) == len(prompts)


def test_answers_are_gsm8k_shaped_and_correct() -> None:
    train, held_out = wp.splits()
    for p in train + held_out:
        working, final = p.answer.split("\n#### ")
        equation, value = working.split("=")
        assert re.fullmatch(r"\d+([+\-*]\d+)+", equation), p
        # The equation is digits and + - * only (checked above), so eval is safe here.
        assert eval(equation) == int(value) == int(final) == p.value >= 0, p
        assert all(int(n) <= 20 for n in re.findall(r"\d+", p.prompt)), p


def test_shipped_files_equal_the_generator() -> None:
    train, held_out = wp.splits()
    data = EXAMPLES / "data"
    assert (data / wp.TRAIN_FILE).read_text(encoding="utf-8") == wp.to_jsonl(train)
    assert (data / wp.EVAL_FILE).read_text(encoding="utf-8") == wp.to_jsonl(held_out)


def test_example_spec_points_at_the_shipped_files() -> None:
    spec = json.loads((EXAMPLES / "tiny-chat-math.json").read_text())
    root = EXAMPLES.parent
    assert spec["model"] == "tiny-chat" and spec["reward"] == "math"
    assert spec["chat_template"] is True
    assert (root / spec["dataset"]["path"]).is_file()
    assert (root / spec["eval"]["path"]).is_file()
    assert spec["eval"]["every"] >= 1


def test_cli_writes_the_default_files(tmp_path: Path) -> None:
    assert wp.main(["--out", str(tmp_path)]) == 0
    assert (tmp_path / wp.TRAIN_FILE).read_bytes() == (EXAMPLES / "data" / wp.TRAIN_FILE
                                                        ).read_bytes()
