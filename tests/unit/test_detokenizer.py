"""Incremental detokenization with the real tokenizer: no split characters, stops across tokens."""

from __future__ import annotations

import pytest

from schemas.engine import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer

TEXT = " Grüße aus Köln 🤖🎉 你好世界, naïve café — ok"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def stream(tokenizer, ids, params):
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Say:")["input_ids"], params)
    deltas, stopped = [], False
    for token in ids:
        stopped = detok.add(token)
        deltas.append(detok.take(stopped))
        if stopped:
            break
    return deltas, stopped


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the text should split characters across tokens"
    deltas, stopped = stream(tokenizer, ids, SamplingParams())
    assert not stopped
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("stop", ["🎉 你", "naïve ca", "Köln"])
def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer, stop):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    deltas, stopped = stream(tokenizer, ids, SamplingParams(stop=(stop,)))
    full = tokenizer.decode(ids)
    assert stopped
    assert "".join(deltas) == full[: full.index(stop)]
    for i in range(len(deltas)):
        assert stop not in "".join(deltas[: i + 1])
