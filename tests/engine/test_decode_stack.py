"""The native decode stack (kvbus_cpu::decode_layers: every layer of a decode-only step in one call)
against the per-op loop it replaces: bit-identical logits, batch by batch.

Both paths run the same kernels in the same order on the same values, so equality is exact
(``torch.equal``), not a tolerance. A decode step of more rows than the packed GEMM serves
(``NATIVE_MAX_ROWS`` + 1 = 49) and a prefill keep the loop.
"""

from __future__ import annotations

import pytest
import torch

from schemas.engine import SamplingParams
from services.engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.skipif(not __import__("kernels.native", fromlist=["x"]).available(),
                                reason="native CPU kernels not built")


class Recorder:
    """Wraps LlamaModel.forward to keep every step's logits and whether the native stack served it
    (counted where the op is called: ``kernels.native.ops().decode_layers``)."""

    def __init__(self, model, fused: bool):
        from kernels import native

        self.model, self.steps, self.stack_calls = model, [], 0
        if not fused:
            model._stack = None  # the per-op loop only
        self.forward = model.forward
        model.forward = self
        self.native, self.ops = native, native.ops
        recorder = self

        class CountingOps:
            def __getattr__(self, name):
                op = getattr(recorder.ops(), name)
                if name != "decode_layers":
                    return op

                def counted(*args):
                    recorder.stack_calls += 1
                    return op(*args)

                return counted

        native.ops = CountingOps

    def restore(self) -> None:
        self.native.ops = self.ops

    def __call__(self, input_ids, positions, meta, logits_indices):
        before = self.stack_calls
        logits = self.forward(input_ids, positions, meta, logits_indices)
        decode_only = meta.num_decode_tokens == input_ids.shape[0]
        self.steps.append((input_ids.shape[0], self.stack_calls > before, logits.clone(), decode_only))
        return logits


def run(model_dir, fused: bool, prompts, max_tokens=6, dtype="float32"):
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_memory=0.3,
                                    load_tokenizer=False, max_running_requests=64))
    rec = Recorder(engine.model, fused)
    try:
        outs = engine.generate_sync(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        rec.restore()
    return [o.token_ids for o in outs], rec.steps


@pytest.mark.parametrize("batch", [1, 5, 12, 13, 24, 49])
def test_stack_logits_equal_the_per_op_loop(model_dir, batch):
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 20000, (int(n),), generator=g).tolist()
               for n in torch.randint(3, 90, (batch,), generator=g)]
    tokens_fused, fused = run(model_dir, True, prompts)
    tokens_loop, loop = run(model_dir, False, prompts)
    assert tokens_fused == tokens_loop
    assert len(fused) == len(loop)
    for (rows, stacked, a, _), (rows_b, _, b, _) in zip(fused, loop):
        assert rows == rows_b and torch.equal(a, b), f"step of {rows} rows differs"
    from services.engine.linear import NATIVE_MAX_ROWS

    decode_steps = [(rows, stacked) for rows, stacked, _, decode_only in fused if decode_only]
    assert len(decode_steps) >= 5
    # the stack served every decode step of up to NATIVE_MAX_ROWS rows (13-48: the packed kernel's
    # row groups), and 49 rows went to oneDNN projections, the loop
    assert all(stacked == (rows <= NATIVE_MAX_ROWS) for rows, stacked in decode_steps), decode_steps
    assert any(rows == batch for rows, _ in decode_steps)


def test_stack_is_off_where_it_cannot_serve(model_dir):
    from kernels import set_backend

    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=0.02,
                                    load_tokenizer=False))
    assert engine.model.decode_stack() is not None
    set_backend("torch")  # kernels forced to the references: no native stack either
    try:
        assert engine.model.decode_stack() is None
    finally:
        set_backend(None)
    fp8 = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_dtype="fp8_e4m3",
                                 kv_cache_memory=0.02, load_tokenizer=False))
    assert fp8.model.decode_stack() is None
    from services.engine.linear import packed_decode

    bf16 = LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_memory=0.02,
                                  load_tokenizer=False))
    assert (bf16.model.decode_stack() is None) == (not packed_decode(torch.bfloat16))


def test_bf16_stack_keeps_float32_activations(model_dir):
    # bf16 weights and KV: the stack rounds rows to bf16 only at the projections' inputs and the
    # stored K/V, where the per-op loop rounds every activation; so its logits sit nearer the
    # float32 engine's (same prompts, the first decode step: every path's inputs still agree)
    from services.engine.linear import packed_decode

    if not packed_decode(torch.bfloat16):
        pytest.skip("no avx512_bf16: bf16 decode steps run on oneDNN, without the stack")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(100, 20000, (int(n),), generator=g).tolist() for n in (40, 7, 85, 23, 60)]
    _, fused = run(model_dir, True, prompts, max_tokens=2, dtype="bfloat16")
    _, loop = run(model_dir, False, prompts, max_tokens=2, dtype="bfloat16")
    _, exact = run(model_dir, True, prompts, max_tokens=2)
    first = [next(step for step in steps if step[3]) for steps in (fused, loop, exact)]
    assert [rows for rows, *_ in first] == [5, 5, 5] and first[0][1] and not first[1][1] and first[2][1]
    stack_err = (first[0][2] - first[2][2]).abs().mean()
    loop_err = (first[1][2] - first[2][2]).abs().mean()
    assert stack_err < loop_err, (stack_err, loop_err)  # dev VM: 0.53 against 0.61
