"""Each supported architecture, on tiny random HF checkpoints (sharded), against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from schemas.engine import SamplingParams
from services.engine import EngineConfig, LLMEngine
from services.engine.model_config import ModelConfig, UnsupportedModelError
from tests.tiny_model import save_tiny_model, tiny_config

# The shared tiny dimensions (tests/tiny_model.py), with a 320-token vocabulary: every architecture
# is compared with transformers' logits, and peaked logits keep greedy choices off near-ties.
VOCAB = 320


def _llama3():
    from transformers import LlamaConfig

    return tiny_config(
        LlamaConfig, vocab_size=VOCAB,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=64),
        rope_theta=500000.0,
    )


def _llama_bias():
    from transformers import LlamaConfig

    return tiny_config(LlamaConfig, vocab_size=VOCAB, attention_bias=True, mlp_bias=True, head_dim=24,
                       tie_word_embeddings=True)


def _qwen2():
    from transformers import Qwen2Config

    return tiny_config(Qwen2Config, vocab_size=VOCAB, tie_word_embeddings=True)


def _mistral():
    from transformers import MistralConfig

    return tiny_config(MistralConfig, vocab_size=VOCAB, sliding_window=None)


@pytest.fixture(scope="module", params=["llama3", "llama_bias", "qwen2", "mistral"])
def tiny(request, tmp_path_factory, model_dir):
    config = {"llama3": _llama3, "llama_bias": _llama_bias, "qwen2": _qwen2, "mistral": _mistral}[request.param]()
    # random biases, so a missing bias would show; sharded, so the loader's index is exercised
    path, hf = save_tiny_model(tmp_path_factory.mktemp(request.param), config, tokenizer_from=model_dir,
                               random_biases=True, max_shard_size="100KB")
    return request.param, path, hf


def test_tiny_checkpoint_is_sharded(tiny):
    _, path, _ = tiny
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_logits_prefill_and_decode_match_hf(tiny):
    name, path, hf = tiny
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=0.01,
                                    page_size=8, load_tokenizer=False))
    assert engine.model_config.architecture == type(hf).__name__
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 37, 100)]
    outs = engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for p, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert out.token_ids == ref[0, len(p):].tolist(), name
    # Logits of the whole continuation (positions past the llama3 original context too).
    [out] = engine.generate_sync([prompts[2]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True))
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompts[2] + out.token_ids])).logits[0].float(), -1)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(prompts[2]) - 1 + i]
        assert lp.top_token_ids[0] == int(row.argmax())
        torch.testing.assert_close(torch.tensor(lp.top_logprobs), row.topk(5).values, atol=1e-4, rtol=0)


def test_native_decode_stack_equals_the_per_op_loop(tiny):
    """Biases, head_dim 24, llama3 RoPE: the one-call decode stack gives the loop's bits."""
    from kernels import native

    if not native.available():
        pytest.skip("native CPU kernels not built")
    name, path, _ = tiny
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (5, 37, 100)]

    def run(fused: bool):
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", kv_cache_memory=0.01,
                                        page_size=8, load_tokenizer=False))
        if fused:
            assert engine.model.decode_stack() is not None
        else:
            engine.model._stack = None
        outs = engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                                                            ignore_eos=True))
        return [(o.token_ids, [lp.top_logprobs for lp in o.logprobs]) for o in outs]

    assert run(True) == run(False), name


def test_unsupported_architecture_is_a_clear_value_error(tmp_path):
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_dict(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path), load_tokenizer=False))


def test_supported_list_agrees_with_model_provisioning():
    from services.models import SUPPORTED_ARCHITECTURES
    from services.engine.model_config import SUPPORTED_ARCHITECTURES as ours

    assert tuple(SUPPORTED_ARCHITECTURES) == ours


def test_config_parsing_variants():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    old_llama3 = ModelConfig.from_dict({
        **base, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "eos_token_id": [128001, 128009],
    }, {"eos_token_id": [128001, 128008, 128009]})
    assert old_llama3.rope_theta == 500000.0 and old_llama3.rope_scaling["rope_type"] == "llama3"
    assert old_llama3.eos_token_ids == (128001, 128008, 128009)
    assert old_llama3.num_kv_heads == 2 and old_llama3.head_dim == 4
    qwen = ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 128, "use_sliding_window": False})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096,
                                     "max_position_embeddings": 32768})
    assert mistral.max_model_len == 4096  # the paged kernels have no window mask
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"})
