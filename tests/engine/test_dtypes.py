"""bf16 / fp16 weights and bf16 / fp8 KV caches against the fp32 engine."""

from __future__ import annotations

import pytest
import torch

from schemas.engine import SamplingParams
from tests.engine.conftest import make_engine

P = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def fp32_tokens(engine, prompt_ids):
    return [o.token_ids for o in engine.generate_sync(prompt_ids, P)]


def agreement(outs, ref):
    first = sum(o.token_ids[0] == r[0] for o, r in zip(outs, ref))
    exact = sum(o.token_ids == r for o, r in zip(outs, ref))
    return first, exact


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype, torch_dtype, min_exact", [
    ("fp8_e4m3", torch.float8_e4m3fn, 5), ("bfloat16", torch.bfloat16, 8),
])
def test_kv_cache_dtype(model_dir, prompt_ids, fp32_tokens, kv_dtype, torch_dtype, min_exact):
    eng = make_engine(model_dir, kv_cache_dtype=kv_dtype, kv_cache_memory=0.05)
    assert eng.kv_pool.data.dtype == torch_dtype and eng.dtype == torch.float32
    # fp8 pages are a quarter of fp32 ones: 4x the pages in the same memory
    assert eng.block_manager.num_pages == int(0.05 * 1024**3 // (30 * 2 * 16 * 3 * 64 * torch_dtype.itemsize))
    outs = eng.generate_sync(prompt_ids, P)
    first, exact = agreement(outs, fp32_tokens)
    assert first == len(prompt_ids) and exact >= min_exact
    assert eng.block_manager.num_used_pages == 0


@pytest.mark.slow
def test_bf16_weights(model_dir, prompt_ids, fp32_tokens):
    eng = make_engine(model_dir, dtype="bfloat16", kv_cache_memory=0.05)
    from services.engine.linear import CpuWeight, packed_decode

    assert eng.model.w.embed.dtype == torch.bfloat16 and eng.kv_pool.data.dtype == torch.bfloat16
    qkv = eng.model.w.layers[0].qkv
    from kernels.cpu_path import onednn_takes_bf16

    if packed_decode(torch.bfloat16):  # prepacked for oneDNN (prefill) and packed pairs (decode)
        assert type(qkv) is CpuWeight and qkv.dense.is_mkldnn and qkv.packed.dtype == torch.bfloat16
    elif onednn_takes_bf16():  # no avx512_bf16: oneDNN serves every step
        assert qkv.is_mkldnn
    else:  # oneDNN takes no bf16 weights on this CPU (no avx512bw/vl/dq, no avx_ne_convert): F.linear
        assert type(qkv) is torch.Tensor and not qkv.is_mkldnn and qkv.dtype == torch.bfloat16
    outs = eng.generate_sync(prompt_ids, P)
    first, exact = agreement(outs, fp32_tokens)
    assert first >= len(prompt_ids) - 1 and exact >= len(prompt_ids) // 2


def test_linear_backends_agree():
    from services.engine.linear import can_prepack, linear, prepack

    if not can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    packed = prepack(w)
    assert packed.is_mkldnn and not w.is_mkldnn
    for rows in (1, 3, 8, 33):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(linear(x, packed, b), linear(x, w, b), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(linear(x, packed), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-5)
    from kernels.cpu_path import onednn_takes_bf16

    # bfloat16 weights go to oneDNN only where its reorder takes them (else it raises at load)
    assert can_prepack(torch.device("cpu"), torch.bfloat16) == onednn_takes_bf16()
    assert not can_prepack(torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("out_features,in_features", [(576, 1536), (960, 576), (3072, 576)])
def test_a_rows_projection_does_not_depend_on_how_many_rows_share_it(out_features, in_features):
    # a prompt's last token computed alone (its prefix cached) must get the cold run's logits
    from services.engine.linear import PREFILL_ROWS, can_prepack, linear, prepack

    if not can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN in this torch build")
    g = torch.Generator().manual_seed(0)
    w = prepack(torch.randn(out_features, in_features, generator=g) * 0.02, PREFILL_ROWS)
    x = torch.randn(300, in_features, generator=g)
    every = linear(x, w)
    for rows in (1, 2, 17):
        assert torch.equal(linear(x[-rows:].contiguous(), w), every[-rows:]), rows


@pytest.mark.slow
def test_unpacked_weights_match_hf_too(model_dir, prompt_ids, hf_greedy):
    eng = make_engine(model_dir, prepack_weights=False, kv_cache_memory=0.05)
    assert not eng.model.w.layers[0].qkv.is_mkldnn
    outs = eng.generate_sync(prompt_ids[:4], SamplingParams(temperature=0.0, max_tokens=64))
    assert [o.token_ids for o in outs] == hf_greedy[:4]


@pytest.mark.parametrize("out_features,in_features", [(96, 40), (17, 576), (1000, 33)])
def test_packed_decode_weights_agree_with_f_linear(out_features, in_features):
    # the native packed GEMM (decode rows) and oneDNN (prefill rows) behind one CpuWeight
    from kernels import native
    from services.engine.linear import NATIVE_MAX_ROWS, CpuWeight, linear

    if not native.available():
        pytest.skip(f"native kernels: {native.unavailable_reason()}")
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g)
    cw = CpuWeight(w)
    assert cw.shape == (out_features, in_features)
    for rows in (1, 2, 3, 4, 5, 8, 9, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 25, 40):
        x = torch.randn(rows, in_features, generator=g)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double()).float()
        for packed in (True, False):
            torch.testing.assert_close(linear(x, cw, b, packed), want, atol=1e-4, rtol=1e-5)
            torch.testing.assert_close(linear(x, cw, None, packed), want - b, atol=1e-4, rtol=1e-5)
        # the packed kernel itself at any row count (the lm_head's rule), in passes of 12 rows
        torch.testing.assert_close(linear(x, cw, b, True, max_rows=None), want, atol=1e-4, rtol=1e-5)
    # a strided view of rows (the engine passes slices)
    x = torch.randn(6, in_features * 2, generator=g)[:, :in_features]
    torch.testing.assert_close(linear(x, cw, None, True), x @ w.T, atol=1e-4, rtol=1e-5)
    # a decode row's result does not depend on the rows beside it (batch-invariant decode)
    rows = torch.randn(NATIVE_MAX_ROWS, in_features, generator=g)
    alone = torch.cat([linear(rows[i:i + 1], cw, b, True) for i in range(NATIVE_MAX_ROWS)])
    for n in range(1, NATIVE_MAX_ROWS + 1):  # every tile shape
        assert torch.equal(linear(rows[:n], cw, b, True), alone[:n]), n


@pytest.mark.parametrize("out_features,in_features", [(96, 40), (17, 576), (1000, 33)])
def test_packed_bf16_gemm_agrees_with_a_float64_reference(out_features, in_features):
    # bf16 weights: pairs of k per 64-byte line (odd K padded), float32 sums, one rounding to bf16
    from services.engine.linear import NATIVE_MAX_ROWS, CpuWeight, linear, packed_decode

    if not packed_decode(torch.bfloat16):
        pytest.skip("no native build with avx512_bf16 dot products on this CPU")
    g = torch.Generator().manual_seed(2)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    cw = CpuWeight(w)
    assert cw.shape == (out_features, in_features) and cw.packed.shape == (-(-out_features // 16), -(-in_features // 2), 32)

    def close(got, want):  # within one bf16 rounding of the exact sum (2^-8 relative) or a float32 slip
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)

    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 13, 25, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        close(linear(x, cw, b, True, max_rows=None), want)
        close(linear(x, cw, None, True, max_rows=None), want - b.double())
        close(linear(x, cw, b, False), want)  # oneDNN, the prefill layout
    # a strided view of rows
    x = torch.randn(6, in_features * 2, generator=g).bfloat16()[:, :in_features]
    close(linear(x, cw, None, True), x.double() @ w.double().T)
    # a decode row's result does not depend on the rows beside it
    rows = torch.randn(NATIVE_MAX_ROWS, in_features, generator=g).bfloat16()
    alone = torch.cat([linear(rows[i:i + 1], cw, b, True) for i in range(NATIVE_MAX_ROWS)])
    for n in range(1, NATIVE_MAX_ROWS + 1):
        assert torch.equal(linear(rows[:n], cw, b, True), alone[:n]), n


@pytest.mark.slow
def test_bf16_greedy_follows_transformers_in_bf16(model_dir, prompt_ids):
    # The bf16 engine against transformers in bf16 on the same inputs (the fp32 tests pin fp32).
    # Two bf16 implementations sum in different orders, so a near-tie may break either way: at every
    # step the engine's token must be transformers' argmax, or within bf16 noise of it in
    # transformers' own logits (teacher-forced on the engine's tokens), and most steps must agree
    # exactly. A wrong bf16 path (a misrounded weight, a bad kernel) picks tokens far below the top.
    # Short prompts and 8 tokens: without native bf16 (this CPU may lack it) every product is slow.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True).eval()
    eng = make_engine(model_dir, dtype="bfloat16", kv_cache_memory=0.05)
    assert eng.dtype == torch.bfloat16
    prompts = [prompt_ids[i] for i in (0, 4, 5)]
    n = 8
    outs = eng.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    num_exact = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            assert len(out.token_ids) == n
            ids = torch.tensor([prompt + out.token_ids])
            logits = hf(ids).logits[0, len(prompt) - 1:-1].float()  # [n, V]: the step that chose each token
            chosen = logits[torch.arange(n), torch.tensor(out.token_ids)]
            top = logits.max(-1).values
            assert torch.all(top - chosen <= 0.5), (prompt, out.token_ids, (top - chosen).tolist())
            num_exact += int((chosen == top).sum())
    assert num_exact >= len(prompts) * n - 2
    assert eng.block_manager.num_used_pages == 0
