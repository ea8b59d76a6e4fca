"""Settings (shared.config on shared.settings): the names, the rules, the masking, the docs.

No processes: each class reads an injected mapping. What the whole stack logs with real
credentials is tests/system/test_secrets_in_logs.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import SecretStr

from shared.config import (
    SETTINGS,
    Common,
    ManagerConfig,
    PeerConfig,
    RolloutConfig,
    TrainerConfig,
    WeightsConfig,
)
from shared.errors import ConfigError
from shared.identity import new_account_seed, new_user_seed
from shared.settings import PREFIX, env_names, mask_url, reveal, split_urls

SETTINGS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
NATS = "nats://manager:n4ts-pw@127.0.0.1:4222"
REDIS = "redis://:r3dis-pw@127.0.0.1:6379/0"


def every_setting() -> dict[str, str]:
    """Each variable a settings class reads, first choice only, and the service reading it."""
    return {env_names(field)[0]: service for service, cls in SETTINGS.items()
            for field in cls.model_fields.values() if env_names(field)}


def settings_page_table() -> dict[str, str]:
    """The settings page's table (docs/settings.md): variable -> the "read by" column."""
    rows = re.findall(r"^\| `(RLBOOST_[A-Z0-9_]+)` \| ([^|]+) \|", SETTINGS_PAGE.read_text(),
                      re.MULTILINE)
    return {name: service.strip() for name, service in rows}


def test_settings_page_lists_every_setting_and_no_other() -> None:
    names = every_setting()
    assert "RLBOOST_NATS_URL" in names and "RLBOOST_PEER_PORT" in names  # the walk works
    table = settings_page_table()
    missing, unknown = names.keys() - table, table.keys() - names
    assert not missing, f"settings missing from the settings page's table: {missing}"
    assert not unknown, f"the settings page's table lists settings no class reads: {unknown}"
    assert table == names, "the page's 'read by' column disagrees with shared.config.SETTINGS"


def test_every_name_has_the_prefix_and_a_meaning() -> None:
    for cls in SETTINGS.values():
        for name, field in cls.model_fields.items():
            if env_names(field):
                assert all(n.startswith(PREFIX) for n in env_names(field)), name
                assert field.description, f"{cls.__name__}.{name} says nothing about itself"


def test_defaults_when_unset_or_empty() -> None:
    for env in ({}, {"RLBOOST_LEASE_TTL_S": "", "RLBOOST_NATS_URL": ""}):
        cfg = ManagerConfig.from_env(env)
        assert cfg.lease_ttl_s == 3.0 and cfg.midstep_join is True
        assert cfg.common.nats_url == "nats://127.0.0.1:4222"
        assert cfg.common.api_token is None and cfg.common.torch_threads is None
    rollout = RolloutConfig.from_env({"RLBOOST_INSTANCE_KIND": "reserved"})
    assert rollout.instance_id.startswith("reserved-") and rollout.engine == "torch"
    assert rollout.peer == PeerConfig(addr="127.0.0.1", port=0, url=None)
    weights = WeightsConfig.from_env({})
    assert (weights.keep_last, weights.chunk_bytes, weights.data_port) == (3, 4 << 20, 0)


def test_values_are_parsed_as_before() -> None:
    rollout = RolloutConfig.from_env({
        "RLBOOST_ENGINE": "sglang", "RLBOOST_SGLANG_ARGS": "--tp 2 --chat-template 'a b'",
        "RLBOOST_SGLANG_URL": "http://127.0.0.1:30000", "RLBOOST_TORCH_THREADS": "0",
        "RLBOOST_LOG_LEVEL": "debug", "RLBOOST_DATA_DIR": "rel", "RLBOOST_PEER_PORT": "8003"})
    assert rollout.sglang_args == ("--tp", "2", "--chat-template", "a b")
    assert rollout.common.torch_threads is None and rollout.common.log_level == "DEBUG"
    assert rollout.common.data_dir.is_absolute() and rollout.peer.port == 8003
    manager = ManagerConfig.from_env({"RLBOOST_MIDSTEP_JOIN": "off",
                                      "RLBOOST_MIGRATION": "request"})
    assert manager.midstep_join is False and manager.migration == "request"
    assert TrainerConfig.from_env({}).trainer_id.startswith("trainer-")


