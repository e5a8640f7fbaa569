"""One tiny random checkpoint builder for every test that counts pages or steps rather than judging text.

A 2-layer model of hidden size 64 computes a step in well under a millisecond on 2 cores, so tests
of the scheduler, the cache tiers and the workers build as many engines as they like. Its
vocabulary is the default model's (49,152), so any token id a test draws for the real model is
valid here and the default model's tokenizer can sit beside it (the folder check wants one).

``initializer_range`` 0.5 gives peaked logits, so greedy choices do not hinge on last-bit
differences between two ways of computing the same step (a prefix-cache hit against a cold run);
the default 0.02 gives near-flat logits and near-ties.

The ``tiny_model`` fixture (tests/conftest.py) is this checkpoint, built once per session; tests
of other architectures and shapes call :func:`save_tiny_model` with a config of their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

TINY_DIMS = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.5,
)
TINY_VOCAB = 49152  # SmolLM2's


def tiny_config(config_cls=None, **overrides):
    """A transformers config (``LlamaConfig`` unless given) of :data:`TINY_DIMS`, changed by ``overrides``."""
    if config_cls is None:
        from transformers import LlamaConfig as config_cls
    return config_cls(**{"vocab_size": TINY_VOCAB, "tie_word_embeddings": False, **TINY_DIMS, **overrides})


def save_tiny_model(path, config=None, *, tokenizer_from=None, seed: int = 0, random_biases: bool = False,
                    max_shard_size: str | None = None):
    """Write a seeded random checkpoint of ``config`` (default :func:`tiny_config`) into ``path``.

    ``tokenizer_from``: a model folder whose ``tokenizer.json`` is copied beside it.
    ``random_biases``: draw every bias from N(0, 0.5), so a bias the engine misses shows.
    ``max_shard_size``: shard the weights (``"100KB"``). Returns ``(path, model)``.
    """
    import torch
    import transformers

    config = config or tiny_config()
    names = config.architectures or [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "mistral": "MistralForCausalLM"}[config.model_type]]
    torch.manual_seed(seed)
    model = getattr(transformers, names[0])(config).eval()
    if random_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    path = Path(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer_from is not None:
        shutil.copy(Path(tokenizer_from) / "tokenizer.json", path / "tokenizer.json")
    return path, model


def save_chat_tiny_model(path, model_dir) -> Path:
    """:func:`save_tiny_model` with ``model_dir``'s tokenizer and chat template: a system on it (kvbus up)
    proves itself ready with a chat completion. Returns the folder."""
    path, _ = save_tiny_model(path, tokenizer_from=model_dir)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, path / name)
    return path
