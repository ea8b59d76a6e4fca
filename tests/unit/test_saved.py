"""Which weight versions a run keeps for export: save_every, keep_last, and the final one."""

from __future__ import annotations

import pytest

from shared.spec import RunSpec
from trainer_svc.saved import kept_versions


@pytest.mark.parametrize(("save_every", "keep_last", "version", "kept"), [
    (0, 0, 3, []),  # the final version only, and 3 of 10 is not final
    (0, 0, 10, [10]),
    (3, 0, 7, [3, 6]),
    (3, 0, 10, [3, 6, 9, 10]),  # the final one although 10 is no multiple of 3
    (3, 2, 10, [9, 10]),
    (5, 1, 10, [10]),  # a save point that is also final counts once
    (1, 2, 4, [3, 4]),
    (20, 0, 10, [10]),  # save_every beyond the run: the final one
])
def test_kept_versions(save_every: int, keep_last: int, version: int, kept: list[int]) -> None:
    spec = RunSpec(steps=10, save_every=save_every, keep_last=keep_last)
    assert kept_versions(spec, version) == kept


def test_each_version_pushes_out_at_most_the_oldest_kept() -> None:
    spec = RunSpec(steps=12, save_every=2, keep_last=3)
    for version in range(1, 13):
        before, after = kept_versions(spec, version - 1), kept_versions(spec, version)
        dropped = set(before) - set(after)
        assert len(after) <= 3 and dropped <= {min(before, default=-1)}
        assert set(after) - set(before) <= {version}  # only the version just published is new
