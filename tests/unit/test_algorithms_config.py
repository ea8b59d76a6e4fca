"""The algorithm config: each paper's defaults, overrides, and errors that name their field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.algorithm import (
    DEFAULTS,
    Algorithm,
    AlgorithmConfig,
    AlgorithmConfigError,
    Estimator,
    KlEstimator,
    LossAgg,
    PolicyLoss,
)
from shared.errors import ProtocolError
from shared.protocol import decode
from shared.spec import RunSpec

# (clip low, clip high, loss_agg, overlong buffer, minibatches, dynamic sampling), from the
# sources the config module cites; DAPO's dynamic sampling is opt-in (its doc says why).
PAPER = {
    "grpo": (0.2, 0.2, "token_mean", 0, 1, False),
    "dr_grpo": (0.2, 0.2, "seq_mean_token_sum_norm", 0, 1, False),
    "dapo": (0.2, 0.28, "token_mean", 4096, 16, False),
    "rloo": (0.2, 0.2, "seq_mean_token_sum", 0, 1, False),
    "reinforce_pp": (0.2, 0.2, "token_mean", 0, 1, False),
    "reinforce_pp_baseline": (0.2, 0.2, "token_mean", 0, 1, False),
    "gspo": (3e-4, 4e-4, "seq_mean_token_mean", 0, 4, False),
}


@pytest.mark.parametrize("name", list(PAPER))
def test_paper_defaults(name: str) -> None:
    cfg = AlgorithmConfig.for_algorithm(name)
    got = (cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.loss_agg.value, cfg.overlong_buffer,
           cfg.minibatches, cfg.dynamic_sampling)
    assert got == PAPER[name]
    # No paper here trains with a KL or entropy term by default; one update pass each.
    assert (cfg.kl_coef, cfg.entropy_coef, cfg.updates_per_step) == (0.0, 0.0, 1)
    assert cfg.kl_estimator is KlEstimator.K3 and not cfg.needs_reference
    assert cfg.overlong_penalty_factor == 1.0


def test_every_algorithm_has_defaults_and_an_estimator() -> None:
    assert set(DEFAULTS) == set(Algorithm)
    assert AlgorithmConfig.for_algorithm("dapo").estimator is Estimator.GRPO
    assert AlgorithmConfig.for_algorithm("gspo").estimator is Estimator.GRPO
    assert AlgorithmConfig.for_algorithm("gspo").policy_loss is PolicyLoss.SEQUENCE_CLIP
    assert AlgorithmConfig.for_algorithm("dapo").policy_loss is PolicyLoss.TOKEN_CLIP


def test_overrides_and_spec() -> None:
    cfg = AlgorithmConfig.for_algorithm("dapo", clip_ratio_high=0.3, loss_agg=None, kl_coef=1,
                                        kl_estimator="k2")
    assert cfg.clip_ratio_high == 0.3 and cfg.loss_agg is LossAgg.TOKEN_MEAN
    assert cfg.kl_coef == 1.0 and isinstance(cfg.kl_coef, float) and cfg.needs_reference
    spec = {"algorithm": "rloo", "steps": 3, "minibatches": 2, "entropy_coef": None}
    from_spec = AlgorithmConfig.from_spec(spec)
    assert from_spec.algorithm is Algorithm.RLOO and from_spec.minibatches == 2
    assert AlgorithmConfig.from_spec({}).algorithm is Algorithm.GRPO
    assert cfg.with_(updates_per_step=3).updates_per_step == 3


@pytest.mark.parametrize(("field", "value"), [
    ("algorithm", "ppo"),
    ("loss_agg", "token-mean"),
    ("kl_estimator", "low_var_kl"),
    ("clip_ratio_low", 1.0),
    ("clip_ratio_low", -0.1),
    ("clip_ratio_high", float("inf")),
    ("kl_coef", -1.0),
    ("overlong_buffer", -5),
    ("overlong_buffer", 1.5),
    ("updates_per_step", 0),
    ("minibatches", 0),
    ("dynamic_sampling", "yes"),
    ("entropy_coef", "0.1"),
    ("clip_ratio_high", True),
    ("gamma", 0.9),
])
def test_bad_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(AlgorithmConfigError) as info:
        if field == "algorithm":
            AlgorithmConfig.for_algorithm(str(value))
        else:
            AlgorithmConfig.for_algorithm("grpo", **{field: value})
    assert info.value.field == field


def test_check_run() -> None:
    dapo = AlgorithmConfig.for_algorithm("dapo")
    with pytest.raises(AlgorithmConfigError) as info:
        dapo.check_run(max_new_tokens=8, groups_per_step=16)
    assert info.value.field == "overlong_buffer"
    dapo.check_run(max_new_tokens=20480, groups_per_step=16)
    dapo.with_(overlong_buffer=2).check_run(max_new_tokens=8, groups_per_step=16)
    with pytest.raises(AlgorithmConfigError) as info:
        dapo.check_run(max_new_tokens=20480, groups_per_step=8)
    assert info.value.field == "minibatches"


def test_for_run_scales_unset_size_defaults_and_checks_set_ones() -> None:
    # DAPO on the embedded task (8 tokens, 16 prompts): the buffer is the budget's last fifth,
    # as 4096 is of 20480, and 16 mini-batches of one group each.
    dapo = AlgorithmConfig.for_run({"algorithm": "dapo"}, max_new_tokens=8, groups_per_step=16)
    assert (dapo.overlong_buffer, dapo.minibatches) == (1, 16)
    small = AlgorithmConfig.for_run({"algorithm": "dapo"}, max_new_tokens=40, groups_per_step=4)
    assert (small.overlong_buffer, small.minibatches) == (8, 4)
    gspo = AlgorithmConfig.for_run({"algorithm": "gspo"}, max_new_tokens=8, groups_per_step=2)
    assert gspo.minibatches == 2
    # A value the user set is checked, never scaled.
    with pytest.raises(AlgorithmConfigError) as info:
        AlgorithmConfig.for_run({"algorithm": "dapo", "overlong_buffer": 8}, max_new_tokens=8,
                                groups_per_step=16)
    assert info.value.field == "overlong_buffer"
    with pytest.raises(AlgorithmConfigError) as info:
        AlgorithmConfig.for_run({"minibatches": 3}, max_new_tokens=8, groups_per_step=2)
    assert info.value.field == "minibatches"


def _decode(body: dict[str, object]) -> RunSpec:
    return decode(json.dumps(body).encode(), RunSpec)


def test_k1_is_refused_as_a_loss_term_only() -> None:
    """Its gradient as a loss term is zero in expectation (module doc): a kl_coef it ignores."""
    with pytest.raises(AlgorithmConfigError) as info:
        AlgorithmConfig.for_algorithm("grpo", kl_coef=0.1, kl_estimator="k1")
    assert info.value.field == "kl_estimator" and "zero expected gradient" in info.value.detail
    with pytest.raises(AlgorithmConfigError):
        AlgorithmConfig.for_algorithm("rloo", kl_estimator="k1").with_(kl_coef=0.01)
    assert AlgorithmConfig.for_algorithm("grpo", kl_estimator="k1").kl_coef == 0.0
    for other in ("k2", "k3"):
        assert AlgorithmConfig.for_algorithm("grpo", kl_coef=0.1, kl_estimator=other).kl_coef
    with pytest.raises(ProtocolError, match="kl_estimator"):  # a 422 at submit
        _decode({"kl_coef": 0.1, "kl_estimator": "k1"})


@pytest.mark.parametrize("algorithm", [a.value for a in Algorithm])
def test_a_group_estimator_refuses_groups_of_one(algorithm: str) -> None:
    """Compared only with itself, a lone response gets advantage 0: the run would train nothing."""
    body = {"algorithm": algorithm, "samples_per_prompt": 1}
    if AlgorithmConfig.for_algorithm(algorithm).estimator is Estimator.REINFORCE_PP:
        assert _decode(body).samples_per_prompt == 1  # its baseline is the whole batch
        return
    with pytest.raises(AlgorithmConfigError) as info:
        AlgorithmConfig.for_run(body, max_new_tokens=20480, groups_per_step=16,
                                samples_per_prompt=1)
    assert info.value.field == "samples_per_prompt" and "trains nothing" in info.value.detail
    with pytest.raises(ProtocolError, match="samples_per_prompt"):  # a 422 at submit
        _decode(body)
    assert _decode({**body, "samples_per_prompt": 2}).samples_per_prompt == 2


@pytest.mark.parametrize("algorithm", [a.value for a in Algorithm])
def test_a_spec_without_overrides_resolves_to_the_preset(algorithm: str) -> None:
    """The spec adds nothing of its own: left out, every knob is the preset's (scaled to the
    run), DAPO's dynamic_sampling included, which is off as docs/algorithms.md says."""
    run = RunSpec(algorithm=algorithm)  # type: ignore[arg-type]
    preset = AlgorithmConfig.for_run({"algorithm": algorithm}, max_new_tokens=run.max_new_tokens,
                                     groups_per_step=run.prompts_per_step)
    assert run.algorithm_config() == preset
    assert preset.dynamic_sampling is False and run.max_prompts == run.prompts_per_step
    docs = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    assert "`dynamic_sampling` (DAPO's filter, off unless asked" in " ".join(docs.split())
    asked = RunSpec(algorithm=algorithm, dynamic_sampling=True)  # type: ignore[arg-type]
    assert asked.algorithm_config().dynamic_sampling is True
