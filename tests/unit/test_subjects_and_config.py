from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from bus.codec import Encoding
from bus.errors import ERROR_CODE_HEADER, ErrorCode, InvalidArgument, Overloaded, error_from_headers
from bus.memory import subject_matches
from bus.subjects import ALL_SUBJECTS, HEALTH, TOKENIZER_ENCODE, WORKER_HEALTH, subject_for_name
from schemas.export import export_schemas
from services import config as cfg


def test_subject_table_is_consistent():
    templates = [s.template for s in ALL_SUBJECTS]
    assert len(templates) == len(set(templates))
    for s in ALL_SUBJECTS:
        assert s.template.startswith("kvbus.v1."), s.template
        if s.public:
            assert s.encoding is Encoding.JSON, s.template
        names = [t.__name__ for t in (s.request, s.reply) if t is not None]
        assert names[0].endswith(("Request", "Event")), names
        if s.reply is not None:
            assert names[1].endswith("Chunk" if s.streamed else "Reply"), names


def test_subject_format_and_lookup():
    assert WORKER_HEALTH.format(role="tokenizer", worker_id="w1") == "kvbus.v1.health.tokenizer.w1"
    assert WORKER_HEALTH.wildcard() == "kvbus.v1.health.*.*"
    with pytest.raises(ValueError, match="needs"):
        WORKER_HEALTH.format(role="tokenizer")
    with pytest.raises(ValueError, match="bad subject token"):
        HEALTH.format(role="a.b")
    assert subject_for_name("kvbus.v1.tokenizer.encode") == (TOKENIZER_ENCODE, {})
    assert subject_for_name("kvbus.v1.health.decode.w7") == (WORKER_HEALTH, {"role": "decode", "worker_id": "w7"})
    with pytest.raises(ValueError):
        subject_for_name("kvbus.v1.nope")


@pytest.mark.parametrize("pattern,subject,expected", [
    ("a.b", "a.b", True), ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.>", "a.b.c", True),
    ("a.>", "a", False), ("*.b", "x.b", True), ("a.b", "a.c", False),
])
def test_wildcards(pattern, subject, expected):
    assert subject_matches(pattern, subject) is expected


def test_error_headers_round_trip():
    headers = Overloaded("queue full").to_headers()
    assert headers[ERROR_CODE_HEADER] == "overloaded" and headers["Nats-Service-Error-Code"] == "429"
    err = error_from_headers(headers)
    assert isinstance(err, Overloaded) and err.message == "queue full"
    assert error_from_headers({}) is None
    assert error_from_headers({ERROR_CODE_HEADER: "bogus"}).code is ErrorCode.INTERNAL


def test_schema_export(tmp_path):
    paths = export_schemas(tmp_path)
    names = {p.name for p in paths}
    assert "kvbus.v1.tokenizer.encode.json" in names
    schema = json.loads((tmp_path / "kvbus.v1.tokenizer.chat.json").read_text())
    assert schema["x-kvbus"]["queue_group"] == "tokenizer"
    assert "ChatMessage" in schema["$defs"]


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    model: str | None = None
    """Model folder."""
    max_batch_size: int = 8
    """Biggest batch."""
    ratio: float = 0.5
    """A fraction."""
    is_on: bool = False
    """A switch."""

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")


def test_config_cli_env_precedence():
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, DemoConfig)
    assert "Biggest batch." in parser.format_help() and "KVBUS_MAX_BATCH_SIZE" in parser.format_help()
    env = {"KVBUS_MAX_BATCH_SIZE": "16", "KVBUS_RATIO": "0.25", "KVBUS_IS_ON": "yes"}
    built = cfg.build(DemoConfig, parser.parse_args([]), env)
    assert built == DemoConfig(max_batch_size=16, ratio=0.25, is_on=True)
    built = cfg.build(DemoConfig, parser.parse_args(["--max-batch-size", "4", "--no-is-on", "--model", "m"]), env)
    assert built == DemoConfig(model="m", max_batch_size=4, ratio=0.25, is_on=False)


def test_config_bad_values_fail_loudly():
    with pytest.raises(cfg.ConfigError, match="KVBUS_MAX_BATCH_SIZE"):
        cfg.build(DemoConfig, {}, {"KVBUS_MAX_BATCH_SIZE": "many"})
    with pytest.raises(cfg.ConfigError, match="max_batch_size must be >= 1"):
        cfg.build(DemoConfig, {}, {"KVBUS_MAX_BATCH_SIZE": "0"})
    assert isinstance(InvalidArgument("x"), ValueError)
