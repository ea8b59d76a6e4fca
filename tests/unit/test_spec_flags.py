"""Run specs on the command line: a typed flag per RunSpec field, YAML and JSON spec files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import pytest

from rlboost import cli
from rlboost.spec_flags import add_spec_flags, spec_body
from shared.protocol import decode
from shared.spec import RunSpec


class Data(msgspec.Struct, kw_only=True):
    path: str
    split: Literal["train", "test"] = "train"


class Spec(msgspec.Struct, kw_only=True):
    """A spec with fields RunSpec may grow: an optional nested struct, an optional int."""

    steps: Annotated[int, msgspec.Meta(ge=1)] = 3
    dataset: Data | None = None
    every: int | None = None
    overlong: bool = False


def dotted(struct: type[msgspec.Struct]) -> list[str]:
    out: list[str] = []
    for field in msgspec.inspect.type_info(struct).fields:
        inner = field.type
        if isinstance(inner, msgspec.inspect.UnionType):
            inner = next((t for t in inner.types if isinstance(t, msgspec.inspect.StructType)),
                         inner)
        if isinstance(inner, msgspec.inspect.StructType):
            out += [f"{field.name}.{n}" for n in dotted(inner.cls)]
        else:
            out.append(field.name)
    return out


def parse(argv: list[str], spec: type[msgspec.Struct] = RunSpec) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--spec")
    parser.add_argument("--set", action="append")
    add_spec_flags(parser, spec=spec)
    return parser.parse_args(argv)


def test_help_lists_every_run_spec_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["submit", "--help"])
    text = capsys.readouterr().out
    names = dotted(RunSpec)
    assert "seeding.mode" in names and "trackers" in names
    for name in names:
        assert f"--{name} " in text or f"--{name}\n" in text, name


def test_flags_are_typed_and_nest_with_dots() -> None:
    args = parse(["--steps", "10", "--seeding.mode", "fixed", "--seeding.window_s", "1.5",
                  "--trackers", "tensorboard", "mlflow", "--learning_rate", "1e-3"])
    body = spec_body(args)
    assert body == {"steps": 10, "seeding": {"mode": "fixed", "window_s": 1.5},
                    "trackers": ["tensorboard", "mlflow"], "learning_rate": 0.001}
    spec = decode(msgspec.json.encode(body), RunSpec)
    assert spec.steps == 10 and spec.seeding.window_s == 1.5
    assert spec_body(parse([])) == {}  # nothing given, nothing sent: the manager's defaults
    for bad in (["--steps", "ten"], ["--seeding.mode", "sometimes"], ["--trackers", "csv"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            parse(bad)


def test_a_new_field_gets_its_flag_nested_optional_structs_included() -> None:
    args = parse(["--dataset.path", "/d/x.jsonl", "--dataset.split", "test", "--every", "null",
                  "--overlong", "true"], Spec)
    assert spec_body(args) == {"dataset": {"path": "/d/x.jsonl", "split": "test"},
                               "every": None, "overlong": True}


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "steps: 5\nseeding:\n  mode: adaptive\n  window_s: 0.5\ntrackers: [tensorboard]\n"),
    (".json", '{"steps": 5, "seeding": {"mode": "adaptive", "window_s": 0.5},'
              ' "trackers": ["tensorboard"]}'),
])
def test_spec_files_in_yaml_or_json_and_flags_win(tmp_path: Path, suffix: str,
                                                   text: str) -> None:
    path = tmp_path / f"spec{suffix}"
    path.write_text(text)
    body = spec_body(parse(["--spec", str(path), "--seeding.window_s", "2", "--set", "seed=7"]))
    assert body == {"steps": 5, "seeding": {"mode": "adaptive", "window_s": 2.0},
                    "trackers": ["tensorboard"], "seed": 7}


def test_a_spec_file_that_is_not_a_mapping_is_refused(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text("- steps\n- 5\n")
    assert cli.main(["submit", "--spec", str(path)]) == 2
    assert "mapping" in capsys.readouterr().err


def test_the_yaml_example_is_a_valid_run_spec() -> None:
    root = Path(__file__).resolve().parents[2]
    body = spec_body(parse(["--spec", str(root / "examples" / "run.yaml"), "--steps", "5"]))
    spec = decode(msgspec.json.encode(body), RunSpec)
    assert spec.steps == 5 and spec.seeding.mode == "adaptive"
    assert spec.trackers == ["tensorboard", "mlflow"]
