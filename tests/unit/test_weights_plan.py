"""The chunk schedule of one pull (shared.weights.plan): which source each chunk comes from when
several joiners start together. Pure scheduling, no sockets: the transfers themselves are tested
against a real service in test_weights_client and test_weight_peers."""

from __future__ import annotations

import threading
import time

import pytest

from shared.weights import plan as weights_plan
from shared.weights.manifest import Chunk
from shared.weights.plan import Plan

PEER = "http://127.0.0.1:9001"


def plan_of(n: int, start: int = 0, parallel: int = 2, peers: bool = True,
            done: frozenset[int] = frozenset()) -> Plan:
    chunks = [Chunk(i, "model.safetensors", i * 10, 10, "0" * 64) for i in range(n)]
    return Plan(chunks, set(done), {}, parallel, start, peers=peers)


def take_within(plan: Plan, seconds: float) -> tuple[int, str | None] | None:
    """What ``take`` hands out within ``seconds``; None if it is still waiting then."""
    got: list[tuple[int, str | None] | None] = []
    t = threading.Thread(target=lambda: got.append(plan.take()))
    t.start()
    t.join(seconds)
    if t.is_alive():
        plan.fail(None)  # wakes it with None; the plan is spent
        t.join()
        return None
    return got[0]


def test_alone_every_missing_chunk_comes_from_the_service_once_in_rotation() -> None:
    plan = plan_of(6, start=4, parallel=4, peers=False, done=frozenset({5, 1}))
    taken = [take_within(plan, 1.0) for _ in range(4)]
    assert taken == [(4, None), (0, None), (2, None), (3, None)]
    assert plan.take() is None  # all taken: workers end instead of waiting
    assert plan.remaining() == 4
    for index, _ in (t for t in taken if t is not None):
        plan.finish(index, None)
    assert plan.remaining() == 0 and plan.bytes_from_service == 40


def test_a_chunk_a_peer_is_fetching_is_not_fetched_from_the_service_again() -> None:
    plan = plan_of(4, start=1)
    plan.update_peer(PEER, False, set(), {1, 2})
    first = take_within(plan, 1.0)  # chunks nobody is fetching, in either order
    assert first is not None and first[1] is None and first[0] in {0, 3}
    assert plan.service_fetching() == [first[0]]
    plan.finish(first[0], None)
    other = 3 if first[0] == 0 else 0
    assert take_within(plan, 1.0) == (other, None)
    plan.finish(other, None)
    # Only chunks the peer is bringing in are left: wait for it rather than duplicate them.
    assert take_within(plan, 0.3) is None


def test_once_the_peer_holds_the_chunk_it_comes_from_the_peer() -> None:
    plan = plan_of(2)
    plan.update_peer(PEER, False, set(), {0, 1})
    plan.update_peer(PEER, False, {0}, {1})
    assert take_within(plan, 1.0) == (0, PEER)


def test_a_claim_older_than_the_cap_no_longer_holds_anyone_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights_plan, "CLAIM_MAX_S", 0.2)
    plan = plan_of(1)
    plan.update_peer(PEER, False, set(), {0})
    started = time.monotonic()
    assert take_within(plan, 1.0) == (0, None)  # the peer's fetch stalled: fetch it ourselves
    assert time.monotonic() - started >= 0.15


def test_the_claim_cap_grows_with_how_long_service_chunks_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights_plan, "CLAIM_MAX_S", 0.1)
    plan = plan_of(2)
    first = take_within(plan, 1.0)
    assert first is not None and first[1] is None
    time.sleep(0.3)  # a slow link: the service's chunk takes 0.3 s
    plan.finish(first[0], None)
    assert plan.claim_cap() >= 0.85
    plan.update_peer(PEER, False, set(), {1 - first[0]})
    # A peer's fetch of the other chunk is as slow as ours: its claim holds well past 0.1 s.
    assert take_within(plan, 0.5) is None


def test_a_silent_peer_s_claims_lapse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_plan, "CLAIM_FRESH_S", 0.2)
    plan = plan_of(1)
    plan.update_peer(PEER, False, set(), {0})  # and then it never answers again
    assert take_within(plan, 2.0) == (0, None)


def test_a_claim_renewed_by_each_answer_keeps_its_first_age(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights_plan, "CLAIM_MAX_S", 0.4)
    plan = plan_of(1)
    plan.update_peer(PEER, False, set(), {0})
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # a peer that keeps saying "fetching" but never has it
        plan.update_peer(PEER, False, set(), {0})
        time.sleep(0.05)
    assert take_within(plan, 0.2) == (0, None)


def test_a_claim_dropped_and_made_again_keeps_its_first_age(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(weights_plan, "CLAIM_MAX_S", 0.4)
    plan = plan_of(1)
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # "fetching", "not fetching", "fetching", ...
        plan.update_peer(PEER, False, set(), {0})
        plan.update_peer(PEER, False, set(), set())
        plan.update_peer(PEER, False, set(), {0})
        time.sleep(0.05)
    assert take_within(plan, 0.2) == (0, None)


def test_a_chunk_a_peer_served_corrupt_comes_from_the_service_while_others_hold_all() -> None:
    good, bad = "http://127.0.0.1:9002", PEER
    plan = plan_of(3)
    plan.update_peer(bad, True, set())
    plan.update_peer(good, True, set())
    assert take_within(plan, 1.0) == (0, bad)
    plan.peer_failed(bad, 0, corrupt=True, why="served bad bytes")
    assert take_within(plan, 1.0) == (1, good)
    assert take_within(plan, 1.0) == (2, good)
    # The good peer is at its cap and holds chunk 0 too, but chunk 0 may only come from the
    # service now: waiting for the peer would wait forever.
    assert take_within(plan, 1.0) == (0, None)


def test_a_dead_peer_s_claims_count_for_nothing() -> None:
    plan = plan_of(2)
    plan.update_peer(PEER, False, {1}, {0})
    assert take_within(plan, 1.0) == (1, PEER)
    plan.peer_failed(PEER, 1, why="connection refused")
    first = take_within(plan, 1.0)
    assert first is not None and first[1] is None
    plan.finish(first[0], None)
    second = take_within(plan, 1.0)  # its claim on chunk 0 is void too
    assert {first, second} == {(0, None), (1, None)}
