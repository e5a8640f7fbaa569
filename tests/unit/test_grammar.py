"""The grammar layer (services/agent/grammar.py) with the default model's real tokenizer.

Random walks that sample only tokens the masks allow (seeded logits, masks applied to them as the
engine will) must end in output that parses and validates; rollback, drafts and rebuilding from
tokens must land in the same state as stepping; bad and pathological specs are refused quickly.
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch

from schemas.engine import MAX_STRUCTURED_SPEC_CHARS, InvalidSamplingParams, StructuredOutput
from schemas.tokenizer import Tool, ToolFunction
from services.agent import grammar
from services.agent.grammar import (
    GrammarCompiler,
    GrammarError,
    allocate_masks,
    apply_masks,
    fill_masks,
    fill_masks_with_drafts,
)
from services.agent.tool_parsers import TOOL_PARSERS

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "kind", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(model_dir):
    return GrammarCompiler.for_model(model_dir, cache_size=4)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def walk(compiler, constraint, num_rows: int, seed: int, max_steps: int = 400,
         bias: torch.Tensor | None = None) -> list[list[int]]:
    """Sample ``num_rows`` outputs at once from seeded random logits (plus ``bias``) under the grammar's masks."""
    eos = set(compiler.tokenizer.eos_tokens)
    matchers = [compiler.matcher(constraint) for _ in range(num_rows)]
    outputs: list[list[int]] = [[] for _ in range(num_rows)]
    live = list(range(num_rows))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        if not live:
            return outputs
        masks = allocate_masks(len(live), compiler.vocab_size)
        fill_masks([(matchers[r], i) for i, r in enumerate(live)], masks)
        logits = torch.randn(num_rows, compiler.vocab_size, generator=gen)
        if bias is not None:
            logits += bias
        apply_masks(logits, masks, rows=live)
        for r in list(live):
            token = int(torch.multinomial(torch.softmax(logits[r], -1), 1, generator=gen))
            if token in eos:
                assert matchers[r].can_finish
                live.remove(r)
                continue
            assert matchers[r].accept(token), matchers[r].error
            outputs[r].append(token)
    raise AssertionError(f"{len(live)} walks did not finish in {max_steps} steps")


def test_random_walks_validate_against_the_schema(compiler, hf_tokenizer):
    constraint = grammar.json_schema_constraint(PET)
    texts = []
    for seed in range(3):
        for ids in walk(compiler, constraint, num_rows=8, seed=seed):
            text = hf_tokenizer.decode(ids)
            jsonschema.validate(json.loads(text), PET)
            texts.append(text)
    assert len(set(texts)) > 20  # the walks explore: they are not one path


def test_json_object_and_regex(compiler, hf_tokenizer):
    # any object: strings and nesting are unbounded, so closing tokens are favoured to end the walks
    closing = torch.zeros(compiler.vocab_size)
    for token_id, text in enumerate(hf_tokenizer.batch_decode([[i] for i in range(len(hf_tokenizer))])):
        if text and set(text) <= set('"}]'):
            closing[token_id] = 6.0
    for ids in walk(compiler, StructuredOutput(kind="json_object"), num_rows=4, seed=5, bias=closing):
        assert isinstance(json.loads(hf_tokenizer.decode(ids)), dict)
    import re

    for ids in walk(compiler, StructuredOutput(kind="regex", spec=r"(yes|no), [0-9]{2,4}"), num_rows=4, seed=6):
        assert re.fullmatch(r"(yes|no), [0-9]{2,4}", hf_tokenizer.decode(ids))


