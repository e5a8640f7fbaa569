"""Constrained decoding's cost per decode step against unconstrained, in the same process and run; and
the grammar compile time of a typical tool schema, cold and cached.

    python -m bench.constrained_bench            # the full run (~3 min on 2 quiet cores)
    python -m bench.constrained_bench --quick    # smoke check (~1 min)

Decode rows (the default model, fp32, greedy, chat prompt): batch 1 and 8, each row the median time
of a decode step (the prefill step left out) over ``--tokens`` steps, modes interleaved A B C D and
repeated ``--reps`` times:

  plain         no per-row work (the chain is not entered)
  json          a JSON Schema with a long array (no instance ends before the run does), the engine's
                default: a row's mask is filled only when the grammar refuses the token drawn without
                it (a deferred row: logits_processors/chain.py)
  json-eager    the same, every row's mask filled every step on the mask thread while the forward
                pass runs (the path before deferred rows; what top-k/top-p/min-p rows take)
  json-inline   json-eager with the masks filled after the forward pass, on the engine thread
  penalties     presence, frequency, repetition penalties and a 20-entry logit_bias
  plain-t1      plain sampled at temperature 1.0 (seed 7)
  json-t1       json sampled at temperature 1.0 (seed 7), deferred: masked and drawn again only when
                the grammar refuses the first draw
  json-t1-eager json-t1 with a mask every step, overlapped (the path before deferred sampled rows)

"vs plain" is the step time against plain at the same batch size (plain-t1 for the sampled rows; goal
for json: <= 1.10x, issue 28);
"chain ms" is the engine thread's time in the logits-processor chain a step (its mask wait included),
"mask wait" what it still waited for masks after the forward pass.

Compile rows: a hermes call grammar over three tool schemas (services.agent.tool_parsers), through
the worker's GrammarCompiler: cold (a schema not in the cache: llguidance builds the grammar) and
cached (the same schema again: a copy of the cached matcher); the compiler itself (the tokenizer's
llguidance form, once per worker) is timed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench.common import machine, median, table
from schemas.engine import SamplingParams, StructuredOutput

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LONG_JSON = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200}},
    "required": ["title", "lines"], "additionalProperties": False}
TOOLS = [
    {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city"]}},
    {"name": "search_files", "description": "Search the repository", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "paths": {"type": "array",
                                                                                "items": {"type": "string"}},
                                         "max_results": {"type": "integer", "minimum": 1, "maximum": 100},
                                         "regex": {"type": "boolean"}},
        "required": ["query"]}},
    {"name": "edit_file", "description": "Replace text in a file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                         "new": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["path", "old", "new"]}},
]
PROMPT = "Write a JSON object with a title and many short lines of a poem about the sea."


def modes(tokens: int) -> dict[str, SamplingParams]:
    json_spec = StructuredOutput(kind="json_schema", spec=json.dumps(LONG_JSON))
    base = dict(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    sampled = dict(base, temperature=1.0, seed=7)
    return {
        "plain": SamplingParams(**base),
        "json": SamplingParams(**base, structured_output=json_spec),
        "json-eager": SamplingParams(**base, structured_output=json_spec),
        "json-inline": SamplingParams(**base, structured_output=json_spec),
        "penalties": SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                                    logit_bias={i: -1.0 for i in range(100, 120)}),
        "plain-t1": SamplingParams(**sampled),
        "json-t1": SamplingParams(**sampled, structured_output=json_spec),
        "json-t1-eager": SamplingParams(**sampled, structured_output=json_spec),
    }


BASELINE = {"plain-t1": "plain-t1", "json-t1": "plain-t1", "json-t1-eager": "plain-t1"}
"""The row each mode's "vs plain" divides by (default: plain)."""


def decode_step_seconds(engine, prompt: list[int], batch: int, params: SamplingParams) -> tuple[float, float, float]:
    """(median decode step seconds, mean chain seconds a step, mean mask wait a step) for ``batch``
    copies of ``prompt``."""
    chain = engine.runner.processors
    for i in range(batch):
        engine.add_request(f"b{i}", prompt, params)
    engine.step()  # the prefill (and first token)
    steps, chain0, wait0 = [], chain.seconds, chain.mask_wait_seconds
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    n = max(1, len(steps))
    return median(steps), (chain.seconds - chain0) / n, (chain.mask_wait_seconds - wait0) / n


