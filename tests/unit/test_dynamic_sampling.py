"""Dynamic sampling's decisions (trainer_svc.dynamic_sampling): which groups a step keeps.

DAPO §3.2, eq. 11: a step trains on ``prompts_per_step`` groups whose rewards are not all equal.
The kept set must be a function of the groups' rewards by prompt index only (never of the order
they complete in, nor of when the step was extended): that is what keeps the determinism
oracle (design invariant 5). The simulation below lets groups complete in random orders,
extends when asked, and checks every run keeps the lowest-index informative groups.
"""

from __future__ import annotations

import random

import pytest

from trainer_svc.dynamic_sampling import Close, Extend, GroupFilter

EQUAL, DIFFER = [1.0, 1.0], [0.0, 1.0]


def simulate(informative: list[bool], target: int, max_prompts: int,
             rng: random.Random) -> tuple[Close, list[int], int]:
    """Groups complete in random order among those generated; returns the close, every group
    released for training, and how many prompts the step generated."""
    f = GroupFilter(target=target, max_prompts=max_prompts, prompts=target)
    in_flight, released = list(range(target)), []
    while True:
        p = in_flight.pop(rng.randrange(len(in_flight)))
        f.add(p, DIFFER if informative[p] else EQUAL)
        released += f.release()
        action = f.action()
        if isinstance(action, Extend):
            assert action.first == f.prompts and action.count >= 1
            in_flight += range(action.first, action.first + action.count)
            f.sync(action.first + action.count)
        elif isinstance(action, Close):
            return action, released, f.prompts
        assert in_flight, "nothing in flight, yet the filter neither extends nor closes"


@pytest.mark.parametrize("seed", range(40))
def test_the_kept_groups_do_not_depend_on_completion_order(seed: int) -> None:
    pattern_rng = random.Random(seed)
    target, max_prompts = 4, 16
    informative = [pattern_rng.random() < 0.4 for _ in range(max_prompts)]
    lowest = [p for p, flag in enumerate(informative) if flag][:target]
    for order in range(5):
        close, released, prompts = simulate(informative, target, max_prompts,
                                            random.Random(1000 * seed + order))
        assert close.keep == lowest
        assert sorted(released) == lowest  # every kept group trains, and nothing else
        assert close.capped == (len(lowest) < target)
        last = lowest[-1] if lowest and not close.capped else max_prompts - 1
        assert close.filtered == [p for p in range(last + 1) if not informative[p]]
        assert prompts <= max_prompts
        if close.capped:
            assert prompts == max_prompts


def test_informative_groups_of_the_first_batch_are_released_on_arrival() -> None:
    f = GroupFilter(target=4, max_prompts=8, prompts=4)
    f.add(3, DIFFER)
    assert f.release() == [3]  # whatever groups 0-2 turn out to be, it is among the lowest 4
    assert f.action() is None  # three in flight could still all be informative
    f.add(0, EQUAL)
    f.add(1, EQUAL)
    # Two informative at most among the four: short by two, with 1 of 3 scored informative
    # seen so far, ask for 2 / (1/3) = 6 prompts, within max_prompts (4 more).
    assert f.action() == Extend(first=4, count=4)
    f.sync(8)
    f.add(6, DIFFER)
    assert f.release() == []  # groups 2, 4 and 5 below it might all be informative
    f.add(5, DIFFER)
    assert f.release() == [5]  # at most 3 (2, 3, 4) informative below it
    f.add(2, DIFFER)
    f.add(4, EQUAL)
    assert f.release() == [2, 6]
    assert f.action() == Close(keep=[2, 3, 5, 6], filtered=[0, 1, 4], capped=False)
    assert f.action() is None  # closed once


def test_all_equal_groups_everywhere_close_capped_on_nothing() -> None:
    f = GroupFilter(target=2, max_prompts=4, prompts=2)
    for p in range(2):
        f.add(p, EQUAL)
    action = f.action()
    assert action == Extend(first=2, count=2)  # 2 / MIN_SHARE = 16, within max_prompts
    f.sync(4)
    for p in range(2, 4):
        f.add(p, EQUAL)
    assert f.action() == Close(keep=[], filtered=[0, 1, 2, 3], capped=True)
    assert f.release() == []


def test_a_group_of_one_is_never_informative() -> None:
    f = GroupFilter(target=1, max_prompts=1, prompts=1)
    assert not f.add(0, [0.5])
    assert f.action() == Close(keep=[], filtered=[0], capped=True)
