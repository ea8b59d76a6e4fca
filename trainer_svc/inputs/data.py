"""Prompt datasets: loading local files (or a hub dataset) and drawing each step's prompts.

Contract:

- :func:`load_prompts` reads a :class:`DatasetSpec` with HF ``datasets``: a local ``.jsonl``,
  ``.json`` (JSON lines, or one array of objects), ``.parquet`` or ``.csv`` file; a local
  directory laid out as ``datasets`` infers (``train.jsonl``, ``test.jsonl``, ...); or, only
  when the caller allows hub access, a hub dataset name. A single file holds one split,
  ``train``; slices such as ``train[:90%]`` work on it. Nothing is downloaded otherwise.
- Prompts must be non-empty strings. Answers are optional (``answer_key`` None, or a
  missing column when ``require_answer`` is false); present answers become strings
  (``18`` -> ``"18"``), so every reward sees ``str | None``.
- With ``roots`` (the trainer always passes RLBOOST_DATASET_ROOTS), a path that does not lie
  under one of them, symlinks followed, is refused before anything is read
  (:func:`shared.sources.outside_roots`); so is a hub name, which is no local path.
- Every failure is a :class:`DatasetError` naming the path, the key where one is involved,
  and the cause: a missing file, an unsupported format, an unreadable file, an unknown split,
  a missing column (with the columns there are), an empty dataset, a bad row (its index).
- :meth:`PromptDataset.draw` is a pure function of ``(seed, step, n)`` and the dataset's size:
  step ``s`` takes positions ``s*n .. s*n + n - 1`` of an endless stream of epochs, each
  epoch one permutation of the rows shuffled by a private RNG seeded from ``(seed, epoch)``.
  Any process that loads the same file regenerates the same prompts for a step, each row is
  drawn once per epoch, and epochs differ in order.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.sources import outside_roots, roots_text

# File suffix -> the ``datasets`` packaged builder that reads it.
FORMATS: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet",
                           ".csv": "csv"}


class DatasetError(ValueError):
    """A dataset that cannot be used; ``path``, ``key`` (or None) and ``cause`` say why."""

    def __init__(self, path: str, cause: str, key: str | None = None) -> None:
        where = f"dataset {path!r}" + (f", key {key!r}" if key is not None else "")
        super().__init__(f"{where}: {cause}")
        self.path = path
        self.key = key
        self.cause = cause


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """Where a run's prompts are: the run spec's ``dataset`` (or ``eval``) as the loader takes
    it; the fields were checked where the spec was decoded (:mod:`shared.spec`)."""

    path: str
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    split: str = "train"


@dataclass(frozen=True, slots=True)
class Example:
    """One dataset row: its index in the loaded split, prompt string and answer."""

    index: int
    prompt: str
    answer: str | None


class PromptDataset:
    """The prompts (and answers) of one loaded split, and the deterministic step draw."""

    def __init__(self, path: str, prompts: Sequence[str], answers: Sequence[str | None]) -> None:
        if len(prompts) != len(answers):
            raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
        if not prompts:
            raise DatasetError(path, "the dataset is empty")
        self.path = path
        self.prompts = list(prompts)
        self.answers = list(answers)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Example:
        return Example(index, self.prompts[index], self.answers[index])

    def examples(self) -> list[Example]:
        """Every row in file order (an eval pass)."""
        return [self[i] for i in range(len(self))]

    def draw(self, seed: int, step: int, n: int) -> list[Example]:
        """The ``n`` examples of step ``step`` in a run seeded ``seed`` (module docstring)."""
        return [self[i] for i in draw_indices(seed, step, n, len(self))]

    def draw_extra(self, seed: int, step: int, start: int, stop: int) -> list[Example]:
        """Dynamic sampling's extra prompts ``start .. stop - 1`` of step ``step``: uniform
        draws from their own seeded stream, one per index (the epoch stream's next rows are
        the next step's prompts)."""
        return [self[random.Random(f"rlboost-dataset-extra/{seed}/{step}/{i}").randrange(
            len(self))] for i in range(start, stop)]


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, size: int) -> tuple[int, ...]:
    # A string seed is hashed (sha512) by random.Random: stable across processes and
    # Python versions, and unrelated streams for neighbouring seeds and epochs.
    order = list(range(size))
    random.Random(f"rlboost-dataset/{seed}/{epoch}").shuffle(order)
    return tuple(order)


def draw_indices(seed: int, step: int, n: int, size: int) -> list[int]:
    """Row indices of step ``step``: positions ``step*n ..`` of the seeded epoch stream."""
    if n < 0 or step < 0 or size < 1:
        raise ValueError(f"need n >= 0, step >= 0, size >= 1; got {n}, {step}, {size}")
    out = []
    for position in range(step * n, step * n + n):
        epoch, offset = divmod(position, size)
        out.append(_epoch_order(seed, epoch, size)[offset])
    return out


