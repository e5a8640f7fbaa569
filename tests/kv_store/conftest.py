"""A tiny random Llama checkpoint: for tests that count pages, not judge text (fast on 2 cores)."""

from __future__ import annotations

import shutil

import pytest
import torch


def save_tiny_llama(path):
    """A tiny random Llama checkpoint (seeded) in ``path``; no tokenizer file."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-5, initializer_range=0.5, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_dir):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    shutil.copy(model_dir / "tokenizer.json", path / "tokenizer.json")  # the folder check wants one
    return path


def pytest_collection_modifyitems(config, items):
    """gpu-marked tests need CUDA (as in tests/kernels)."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