def test_weights_tokens_never_fall_back_to_the_api_token() -> None:
    both = Common.from_env({"RLBOOST_API_TOKEN": "a", "RLBOOST_WEIGHTS_TOKEN": "w",
                            "RLBOOST_WEIGHTS_READ_TOKEN": "r"})
    assert reveal(both.api_token) == "a" and reveal(both.weights_token) == "w"
    assert reveal(both.weights_read_token) == "r"
    api_only = WeightsConfig.from_env({"RLBOOST_API_TOKEN": "a", "RLBOOST_WEIGHTS_TOKEN": ""})
    assert api_only.token is None and api_only.read_token is None
    assert isinstance(both.weights_token, SecretStr) and reveal(None) is None


def test_instance_ids_follow_one_pattern() -> None:
    for bad in ("a:held", "a b", "a.b", "-a", "x" * 65, "a>", "é"):
        with pytest.raises(ConfigError, match="RLBOOST_INSTANCE_ID"):
            RolloutConfig.from_env({"RLBOOST_INSTANCE_ID": bad})
    assert RolloutConfig.from_env({"RLBOOST_INSTANCE_ID": "spot_1-a"}).instance_id == "spot_1-a"
    with pytest.raises(ConfigError, match="RLBOOST_INSTANCE_ID"):  # its emu suffix too long
        RolloutConfig.from_env({"RLBOOST_INSTANCE_ID": "x" * 63, "RLBOOST_ENGINE": "emu",
                                "RLBOOST_EMU_INSTANCES": "12"})
    assert RolloutConfig.from_env({}).instance_id.startswith("spot-")


def test_the_callout_needs_an_account_seed_and_the_rollout_password() -> None:
    seed = new_account_seed()
    cfg = ManagerConfig.from_env({"RLBOOST_NATS_ISSUER_SEED": seed,
                                  "RLBOOST_NATS_ROLLOUT_PASSWORD": "r-pw"})
    described = str(cfg.describe())
    assert seed not in described and "r-pw" not in described and seed not in repr(cfg)
    with pytest.raises(ConfigError, match="RLBOOST_NATS_ROLLOUT_PASSWORD"):
        ManagerConfig.from_env({"RLBOOST_NATS_ISSUER_SEED": seed})
    with pytest.raises(ConfigError, match="RLBOOST_NATS_ISSUER_SEED"):
        ManagerConfig.from_env({"RLBOOST_NATS_ISSUER_SEED": new_user_seed(),
                                "RLBOOST_NATS_ROLLOUT_PASSWORD": "r-pw"})


@pytest.mark.parametrize("cls, env, name", [
    (ManagerConfig, {"RLBOOST_LEASE_TTL_S": "0.1"}, "RLBOOST_LEASE_TTL_S"),
    (ManagerConfig, {"RLBOOST_REBALANCE_SKEW": "1.5"}, "RLBOOST_REBALANCE_SKEW"),
    (ManagerConfig, {"RLBOOST_MIGRATION": "sideways"}, "RLBOOST_MIGRATION"),
    (ManagerConfig, {"RLBOOST_MIDSTEP_JOIN": "true"}, "RLBOOST_MIDSTEP_JOIN"),
    (TrainerConfig, {"RLBOOST_NATS_URL": "http://127.0.0.1:4222"}, "RLBOOST_NATS_URL"),
    (TrainerConfig, {"RLBOOST_TORCH_THREADS": "-1"}, "RLBOOST_TORCH_THREADS"),
    (RolloutConfig, {"RLBOOST_ENGINE": "vllm"}, "RLBOOST_ENGINE"),
    (RolloutConfig, {"RLBOOST_INSTANCE_ID": "a.b"}, "RLBOOST_INSTANCE_ID"),
    (RolloutConfig, {"RLBOOST_SGLANG_URL": "ftp://x"}, "RLBOOST_SGLANG_URL"),
    (RolloutConfig, {"RLBOOST_PEER_PORT": "70000"}, "RLBOOST_PEER_PORT"),
    (WeightsConfig, {"RLBOOST_WEIGHTS_KEEP": "0"}, "RLBOOST_WEIGHTS_KEEP"),
    (WeightsConfig, {"RLBOOST_WEIGHTS_DATA_PORT": "x"}, "RLBOOST_WEIGHTS_DATA_PORT"),
])
def test_a_bad_value_is_a_config_error_naming_its_variable(cls, env, name) -> None:
    with pytest.raises(ConfigError) as caught:
        cls.from_env(env)
    assert caught.value.name == name and str(caught.value).startswith(f"{name}: ")
    assert caught.value.problem and caught.value.retryable is False


