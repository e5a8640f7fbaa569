"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, SmolLM2) over paged KV.

Plain tensors and free functions rather than nn.Modules: a decode step on CPU
is a few hundred small ops, and module dispatch would be a visible share.
Every compute op that has a kernel goes through ``kernels``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import (
    apply_rotary,
    backend_mode,
    native,
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rope_cos_sin_cache,
    silu_and_mul,
    store_kv,
)
from services.engine.kv_pool import KVPool
from services.engine.linear import NATIVE_MAX_ROWS, CpuWeight, linear
from services.engine.model_config import ModelConfig
from services.engine.weights import LayerWeights, ModelWeights

_NO_CU = torch.empty(0, dtype=torch.int32)  # decode_layers: a row per sequence


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the pool and what they attend to.

    The packed tokens are ``num_decode_tokens`` decode tokens (one per
    sequence, or 1 + k for a sequence verifying k drafts) followed by the
    prefill chunks; either part may be empty.
    """

    slot_mapping: torch.Tensor  # [T] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None  # [Bd, P] int32
    decode_seq_lens: torch.Tensor | None = None  # [Bd] int32
    # Set when some sequence verifies drafts: [Bd + 1] int32, sequence b's rows are
    # cu[b] .. cu[b+1] - 1, attended as one extend (its KV read once for all of them, not once a
    # row); decode_block_tables / decode_seq_lens are then per sequence. None: a row per sequence.
    decode_cu_seqlens_q: torch.Tensor | None = None
    decode_max_seqlen_q: int = 1
    prefill_block_tables: torch.Tensor | None = None  # [Bp, P] int32
    prefill_cu_seqlens_q: torch.Tensor | None = None  # [Bp + 1] int32
    prefill_seq_lens: torch.Tensor | None = None  # [Bp] int32
    prefill_max_seqlen_q: int = 0
    # Set when only some rows sample and none verifies drafts: each sampling row's own block
    # table and KV length (a decode row's, or the last row of a prompt whose chunk completes it).
    # The last layer then runs attention, o-proj and MLP on those rows alone (LlamaModel._layers).
    sample_block_tables: torch.Tensor | None = None  # [N, P] int32
    sample_seq_lens: torch.Tensor | None = None  # [N] int32


class LlamaModel:
    def __init__(self, mc: ModelConfig, weights: ModelWeights, kv_pool: KVPool, max_model_len: int):
        self.mc = mc
        self.w = weights
        self.kv = kv_pool
        self.scale = mc.head_dim**-0.5
        self.q_size = mc.num_heads * mc.head_dim
        self.kv_size = mc.num_kv_heads * mc.head_dim
        self.cos_sin = rope_cos_sin_cache(
            mc.head_dim, max_model_len, mc.rope_theta, mc.rope_scaling, device=weights.embed.device
        )
        self._stack: tuple | None | bool = False  # decode_layers' per-layer arguments; False: not built yet

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,  # [N] rows whose logits are needed; None: all
    ) -> torch.Tensor:  # [N, V] float32
        mc, w = self.mc, self.w
        eps = mc.rms_norm_eps
        h = F.embedding(input_ids, w.embed)  # [T, H]
        packed = meta.num_decode_tokens == input_ids.shape[0]  # decode-only step (linear.py)
        if packed and input_ids.shape[0] <= NATIVE_MAX_ROWS and (stack := self.decode_stack()) is not None:
            # every layer in one native call: the same kernels, values and order as _layers
            cu = _NO_CU if meta.decode_cu_seqlens_q is None else meta.decode_cu_seqlens_q
            h, residual = native.ops().decode_layers(
                h.float(), *stack, positions, self.cos_sin, meta.slot_mapping, meta.decode_block_tables, cu,
                meta.decode_seq_lens, self.scale, eps, mc.num_heads, mc.num_kv_heads, mc.intermediate_size)
            if logits_indices is not None:
                h, residual = h[logits_indices], residual[logits_indices]
        else:
            h, residual = self._layers(h, positions, meta, packed, logits_indices)
        h, _ = rms_norm(h, w.norm if h.dtype == w.norm.dtype else w.norm.float(), eps, residual)
        return linear(h, w.lm_head, None, packed=True, max_rows=None).float()  # [N, V]

    def projection_seconds(self, rows: int, reps: int = 3) -> float:
        """Best of ``reps`` timings of a decode step's projections (every layer's and the
        lm_head's) at ``rows`` rows, through the kernels a decode step uses: what
        spec_decode.RowCost is measured from."""
        mc, w = self.mc, self.w
        like = dict(dtype=w.embed.dtype, device=w.embed.device)
        xh = torch.zeros(rows, mc.hidden_size, **like)
        xq = torch.zeros(rows, self.q_size, **like)
        xi = torch.zeros(rows, mc.intermediate_size, **like)
        sync = torch.cuda.synchronize if w.embed.is_cuda else (lambda: None)

        def once() -> None:
            for layer in w.layers:
                linear(xh, layer.qkv, None, packed=True)
                linear(xq, layer.o, None, packed=True)
                linear(xh, layer.gate_up, None, packed=True)
                linear(xi, layer.down, None, packed=True)
            linear(xh, w.lm_head, None, packed=True, max_rows=None)

        once()  # first touch
        best = float("inf")
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            once()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    def _layers(
        self, h, positions, meta: AttentionMetadata, packed: bool, rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer; returns the hidden state and residual of ``rows`` only (None: all).

        Nothing reads the last layer's output but the sampling rows' logits, so when the step
        says which rows sample (``meta.sample_block_tables``), the last layer computes K and V
        for every row (the cache needs them) and attention, o-proj and MLP for those rows alone:
        at a 1,024-token prompt, 5/6 of a layer's projections and 1/30 of the attention. A row's
        attention then runs in the decode kernel over its own KV, the same for a prompt whether
        its prefix was cached or not."""
        eps = self.mc.rms_norm_eps
        residual = None
        last = len(self.w.layers) - 1
        narrow = rows is not None and meta.sample_block_tables is not None
        for i, layer in enumerate(self.w.layers):
            if residual is None:
                x, residual = rms_norm(h, layer.input_norm, eps), h
            else:
                x, residual = rms_norm(h, layer.input_norm, eps, residual)
            only = rows if narrow and i == last else None  # the rows this layer's output is for
            h = self._attention(i, layer, x, positions, meta, packed, only)
            if only is not None:
                residual = residual[only]
                if h is None:  # no row samples (unfinished prompt chunks): the last layer's KV was all
                    return residual, residual
            x, residual = rms_norm(h, layer.post_norm, eps, residual)
            gate_up = linear(x, layer.gate_up, layer.gate_up_bias, packed)
            h = linear(silu_and_mul(gate_up), layer.down, layer.down_bias, packed)
        if rows is not None and not narrow:
            h, residual = h[rows], residual[rows]
        return h, residual

    def decode_stack(self) -> tuple | None:
        """The per-layer arguments of the native ``decode_layers`` op (kernels/cpu/decode_stack.cpp),
        or None where it cannot serve this model: weights not in the packed layout (float32, or
        bfloat16 on a CPU with bf16 dot products), KV neither float32 nor bfloat16, kernels forced to
        a backend other than auto, or no native build. Built once.

        The stack keeps activations in float32 whatever the weights: with bfloat16 weights a decode
        step's rows are rounded to bfloat16 only for the projections' dot products, its K and V
        when stored (as a bfloat16 prefill's are), and norms and biases run in float32."""
        if backend_mode() != "auto":
            return None
        if self._stack is False:
            w, kv = self.w, self.kv
            ok = (
                native.available()
                and kv.dtype in (torch.float32, torch.bfloat16) and self.cos_sin.dtype == torch.float32
                and not kv.data.is_cuda
                and all(type(getattr(layer, name)) is CpuWeight for layer in w.layers
                        for name in ("qkv", "o", "gate_up", "down"))
            )
            none = torch.empty(0)
            f32 = lambda t: none if t is None else t.float().contiguous()  # noqa: E731  (a copy only if bf16)
            per = lambda f: [f(layer) for layer in w.layers]  # noqa: E731
            self._stack = (
                per(lambda l: f32(l.input_norm)), per(lambda l: f32(l.post_norm)),
                per(lambda l: l.qkv.packed), per(lambda l: f32(l.qkv_bias)),
                per(lambda l: l.o.packed), per(lambda l: f32(l.o_bias)),
                per(lambda l: l.gate_up.packed), per(lambda l: f32(l.gate_up_bias)),
                per(lambda l: l.down.packed), per(lambda l: f32(l.down_bias)),
                list(kv.k_caches), list(kv.v_caches),
            ) if ok else None
        return self._stack

    def _attention(
        self, i: int, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        packed: bool, rows: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """K and V of every row into the cache; the attention output (o-proj applied) of every
        row, or of ``rows`` alone (``meta.sample_*`` describe them; none: nothing returned)."""
        mc, kv = self.mc, self.kv
        T = x.shape[0]
        qkv = linear(x, layer.qkv, layer.qkv_bias, packed)  # [T, (Hq + 2 Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, mc.num_heads, mc.head_dim)
        k = k.view(T, mc.num_kv_heads, mc.head_dim)
        v = v.view(T, mc.num_kv_heads, mc.head_dim)
        q, k = apply_rotary(q, k, positions, self.cos_sin)
        k_cache, v_cache = kv.k_caches[i], kv.v_caches[i]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv.k_scale, kv.v_scale)
        nd = meta.num_decode_tokens
        if rows is not None:
            if rows.numel() == 0:
                return None
            out = paged_decode_attention(
                q[rows], k_cache, v_cache, meta.sample_block_tables, meta.sample_seq_lens, self.scale,
                kv.k_scale, kv.v_scale,
            )
            return linear(out.view(rows.numel(), self.q_size), layer.o, layer.o_bias, packed)
        if nd == T:
            out = self._decode(q, k_cache, v_cache, meta)
        elif nd == 0:
            out = self._prefill(q, k_cache, v_cache, meta)
        else:
            out = torch.empty_like(q)
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta)
            out[nd:] = self._prefill(q[nd:], k_cache, v_cache, meta)
        return linear(out.view(T, self.q_size), layer.o, layer.o_bias, packed)

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_cu_seqlens_q is not None:  # drafts under verification: an extend per sequence
            return paged_prefill_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_cu_seqlens_q, meta.decode_seq_lens,
                self.scale, self.kv.k_scale, self.kv.v_scale, meta.decode_max_seqlen_q,
            )
        return paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
            self.kv.k_scale, self.kv.v_scale,
        )

    def _prefill(self, q, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return paged_prefill_attention(
            q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q, meta.prefill_seq_lens,
            self.scale, self.kv.k_scale, self.kv.v_scale, meta.prefill_max_seqlen_q,
        )
