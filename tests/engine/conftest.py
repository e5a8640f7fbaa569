"""Shared fixtures: the HF oracle (loaded once), its greedy references, and engines.

transformers is the test oracle only. Its greedy generations are the slow
part (about 40 ms a token here), so they are computed once per session and
also kept in pytest's cache, keyed by everything that could change them
(model files, prompts, transformers and torch versions); ``--cache-clear``
recomputes them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from services.engine import AsyncEngine, EngineConfig, LLMEngine, build_engine

MAX_NEW_TOKENS = 64

# Ten prompts of mixed lengths (4 to ~260 tokens), plain and chat-formatted.
_LONG = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; later, stored programs let the same hardware run many tasks. Assembly "
    "language gave names to instructions, compilers translated structured code into machine "
    "code, and operating systems hid the details of devices behind files and processes. "
)
PROMPT_TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    _LONG * 3 + "Summarize the passage above in one sentence:",
    "Q: What is 17 times 23?\nA:",
    "List three uses of copper:\n1.",
    _LONG + "The next major step was",
    "Translate to French: 'The weather is nice today.'\nFrench:",
]
CHAT_MESSAGES = [
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain what a hash function is in two sentences."},
    ],
]


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(t) for t in PROMPT_TEXTS]
    for messages in CHAT_MESSAGES:
        ids.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)))
    return ids


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()


def _oracle_key(model_dir: Path, prompts: list[list[int]]) -> str:
    import transformers

    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")):
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps([prompts, MAX_NEW_TOKENS, transformers.__version__, torch.__version__]).encode())
    return "kvbus/engine/hf_greedy/" + h.hexdigest()[:24]


@pytest.fixture(scope="session")
def hf_greedy(request, model_dir, prompt_ids) -> list[list[int]]:
    """HF ``generate(do_sample=False)`` continuations, one prompt at a time, fp32."""
    key = _oracle_key(Path(model_dir), prompt_ids)
    cache = getattr(request.config, "cache", None)  # absent with -p no:cacheprovider
    cached = cache.get(key, None) if cache is not None else None
    if cached is not None:
        return cached
    hf = request.getfixturevalue("hf_model")
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
            refs.append(out[0, len(ids) :].tolist())
    if cache is not None:
        cache.set(key, refs)
    return refs


def make_engine(model_dir, **overrides) -> LLMEngine:
    opts = dict(model=str(model_dir), dtype="float32", kv_cache_memory=0.25, page_size=16)
    opts.update(overrides)
    return build_engine(EngineConfig(**opts))  # as the engine thread does at a service's start


@pytest.fixture(scope="session")
def engine(model_dir) -> AsyncEngine:
    """The default fp32 engine, shared, behind its async face (its sync calls and state read
    through); tests must leave it idle."""
    return AsyncEngine(make_engine(model_dir))
