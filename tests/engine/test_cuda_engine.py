"""The engine on CUDA (Triton kernels) against transformers on the same GPU, on a tiny random Llama.

gpu-marked: skipped without CUDA. A random checkpoint keeps it self-contained (the default model's
files need not be on the GPU machine); peaked logits (initializer_range 0.5) keep greedy choices off
near-ties, so fp32 must agree token for token.
"""

from __future__ import annotations

import json

import pytest
import torch

from schemas.engine import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.5,
              tie_word_embeddings=False)


def _write_tokenizer(path) -> None:
    # The folder check wants a tokenizer.json; these tests feed token ids only.
    vocab = {f"t{i}": i for i in range(CONFIG["vocab_size"])}
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_model import save_tiny_model, tiny_config

    path, hf = save_tiny_model(tmp_path_factory.mktemp("tiny-cuda"), tiny_config(**CONFIG))
    _write_tokenizer(path)
    return path, hf.to("cuda")


def _engine(path, **overrides):
    from services.engine import EngineConfig, LLMEngine

    opts = dict(model=str(path), device="cuda", dtype="float32", kv_cache_memory=0.05, page_size=16,
                load_tokenizer=False)
    opts.update(overrides)
    return LLMEngine(EngineConfig(**opts))


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


def test_batched_greedy_matches_transformers_on_cuda(tiny):
    path, hf = tiny
    engine = _engine(path)
    prompts = _prompts((3, 17, 64, 200, 333))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = engine.generate_sync(prompts, params)  # one batch: mixed prefill, then batched decode
    for p, out in zip(prompts, outs):
        assert out.token_ids == _hf_greedy(hf, p, 16)
    # second time round: prefix-cache hits, then decode from the cached pages
    again = engine.generate_sync(prompts, params)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert sum(o.usage.cached_prompt_tokens for o in again) > 0
    assert engine.block_manager.num_used_pages == 0


def test_chunked_prefill_and_disaggregated_import_on_cuda(tiny):
    path, hf = tiny
    engine = _engine(path, chunked_prefill_size=48)
    [prompt] = _prompts((300,), seed=2)
    ref = _hf_greedy(hf, prompt, 12)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_prefill_request("p", prompt, params, skip_pages=6)
    while engine.has_unfinished():
        engine.step()
    result = engine.take_prefill_result("p")
    assert result.kv.is_cuda and result.first_token_id == ref[0]
    engine.block_manager.evict_all_cached()  # the 6 skipped pages are gone: recomputed before the import
    engine.add_prefilled_request("d", prompt, result.first_token_id, result.kv, params, kv_first_page=6)
    out = []
    while engine.has_unfinished():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == ref
    assert engine.scheduler.num_import_gaps == 1 and engine.block_manager.num_used_pages == 0


@pytest.mark.parametrize("overrides", [dict(kv_cache_dtype="fp8_e4m3", kv_fp8_scale=4.0), dict(dtype="bfloat16")],
                         ids=["fp8-kv", "bf16"])
def test_lossy_paths_agree_with_the_cpu_reference(tiny, overrides):
    """fp8 KV and bf16 weights are lossy by design, so the check is CUDA (Triton) against the CPU
    engine (torch references) with the same settings: the same greedy tokens, except that a
    divergence is allowed only at a near-tie (both top-2 sets equal, margin under 0.05)."""
    path, _ = tiny
    [prompt] = _prompts((120,), seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    [gpu] = _engine(path, **overrides).generate_sync([prompt], params)
    [cpu] = _engine(path, device="cpu", **overrides).generate_sync([prompt], params)
    for i, (a, b) in enumerate(zip(gpu.token_ids, cpu.token_ids)):
        if a != b:
            la, lb = gpu.logprobs[i], cpu.logprobs[i]
            assert set(la.top_token_ids) == set(lb.top_token_ids), (i, la, lb)
            assert abs(lb.top_logprobs[0] - lb.top_logprobs[1]) < 0.05, (i, lb)
            break
