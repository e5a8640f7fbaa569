"""kvbus up's configuration (flags > KVBUS_* > defaults, checked once, frozen) and each role's command line."""

from __future__ import annotations

import dataclasses

import pytest

from services.config import ConfigError
from services.registry import ROLES
from services.up.config import UpConfig, parse
from services.up.roles import ROLE_LAUNCHES, Site, plan

SITE = Site(nats_url="nats://127.0.0.1:4222", model_dir="/models/x", http_port=8123)


def _children(**kw) -> dict[str, list[str]]:
    config = UpConfig(**{"metrics_port": -1, **kw})
    return {c.name: c.argv for c in plan(config, SITE, cores=[0, 1]).children}


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_flags_beat_environment_beat_defaults(monkeypatch):
    monkeypatch.setenv("KVBUS_TOKENIZERS", "3")
    monkeypatch.setenv("KVBUS_HICACHE", "yes")
    config = parse(["--tokenizers", "2", "--aggregated"])
    assert (config.tokenizers, config.hicache, config.aggregated, config.workers) == (2, True, True, 1)
    assert parse([]).tokenizers == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tokenizers = 4  # type: ignore[misc]


def test_bad_values_are_refused_naming_the_flag(monkeypatch, capsys):
    for argv, message in ((["--tokenizers", "0"], "--tokenizers must be >= 1"),
                          (["--aggregated", "--decode", "2"], "--aggregated contradicts"),
                          (["--kv-transfer", "carrier-pigeon"], "argument --kv-transfer: invalid choice: 'carrier-pigeon'"),
                          (["--http-port", "70000"], "--http-port must be a port")):
        with pytest.raises(SystemExit) as exited:
            parse(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setenv("KVBUS_LAYOUT", "sideways")  # the environment skips argparse's choices: checked anyway
    with pytest.raises(SystemExit):
        parse([])
    assert "UpConfig.layout must be one of auto, aggregated, disaggregated" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="hicache_write_policy|--hicache-write-policy"):
        UpConfig(hicache_write_policy="someday")


def test_every_launched_role_is_a_registered_role():
    assert {r.role for r in ROLE_LAUNCHES} <= set(ROLES)


def test_tokenizer_only_starts_the_tokenizers_alone():
    assert set(_children(tokenizer_only=True, tokenizers=2, hicache=True, speculative="model",
                         draft_placement="remote")) == {"tokenizer-0", "tokenizer-1"}


def test_gateway_gets_the_port_found_and_the_key_file_never_the_keys():
    gateway = _children(aggregated=True, api_key_file="/etc/keys", http_host="0.0.0.0")["gateway-0"]
    assert _value(gateway, "--http-port") == "8123" and _value(gateway, "--http-host") == "0.0.0.0"
    assert _value(gateway, "--api-key-file") == "/etc/keys"
    assert "--api-key-file" not in _children(aggregated=True)["gateway-0"]


def test_a_draft_service_only_with_remote_placement():
    local = _children(aggregated=True, speculative="model", draft_model="/models/d")
    assert "draft-0" not in local and _value(local["worker-0"], "--draft-model") == "/models/d"
    remote = _children(aggregated=True, speculative="model", draft_model="/models/d", draft_placement="remote",
                       num_speculative_tokens=6)
    draft = remote["draft-0"]
    assert _value(draft, "--speculative-method") == "model" and _value(draft, "--num-speculative-tokens") == "6"
    assert _value(remote["worker-0"], "--draft-placement") == "remote"
    assert "draft-0" not in _children(aggregated=True, speculative="off", draft_placement="remote")


def test_kv_store_flags_pass_only_what_was_set():
    store = _children(aggregated=True, hicache=True)["kv_store-0"]
    assert _value(store, "--hicache-ratio") == "2.0" and "--hicache-size" not in store
    assert _value(store, "--hicache-engines") == "1"
    # every engine started on the host gets its ratio of pools: 1 prefill + 2 decode workers
    assert _value(_children(prefill=1, decode=2, hicache=True)["kv_store-0"], "--hicache-engines") == "3"
    assert "--hicache-storage-dir" not in store
    store = _children(aggregated=True, hicache=True, hicache_size=0.5, hicache_storage_dir="/var/l3")["kv_store-0"]
    assert _value(store, "--hicache-size") == "0.5" and _value(store, "--hicache-storage-dir") == "/var/l3"
    worker = _children(aggregated=True, hicache=True, hicache_write_policy="write_through")["worker-0"]
    assert _value(worker, "--hicache-write-policy") == "write_through"


def test_session_ttl_zero_turns_affinity_off():
    """0 is the router's "no conversation affinity" (bench/router_bench.py's baselines use it)."""
    assert UpConfig(session_ttl=0).session_ttl == 0
    with pytest.raises(ConfigError, match="--session-ttl must be >= 0"):
        UpConfig(session_ttl=-1)