def test_the_error_for_a_bad_url_masks_its_password() -> None:
    with pytest.raises(ConfigError, match="RLBOOST_REDIS_URL") as caught:
        Common.from_env({"RLBOOST_REDIS_URL": "http://:r3dis-pw@127.0.0.1:6379"})
    assert "r3dis-pw" not in str(caught.value) and ":***@" in str(caught.value)


def test_describe_and_repr_mask_every_credential() -> None:
    env = {"RLBOOST_NATS_URL": NATS, "RLBOOST_REDIS_URL": REDIS, "RLBOOST_API_TOKEN": "api-tok",
           "RLBOOST_WEIGHTS_TOKEN": "w-tok", "RLBOOST_PEER_URL": "http://u:peer-pw@10.0.0.2:8003",
           "RLBOOST_METADATA_URL": "http://u:meta-pw@169.254.169.254"}
    for cls in (ManagerConfig, RolloutConfig, TrainerConfig, WeightsConfig):
        cfg = cls.from_env(env)
        described = cfg.describe()
        assert described["RLBOOST_NATS_URL"] == "nats://manager:***@127.0.0.1:4222"
        assert described["RLBOOST_REDIS_URL"] == "redis://:***@127.0.0.1:6379/0"
        assert described["RLBOOST_API_TOKEN"] == described["RLBOOST_WEIGHTS_TOKEN"] == "***"
        for text in (str(described), repr(cfg), str(cfg)):
            for secret in ("n4ts-pw", "r3dis-pw", "api-tok", "w-tok", "peer-pw", "meta-pw"):
                assert secret not in text, (cls.__name__, secret)
    assert "RLBOOST_PEER_URL" in RolloutConfig.from_env(env).describe()
    assert cfg.common.nats_url == NATS  # the services themselves get the real URL


@pytest.mark.parametrize("url, shown", [
    ("nats://u:pw@h:4222", "nats://u:***@h:4222"),
    ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
    ("nats://bare-token@h:4222", "nats://***@h:4222"),  # NATS token auth: the user is the secret
    ("redis://h:6379/0", "redis://h:6379/0"),
    ("http://[::1]:80", "http://[::1]:80"),
    ("http://u:pw@[::1:80", "***"),  # too malformed to split: hide all of it
    ("not a url", "not a url"),
    # Every node of a cluster, each masked; a comma inside a password stays in its URL.
    ("nats://u:pw@a:1,nats://u:p,w@b:2", "nats://u:***@a:1,nats://u:***@b:2"),
])
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown


def test_nats_url_takes_every_node_of_a_cluster() -> None:
    many = "nats://127.0.0.1:4222,tls://u:p,w@10.0.0.2:4222"
    assert Common.from_env({"RLBOOST_NATS_URL": many}).nats_url == many
    assert split_urls(many) == ["nats://127.0.0.1:4222", "tls://u:p,w@10.0.0.2:4222"]
    for bad in ("nats://a:1,http://b:2", "nats://a:1,,nats://b:2", "nats://a:1,"):
        with pytest.raises(ConfigError, match="comma-separated"):
            Common.from_env({"RLBOOST_NATS_URL": bad})
    # Redis takes one URL: a client finds a cluster's other nodes from it.
    with pytest.raises(ConfigError, match="redis"):
        Common.from_env({"RLBOOST_REDIS_URL": "http://a:1"})