def compile_times(engine, reps: int) -> tuple[float, float, float]:
    """(compiler build s, cold compile s median, cached s median) for a three-tool hermes call grammar."""
    from schemas.tokenizer import Tool, ToolFunction
    from services.agent.grammar import GrammarCompiler
    from services.agent.tool_parsers import TOOL_PARSERS

    t0 = time.perf_counter()
    compiler = GrammarCompiler.from_hf(engine.tokenizer, vocab_size=engine.model_config.vocab_size,
                                       eos_token_ids=list(engine.model_config.eos_token_ids))
    build = time.perf_counter() - t0
    cold, cached = [], []
    for r in range(reps):
        # a new schema each time (a description inside the parameters): a cache miss
        tools = [Tool(function=ToolFunction(name=t["name"], description=t["description"],
                                            parameters={**t["parameters"], "description": f"call {r}"})) for t in TOOLS]
        spec = StructuredOutput(kind="lark", spec=TOOL_PARSERS.get("hermes").call_grammar(tools, parallel=True))
        t0 = time.perf_counter()
        compiler.matcher(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.matcher(spec)
        cached.append(time.perf_counter() - t0)
    return build, median(cold), median(cached)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 steps, 1 repeat, 3 compiles")
    ap.add_argument("--tokens", type=int, default=None, help="decode steps per run (default 64; --quick 16)")
    ap.add_argument("--reps", type=int, default=None, help="repeats of each row (default 3; --quick 1)")
    ap.add_argument("--batches", default="1,8")
    args = ap.parse_args(argv)
    tokens = args.tokens or (16 if args.quick else 64)
    reps = args.reps or (1 if args.quick else 3)

    from services.engine import EngineConfig, build_engine
    from services.models import ensure_model

    engine = build_engine(EngineConfig(model=str(ensure_model()), dtype="float32", kv_cache_memory=0.5))
    tok = engine.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    chain = engine.runner.processors
    by_mode = modes(tokens)
    engine.generate_sync([prompt], by_mode["json"])  # warm up: the compiler and the grammar, the kernels
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        times: dict[str, list[float]] = {m: [] for m in by_mode}
        chains: dict[str, list[float]] = {m: [] for m in by_mode}
        waits: dict[str, list[float]] = {m: [] for m in by_mode}
        for _ in range(reps):
            for mode, params in by_mode.items():  # interleaved: a drift of the machine hits every mode
                chain.overlap = mode != "json-inline"
                chain.defer_masks = not mode.endswith(("-eager", "-inline"))
                step_s, chain_s, wait_s = decode_step_seconds(engine, prompt, batch, params)
                times[mode].append(step_s)
                chains[mode].append(chain_s)
                waits[mode].append(wait_s)
        chain.overlap, chain.defer_masks = True, True
        for mode in by_mode:
            t = median(times[mode])
            plain = median(times[BASELINE.get(mode, "plain")])
            rows.append([str(batch), mode, f"{t * 1e3:.1f}", f"{t / plain:.3f}x", f"{median(chains[mode]) * 1e3:.2f}",
                         f"{median(waits[mode]) * 1e3:.2f}"])
    print(f"constrained_bench: {machine()}; {tokens} decode steps a run, median of {reps}")
    print(table(rows, ["batch", "mode", "step ms", "vs plain", "chain ms", "mask wait ms"]))
    print(f"deferred constrained rows checked against the grammar: {chain.num_deferred_checked}, masked and drawn "
          f"again because it refused the token: {chain.num_deferred_redrawn} "
          f"({chain.num_deferred_redrawn / max(1, chain.num_deferred_checked):.1%})")
    build, cold, cached = compile_times(engine, 3 if args.quick else 10)
    print()
    print(table([["compiler (tokenizer, once per worker)", f"{build * 1e3:.0f}"],
                 ["hermes call grammar, 3 tools: cold", f"{cold * 1e3:.2f}"],
                 ["the same schema: cached", f"{cached * 1e3:.3f}"]], ["grammar", "ms"]))


if __name__ == "__main__":
    main()