def _looks_like_a_path(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~")) or Path(path).suffix != ""


def _read(spec: DatasetSpec, cache_dir: Path | None, allow_hub: bool) -> Any:
    # Imported here: datasets pulls in pyarrow and pandas (~0.5 s), needed only by the trainer.
    import datasets.config
    from datasets import load_dataset

    # Unless told otherwise, datasets sends a "download count" HEAD request to S3 for every
    # load, local files included. Its DNS lookup is outside the request's 3 s timeout, and on a
    # host with no resolver answering it held a bad spec's run for over a minute (CI). A local
    # load has nothing to count; a hub load keeps the library's default.
    if not allow_hub:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False

    local = Path(spec.path).expanduser()
    cache = str(cache_dir) if cache_dir is not None else None
    if local.is_file():
        if local.stat().st_size == 0:  # datasets' own error for it says only "StopIteration"
            raise DatasetError(spec.path, "the dataset is empty (the file has no bytes)")
        builder = FORMATS.get(local.suffix.lower())
        if builder is None:
            raise DatasetError(spec.path, f"unsupported format {local.suffix or '(no suffix)'!r};"
                               f" use one of {', '.join(FORMATS)}")
        args: dict[str, Any] = {"data_files": {"train": str(local)}}
        described = f"as {builder}"
    elif local.is_dir():
        builder, args, described = str(local), {}, "as a dataset directory"
    elif allow_hub and not _looks_like_a_path(spec.path):
        builder, args, described = spec.path, {}, "from the hub"
    else:
        hint = "" if allow_hub or _looks_like_a_path(spec.path) else " (and hub access is off)"
        raise DatasetError(spec.path, f"no such file or directory{hint}")
    try:
        return load_dataset(builder, split=spec.split, cache_dir=cache, **args)
    except ValueError as exc:
        if "split" in str(exc).lower():
            only = " (a single file holds one split, 'train')" if local.is_file() else ""
            raise DatasetError(spec.path, f"no split {spec.split!r}{only}: {exc}", "split") from exc
        raise DatasetError(spec.path, f"cannot load {described}: {exc}") from exc
    except Exception as exc:  # malformed files surface as many datasets/pyarrow types
        raise DatasetError(
            spec.path, f"cannot load {described}: {type(exc).__name__}: {exc}"
        ) from exc


def _column(table: Any, spec: DatasetSpec, key: str) -> list[Any]:
    if key not in table.column_names:
        have = ", ".join(table.column_names) or "none"
        raise DatasetError(spec.path, f"no column {key!r} (columns: {have})", key)
    return list(table[key])


def load_prompts(
    spec: DatasetSpec,
    *,
    require_answer: bool = False,
    cache_dir: Path | None = None,
    allow_hub: bool = False,
    roots: Sequence[Path] | None = None,
) -> PromptDataset:
    """Load ``spec``'s split; see the module docstring for formats and errors.

    ``require_answer``: the reward needs answers (``math``, ``exact``), so a missing
    ``answer_key`` column or a row without an answer is an error rather than None.
    ``cache_dir``: where ``datasets`` keeps its Arrow copies (default: its own ~/.cache).
    ``roots``: the directories the file must lie under (None: anywhere, for tests and tools).
    """
    if roots is not None and outside_roots(spec.path, roots, resolve=True):
        raise DatasetError(spec.path, "outside the dataset roots "
                           f"({roots_text(roots)}; RLBOOST_DATASET_ROOTS)")
    table = _read(spec, cache_dir, allow_hub)
    if len(table) == 0:
        raise DatasetError(spec.path, f"the dataset is empty (split {spec.split!r})")
    prompts = _column(table, spec, spec.prompt_key)
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise DatasetError(
                spec.path, f"row {i}: the prompt must be a non-empty string, got {p!r}",
                spec.prompt_key,
            )
    answers: list[str | None] = [None] * len(prompts)
    key = spec.answer_key
    if key is not None and (require_answer or key in table.column_names):
        raw = _column(table, spec, key)
        answers = [None if a is None else str(a) for a in raw]
        if require_answer:
            missing = [i for i, a in enumerate(answers) if a is None]
            if missing:
                raise DatasetError(spec.path, f"row {missing[0]} has no answer "
                                   f"({len(missing)} rows lack one)", key)
    elif require_answer:
        raise DatasetError(spec.path, "the reward needs answers but answer_key is None")
    return PromptDataset(spec.path, prompts, answers)
