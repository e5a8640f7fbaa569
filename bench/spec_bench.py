"""Speculative decoding against plain decoding, in the same process and run.

    python -m bench.spec_bench                       # full in-process run (~10-15 min on 2 cores)
    python -m bench.spec_bench --tiny                # smoke check (< 1 min of decoding)
    python -m bench.spec_bench --system              # also through kvbus up (local and remote drafter)
    python -m bench.spec_bench --draft-layers 8      # add the model drafter (first 8 layers of the target)
    python -m bench.spec_bench --workloads long      # only the long-context workload (~3 min)

Workloads (greedy, fp32, the default model, chat-formatted prompts):
  agentic   a file in the prompt and "repeat it with one change": output copies its context
  chat      open-ended questions: little to copy
  long      an agent's long context: ~2,700 tokens of files read so far, "repeat the last one with
            one change"; 4 such prompts (4 concurrent: below the 8 decode rows where speculation
            pauses), so the verification rows attend over long contexts
Rows: single stream (each prompt alone; TPOT = decode time per token after the first) and N
concurrent (all submitted at once, N = 8, 4 for long; output tokens/s over the run), for
plain / ngram [/ model].
Speedup is against plain in the same run. Acceptance = accepted / drafted tokens; mean accepted
length = tokens appended per verification step. --system adds TPOT through the system, and the
share of engine step time the worker spent waiting for drafts (for remote: the bus round trip).
Goals (issue 8): agentic single stream >= 1.5x with ngram; chat no slower than plain.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

from bench.common import machine, median, table
from schemas.engine import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_FILES = [
    "import json\nimport os\n\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def save(path, data):\n    tmp = path + '.tmp'\n    with open(tmp, 'w') as f:\n        json.dump(data, f)\n"
    "    os.replace(tmp, path)\n\n\ndef merge(a, b):\n    out = dict(a)\n    for key, value in b.items():\n"
    "        out[key] = value\n    return out\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, word):\n"
    "        self.counts[word] = self.counts.get(word, 0) + 1\n\n    def top(self, n):\n"
    "        items = sorted(self.counts.items(), key=lambda kv: -kv[1])\n        return items[:n]\n",
    "SERVER_PORT=8080\nSERVER_HOST=0.0.0.0\nLOG_LEVEL=info\nDB_URL=postgres://db:5432/app\nCACHE_TTL=300\n"
    "MAX_WORKERS=16\nTIMEOUT_SECONDS=30\nFEATURE_FLAGS=search,upload,export\n",
]
_CHANGES = ["rename the function merge to combine", "rename the method top to most_common",
            "change LOG_LEVEL to debug"]
AGENTIC = [f"Here is a file:\n```\n{f}```\nRepeat the whole file exactly, but {c}. Output only the file."
           for f, c in zip(_FILES, _CHANGES)]
LONG_FILES = 24  # files in each long prompt (~2,700 tokens with the chat template)


def _long_texts() -> list[str]:
    texts = []
    for i in range(4):
        files = [_FILES[(i + j) % 3].replace("path", f"path{j}").replace("word", f"word{j}") for j in range(LONG_FILES)]
        listing = "".join(f"### file{j}.py\n```\n{f}```\n" for j, f in enumerate(files))
        texts.append(f"Files read so far:\n{listing}\nRepeat file{LONG_FILES - 1}.py exactly, but "
                     f"{_CHANGES[(i + LONG_FILES - 1) % 3]}. Output only the file.")
    return texts


CHAT = ["Tell me about the history of the bicycle.", "What makes a good cup of coffee?",
        "Describe a walk through a forest in autumn.", "Why is the sky blue? Explain simply."]


def _prompts(tok, texts: list[str]) -> list[list[int]]:
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for t in texts]


def single_stream(engine, prompts, params) -> tuple[float, float]:
    """(median TPOT seconds, output tokens/s) with each prompt alone."""
    tpots, tokens, seconds = [], 0, 0.0
    for p in prompts:
        engine.add_request("b", p, params)
        t0 = time.perf_counter()
        first = None
        n = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.new_token_ids and first is None:
                    first = time.perf_counter()
                n += len(out.new_token_ids)
        end = time.perf_counter()
        if n > 1:
            tpots.append((end - first) / (n - 1))
        tokens += n
        seconds += end - t0
    return median(tpots), tokens / seconds


def concurrent(engine, prompts, params, n: int = 8) -> float:
    batch = (prompts * n)[:n]
    t0 = time.perf_counter()
    done = engine.generate_sync(batch, params)
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - t0)


def spec_counters(engine):
    st = engine.stats
    return st.num_drafted_tokens, st.num_accepted_tokens, st.num_spec_steps


def run_in_process(args) -> None:
    from services.draft.base import make_drafter
    from services.engine import EngineConfig, build_engine

    engine = build_engine(EngineConfig(dtype="float32", kv_cache_memory=1.0,
                                    num_speculative_tokens=args.k, speculative_method=None))
    tok = engine.tokenizer
    workloads = {"agentic": _prompts(tok, AGENTIC), "chat": _prompts(tok, CHAT), "long": _prompts(tok, _long_texts())}
    workloads = {k: v for k, v in workloads.items() if k in args.workloads}
    if args.tiny:
        workloads = {k: v[:1] for k, v in workloads.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    drafters = {"plain": None, "ngram": make_drafter("ngram")}
    if args.draft_layers:
        from services.models.truncate import write_truncated_model

        folder = write_truncated_model(engine.model_dir, tempfile.mkdtemp() + "/draft", args.draft_layers)
        drafters["model"] = make_drafter("model", model=str(folder), target_dir=str(engine.model_dir))
    engine.generate_sync(_prompts(tok, CHAT[:1]), SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    rows = []
    for wname, prompts in workloads.items():
        base = {}
        for dname, drafter in drafters.items():
            engine.set_drafter(drafter)
            engine.block_manager.evict_all_cached()
            before = spec_counters(engine)
            tpot, tps = single_stream(engine, prompts, params)
            n_conc = 2 if args.tiny else 4 if wname == "long" else 8
            conc = concurrent(engine, prompts, params, n_conc)
            drafted, accepted, steps = (a - b for a, b in zip(spec_counters(engine), before))
            if dname == "plain":
                base = {"tpot": tpot, "tps": tps, "conc": conc}
            rows.append([
                wname, dname, f"{tpot * 1e3:.1f}", f"{tps:.1f}", f"{base['tpot'] / tpot:.2f}x",
                n_conc, f"{conc:.1f}", f"{conc / base['conc']:.2f}x",
                f"{accepted / drafted:.2f}" if drafted else "-",
                f"{(accepted + steps) / steps:.2f}" if steps else "-",
            ])
    engine.set_drafter(None)
    print(table(rows, ["workload", "drafter", "TPOT ms", "1-stream tok/s", "TPOT speedup",
                       "N conc", "N-conc tok/s", "N-conc speedup", "acceptance", "mean accepted len"]))


async def _system_tpot(nats_url: str, prompts, params) -> float:
    from bus.nats_transport import BusConfig, connect
    from bus.subjects import GENERATE
    from schemas.generate import GenerateRequest

    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=300))
    tpots = []
    try:
        for p in prompts:
            first, n = None, 0
            async with bus.stream(GENERATE, GenerateRequest(prompt_token_ids=p, sampling=params)) as chunks:
                async for chunk in chunks:
                    if first is None:
                        first = time.perf_counter()
                    n += len(chunk.token_ids)
            if n > 1:
                tpots.append((time.perf_counter() - first) / (n - 1))
    finally:
        await bus.close()
    return median(tpots)


def run_system(args) -> None:
    from bus.nats_transport import BusConfig, connect
    from bus.subjects import WORKER_HEALTH
    from schemas.common import HealthRequest
    from services.local_system import LocalSystem
    from transformers import AutoTokenizer

    from services.models import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model(None)))
    prompts = _prompts(tok, AGENTIC[:1] if args.tiny else AGENTIC)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, base = [], None
    for label, extra in [("plain", ()), ("ngram local", ("--speculative", "ngram")),
                         ("ngram remote", ("--speculative", "ngram", "--draft-placement", "remote"))]:
        with LocalSystem("--aggregated", *extra) as system:
            tpot = asyncio.run(_system_tpot(system.nats_url, prompts, params))

            async def detail():
                bus = await connect(BusConfig(nats_url=system.nats_url))
                try:
                    return (await bus.request(WORKER_HEALTH, HealthRequest(), role="worker",
                                              worker_id="worker-0")).detail
                finally:
                    await bus.close()

            d = asyncio.run(detail())
        base = base or tpot
        rows.append([label, f"{tpot * 1e3:.1f}", f"{base / tpot:.2f}x", d.get("spec_acceptance", "-"),
                     d.get("spec_draft_share", "-")])
    print(table(rows, ["kvbus up (agentic, 1 stream)", "TPOT ms", "speedup", "acceptance",
                       "draft share of step"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="one prompt per workload, short outputs")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-layers", type=int, default=0, help="also bench the model drafter with this many layers")
    ap.add_argument("--system", action="store_true", help="also measure through kvbus up")
    ap.add_argument("--workloads", nargs="+", choices=["agentic", "chat", "long"], default=["agentic", "chat", "long"])
    args = ap.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 24 if args.tiny else 160
    print(machine())
    run_in_process(args)
    if args.system:
        run_system(args)


if __name__ == "__main__":
    main()
