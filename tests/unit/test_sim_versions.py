"""Version kinds in the simulator: what a joiner and a holder pull (sim/fleet.py, issue 40)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sim.config import (
    ADAPTER_BYTES_RATIO,
    DELTA_BYTES_RATIO,
    RLBOOST,
    Cluster,
    Costs,
    Policy,
    Workload,
)
from sim.fleet import alone
from sim.outcome import simulate

# One spot instance alone on the link (sim.fleet.alone), no boot: a pull takes bytes / link.
COSTS = replace(Costs.paper("emu-8b"), peer_bytes_s=0.0, spot_start_s=0.0)
LINK = COSTS.egress_bytes_s
FULL = COSTS.weight_bytes


def test_full_versions_pull_the_whole_version_each_time() -> None:
    join, update = alone(COSTS, "full")
    assert join == pytest.approx(FULL / LINK + COSTS.load_s)
    assert update == pytest.approx(FULL / LINK + COSTS.load_s)


def test_a_delta_holder_pulls_the_delta_and_rebuilds_but_a_joiner_pulls_full() -> None:
    join, update = alone(COSTS, "delta")
    assert join == pytest.approx(FULL / LINK + COSTS.load_s)  # holds no version: full
    rebuild = FULL / COSTS.delta_rebuild_bytes_s
    assert update == pytest.approx(DELTA_BYTES_RATIO * FULL / LINK + rebuild + COSTS.load_s)


def test_a_delta_applies_only_to_the_version_before() -> None:
    _, update = alone(COSTS, "delta", skip=1)  # holds v0, v2 published
    assert update == pytest.approx(FULL / LINK + COSTS.load_s)


def test_an_adapter_joiner_pulls_the_base_once_then_adapters() -> None:
    join, update = alone(COSTS, "adapter")
    assert join == pytest.approx((1 + ADAPTER_BYTES_RATIO) * FULL / LINK + COSTS.load_s)
    ratio = ADAPTER_BYTES_RATIO
    assert update == pytest.approx(ratio * FULL / LINK + ratio * COSTS.load_s)


def test_a_preseeded_base_leaves_an_adapter_joiner_the_adapter_to_pull() -> None:
    join, _ = alone(COSTS, "adapter", base_preseeded=True)
    # The base comes from the image but still loads into HBM.
    assert join == pytest.approx(ADAPTER_BYTES_RATIO * FULL / LINK + COSTS.load_s)
    full_join, _ = alone(COSTS, "full", base_preseeded=True)
    assert full_join == pytest.approx(FULL / LINK + COSTS.load_s)  # a full run ignores it


@pytest.mark.parametrize("kind", ["delta", "adapter"])
@pytest.mark.parametrize("ratio", [0.01, 0.04])
def test_the_bytes_ratio_sets_the_holders_pull(kind: str, ratio: float) -> None:
    costs = replace(COSTS, delta_rebuild_bytes_s=math.inf)  # no rebuild: the transfer alone
    costs = replace(costs, delta_ratio=ratio) if kind == "delta" else \
        replace(costs, adapter_ratio=ratio)
    _, update = alone(costs, kind)
    load = COSTS.load_s if kind == "delta" else ratio * COSTS.load_s  # an adapter loads alone
    assert update - load == pytest.approx(ratio * FULL / LINK)


def test_an_unknown_version_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="versions 'sparse'"):
        Policy("x", versions="sparse")


def test_smaller_pulls_bring_spot_tokens_sooner_in_a_churning_run() -> None:
    """Spot instances that come and go every few minutes on the paper's costs: adapter pulls
    (over a pre-seeded base) finish each join and each version sooner than full ones, so spot
    instances generate sooner in every step. (The throughput that buys moves by under 1 % here
    either way, seed by seed: joins are dominated by the 90 s boot.)"""
    work = Workload.reasoning(prompts=16, samples=4)
    cluster = Cluster(8, [0.0, 200.0, 400.0, 600.0], [4, 0, 4, 0], trace_length_s=800.0)
    seeded = replace(cluster, base_preseeded=True)
    full = simulate(RLBOOST, work, Costs.paper("emu-8b"), cluster, 1600.0)
    adapter = simulate(replace(RLBOOST, versions="adapter"), work, Costs.paper("emu-8b"),
                       seeded, 1600.0)
    assert adapter.steps != full.steps
    assert adapter.mean("spot_first_s") < full.mean("spot_first_s") - 10.0
    assert adapter.tokens_per_s == pytest.approx(full.tokens_per_s, rel=0.02)