def test_the_tool_call_grammar_makes_calls_the_parser_reads(compiler, hf_tokenizer):
    tools = [Tool(function=ToolFunction(name="get_weather", parameters={
                 "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                  "unit": {"enum": ["c", "f"]}}, "required": ["city"],
                 "additionalProperties": False})),  # (open objects make unbounded walks)
             Tool(function=ToolFunction(name="get_time", parameters={"type": "object", "properties": {},
                                                                     "additionalProperties": False}))]
    parser_cls = TOOL_PARSERS.get("hermes")
    names, counts = set(), set()
    ending = torch.zeros(compiler.vocab_size)
    ending[compiler.tokenizer.eos_tokens] = 3.0  # parallel calls: a walk ends when it stops calling
    for parallel in (False, True):
        constraint = StructuredOutput(kind="lark", spec=parser_cls.call_grammar(tools, parallel=parallel))
        for ids in walk(compiler, constraint, num_rows=8, seed=11 + parallel, bias=ending):
            parser = parser_cls(tools)
            parsed = parser.feed(hf_tokenizer.decode(ids)).add(parser.finish())
            assert parsed.content == "" and parsed.calls
            for first, rest in zip(parsed.calls[::2], parsed.calls[1::2]):  # id+name, then arguments
                schema = next(t.function.parameters for t in tools if t.function.name == first.name)
                jsonschema.validate(json.loads(rest.arguments), schema)
                names.add(first.name)
            assert parallel or len(parsed.calls) == 2
            counts.add(len(parsed.calls) // 2)
    assert names == {"get_weather", "get_time"} and max(counts) > 1


def test_rollback_drafts_and_rebuild_match_stepping(compiler, hf_tokenizer):
    constraint = grammar.json_schema_constraint(PET)
    [ids] = walk(compiler, constraint, num_rows=1, seed=21)
    k = len(ids) // 2

    def mask_of(matcher):
        m = allocate_masks(1, compiler.vocab_size)
        matcher.fill_mask(m)
        return m

    stepped = compiler.matcher(constraint)
    for t in ids[:k]:
        assert stepped.accept(t)
    at_k = mask_of(stepped)
    # drafts: the grammar allows the walk's own continuation, and stops at a token that breaks it
    bad = hf_tokenizer.encode("}}}}", add_special_tokens=False)[0]
    assert stepped.accept_drafts(ids[k:k + 5]) == len(ids[k:k + 5])
    assert stepped.accept_drafts([*ids[k:k + 2], bad]) == 2
    assert torch.equal(mask_of(stepped), at_k) and stepped.num_tokens == k  # validating did not move it
    # a verifying sequence's rows: the mask now, then after each draft; a forbidden draft ends them
    rows = allocate_masks(7, compiler.vocab_size)
    fill_masks_with_drafts([(stepped, 1, [*ids[k:k + 3], bad, ids[k + 3]])], rows)
    probe = compiler.rebuild(constraint, ids[:k])
    for j in range(4):
        assert torch.equal(rows[1 + j], mask_of(probe)[0]), j
        probe.accept(ids[k + j])
    assert (rows[0] == -1).all() and (rows[5] == -1).all() and (rows[6] == -1).all()  # left as they were
    assert stepped.num_tokens == k and torch.equal(mask_of(stepped), at_k)
    # accepted drafts rejected by the target model: rolled back
    for t in ids[k:k + 5]:
        assert stepped.accept(t)
    stepped.rollback(5)
    assert torch.equal(mask_of(stepped), at_k) and stepped.num_tokens == k
    with pytest.raises(ValueError):
        stepped.rollback(k + 1)
    # migration: a new worker replays the tokens so far
    assert torch.equal(mask_of(compiler.rebuild(constraint, ids[:k])), at_k)
    with pytest.raises(GrammarError, match="breaks the grammar"):
        compiler.rebuild(constraint, [*ids[:k], bad])
    # a forbidden token fails this matcher alone
    broken = compiler.matcher(constraint)
    assert not broken.accept(bad) and broken.error
    assert compiler.matcher(constraint).error is None


def test_compiled_grammars_are_cached_lru(model_dir):
    small = GrammarCompiler.for_model(model_dir, cache_size=2)
    specs = [grammar.json_schema_constraint({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
             for i in range(3)]
    small.matcher(specs[0]), small.matcher(specs[0]), small.matcher(specs[1])
    assert small.num_compiled == 2 and len(small) == 2
    small.matcher(specs[0])  # most recent now; specs[1] is the oldest
    small.matcher(specs[2])
    assert small.num_compiled == 3 and len(small) == 2
    small.matcher(specs[0])
    assert small.num_compiled == 3  # still cached
    small.matcher(specs[1])
    assert small.num_compiled == 4  # was evicted


def test_apply_masks_rows_and_padded_vocabularies():
    logits = torch.zeros(3, 70)
    masks = allocate_masks(2, 64)
    masks.zero_()
    masks[0, 0] = 1 << 3  # row 0 of the mask: token 3 only
    masks[1, 1] = 1 << 0  # row 1: token 32 only
    apply_masks(logits, masks, rows=[2, 0])
    assert torch.isinf(logits[1]).sum() == 0  # row 1 of the logits had no mask
    assert logits[2].isfinite().nonzero().flatten().tolist() == [3]
    assert logits[0].isfinite().nonzero().flatten().tolist() == [32]  # tokens 64..69: past the mask, forbidden


@pytest.mark.parametrize("constraint,match", [
    (StructuredOutput(kind="json_schema", spec='{"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}'),
     "cannot be enforced"),
    (StructuredOutput(kind="json_schema", spec="{not json"), "invalid"),
    (StructuredOutput(kind="regex", spec="(unclosed"), "cannot be enforced"),
    (StructuredOutput(kind="lark", spec="start: missing_rule"), "cannot be enforced"),
])
def test_bad_specs_are_refused(compiler, constraint, match):
    with pytest.raises(GrammarError, match=match):
        grammar.check(constraint)
    with pytest.raises(GrammarError, match=match):
        compiler.matcher(constraint)


@pytest.mark.parametrize("schema", [
    {"enum": [f"value_{i}" for i in range(12000)]},  # xgrammar took 28 s on 20,000
    {"type": "array", "items": {"type": "integer"}, "minItems": 5000, "maxItems": 10000},
    {"type": "string", "minLength": 1000, "maxLength": 100000},
    json.loads('{"type": "object", "properties": {"a": ' * 100 + '{"type": "integer"}' + "}}" * 100),
    {"type": "string", "pattern": "(a|b)*a(a|b){30}"},
    {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)},
     "required": [f"p{i}" for i in range(3000)]},
])
def test_pathological_schemas_are_built_fast_or_refused(compiler, schema):
    constraint = grammar.json_schema_constraint(schema)
    started = time.monotonic()
    try:
        matcher = compiler.matcher(constraint)
        masks = allocate_masks(1, compiler.vocab_size)
        matcher.fill_mask(masks)
    except GrammarError:
        pass
    assert time.monotonic() - started < grammar.MAX_COMPILE_SECONDS


def test_huge_specs_are_refused_before_any_work():
    with pytest.raises(InvalidSamplingParams, match="at most"):
        StructuredOutput(kind="regex", spec="a" * (MAX_STRUCTURED_SPEC_CHARS + 1))
    with pytest.raises(InvalidSamplingParams, match="kind must be one of"):
        StructuredOutput(kind="ebnf", spec="x")
