"""Dense projections on CPU: kvbus's packed GEMM for decode batches, oneDNN for prefill ones.

A decode step multiplies every weight by a handful of rows, so its time is the weights' bytes
over memory bandwidth. Measured on the 2-core dev VM (docs/engine.md), all 121 projections of
SmolLM2-135M fp32 (540 MB): MKL's sgemm (``F.linear``) streams them at 6-12 GB/s, oneDNN with
weights reordered into its blocked layout at 12-17 GB/s, and the native packed kernel
(``kernels/cpu/packed_gemm.cpp``: 16 output columns per vector, no horizontal sums, one pass in
order) at 18-29 GB/s for 1-8 rows against ~30 GB/s the machine reads, and faster than oneDNN up
to 48 rows. Prefill batches are
compute-bound, where oneDNN's blocked GEMM is faster (185 GFLOP/s against MKL's 156), so every
float32 projection is held twice (:class:`CpuWeight`): packed for decode-only steps of up to
``NATIVE_MAX_ROWS`` rows (``packed=True``), oneDNN for everything else.
NOTE: the choice is by phase, never by row count alone: a prompt's tokens always go through the
same kernel whether its prefix was cached or not (a short uncached tail would otherwise round
differently from the same tokens in a cold prefill), and the packed kernel sums every output in
one fixed order, so a decode row's result does not depend on how many rows share the step. That doubles the weights' RAM (540 MB more for the default model);
``prepack_weights=False`` keeps one plain copy and ``F.linear`` instead.
bfloat16 projections are held twice the same way when the CPU has bf16 dot products
(``avx512_bf16``; :func:`packed_decode`): the packed kernel takes pairs of k per 64-byte line for
``vdpbf16ps``, at about half the fp32 kernel's time (half the bytes); elsewhere bfloat16 runs on
oneDNN alone (prepacked: AMX tiles or avx512_bf16 where present, :func:`prefill_kernel`), or on
``F.linear`` where torch's oneDNN takes no bfloat16 weights (CPUs without avx512bw/vl/dq or
avx_ne_convert, e.g. AMD Zen 3: there bfloat16 is not native and ``--dtype auto`` runs float32).
float32 results differ from ``F.linear`` in the last bits (another summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native
from services.engine.huge_pages import onto_huge_pages
from services.engine.weights import ModelWeights

NATIVE_MAX_ROWS = 48
"""Most rows the packed kernel serves in a decode step. Past 12 rows it runs groups of <= 12 rows
over each tile of weights while the tile sits in L2; all 121 projections of the default model on
the 2-core dev VM, packed against oneDNN (prepacked, as prefill uses it): 13 rows 29.3 / 33.7 ms,
16 rows 29.0 / 34.1, 24 rows 40.2 / 45.3, 32 rows 53.9 / 56.6, 48 rows 71.9 / 80.4."""


class CpuWeight:
    """One float32 or bfloat16 projection ``[out, in]`` in two layouts: oneDNN's (prefill) and
    packed (decode)."""

    __slots__ = ("dense", "packed", "out_features", "in_features")

    def __init__(self, w: torch.Tensor):
        self.out_features, self.in_features = w.shape
        self.packed = pack_columns(w)
        self.dense = prepack(w, PREFILL_ROWS)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)


def pack_columns(w: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] -> [ceil(N / 16), K, 16]: block c holds rows 16c..16c+15 transposed (zero
    past N). bfloat16 -> [ceil(N / 16), ceil(K / 2), 32]: 64-byte line l of block c holds
    ``w[16c + i, 2l + p]`` at ``2i + p``, the pairs one ``vdpbf16ps`` takes (zero past N and K)."""
    n, k = w.shape
    blocks = -(-n // 16)
    per_line = 2 if w.dtype == torch.bfloat16 else 1
    lines = -(-k // per_line)
    padded = torch.zeros(blocks * 16, lines * per_line, dtype=w.dtype)
    padded[:n, :k] = w
    packed = padded.view(blocks, 16, lines, per_line).permute(0, 2, 1, 3).contiguous()
    return packed.view(blocks, lines, 16 * per_line)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` projections on ``device`` are held in oneDNN's layout (prefill_kernel)."""
    if device.type != "cpu":
        return False
    from kernels.cpu_path import this_cpu

    return prefill_kernel(dtype, dtype == torch.bfloat16 and this_cpu().onednn_bf16) == "onednn"


def prefill_kernel(dtype: torch.dtype, onednn_bf16: bool) -> str:
    """What multiplies ``dtype`` prefill and extend rows on a CPU: ``onednn`` (weights prepacked into
    oneDNN's blocked layout, run by ``torch.ops.mkldnn._linear_pointwise``: with bfloat16 on a CPU
    with AMX that is oneDNN's AMX kernel, ``brg_matmul:avx512_core_amx``, and with avx512_bf16 its
    ``avx512_core_bf16`` one) or ``f_linear`` (torch's own GEMM). ``onednn_bf16``: this torch's oneDNN
    takes bfloat16 weights on this CPU (it needs avx512bw + vl + dq or avx_ne_convert; without, its
    reorder raises, so bfloat16 stays on F.linear). QKV and gate/up are one fused weight each
    (weights.py), so a layer runs four projections."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "f_linear"
    if dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16):
        return "onednn"
    return "f_linear"


PREFILL_ROWS = 512
"""oneDNN's layout hint for the copy that serves prefill: ~200 GFLOP/s at 512-1024 rows, against
~165-178 with the hint of one row that suits a copy serving decode too."""


def prepack(w: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout, tuned for batches of ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


def prepack_weights(w: ModelWeights) -> None:
    """Reorder every projection in place (the embedding stays a plain table); float32 ones get
    the packed decode layout too when the native kernels are built, bfloat16 ones when the CPU
    has bf16 dot products (``avx512_bf16``) as well."""
    both = packed_decode(w.embed.dtype)
    convert = CpuWeight if both else prepack
    for layer in w.layers:
        layer.qkv, layer.o = convert(layer.qkv), convert(layer.o)
        layer.gate_up, layer.down = convert(layer.gate_up), convert(layer.down)
    w.lm_head = convert(w.lm_head)  # a copy when tied: the embedding lookup needs the plain table
    if both:  # the packed layouts in one mapping on huge pages, in the order a decode step reads them
        packed = [*(p for layer in w.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)), w.lm_head]
        for cw, t in zip(packed, onto_huge_pages([cw.packed for cw in packed])):
            cw.packed = t


def packed_decode(dtype: torch.dtype) -> bool:
    """Whether decode steps of ``dtype`` weights run on the native packed GEMM."""
    if not native.available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native.ops().has_bf16_dot())


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None, packed: bool = False,
           max_rows: int | None = NATIVE_MAX_ROWS) -> torch.Tensor:
    """``x @ w.T + b``; ``packed``: this is a decode-only step, so the packed kernel may serve
    up to ``max_rows`` rows (``None``: any number, as for the lm_head, whose rows are only the
    sampling ones: there it always runs, so a row's logits never depend on the step's shape)."""
    if type(w) is CpuWeight:
        if packed and (max_rows is None or x.shape[0] <= max_rows) and x.dtype in (w.packed.dtype, torch.float32):
            y = torch.empty((x.shape[0], w.out_features), dtype=x.dtype)
            if b is not None and b.dtype != x.dtype:  # float32 rows on bfloat16 weights (linear's caller chose)
                b = b.to(x.dtype)
            native.ops().packed_gemm(x if x.stride(-1) == 1 else x.contiguous(), w.packed, b, y)
            return y
        w = w.dense
    if w.is_mkldnn:
        # oneDNN multiplies a lone row with another kernel than 2+ rows, one that sums in another
        # order for some shapes (the default model's down projection, K = 1,536): a prompt whose
        # last token was the only one computed (the rest cached) got other logits, in the last
        # bits, than a cold run. Every other row count sums alike, so a lone row runs as two.
        if x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), w, b, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)

