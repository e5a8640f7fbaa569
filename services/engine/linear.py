"""Dense projections: ``F.linear``, or oneDNN with prepacked weights on CPU.

On CPU, MKL's sgemm (behind ``F.linear`` for float32) reaches ~11 GB/s on the
decode GEMVs here and is slower still for 2-16 rows, while oneDNN with weights
reordered once into its blocked layout streams them ~2x faster (docs/engine.md).
bfloat16 already runs on oneDNN; prepacking saves its per-call reorder (~1.4x).
The packed tensors are opaque (``layout=torch._mkldnn``), so every projection
goes through :func:`linear`. float32 results differ from ``F.linear`` in the
last bits (another summation order); bfloat16 ones are identical.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.weights import ModelWeights


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(w: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> oneDNN's blocked layout (tuned for a batch of one row)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 1)


def prepack_weights(w: ModelWeights) -> None:
    """Reorder every projection in place (the embedding stays a plain table)."""
    for layer in w.layers:
        layer.qkv, layer.o = prepack(layer.qkv), prepack(layer.o)
        layer.gate_up, layer.down = prepack(layer.gate_up), prepack(layer.down)
    w.lm_head = prepack(w.lm_head)  # a copy when tied: the embedding lookup needs the plain table


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)
