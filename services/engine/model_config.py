"""What the runtime needs to know about a model, read from its config.json.

Only ``config.json`` and ``generation_config.json`` are read (no transformers
import): the fields below are the whole contract between a checkpoint and
:mod:`services.engine.llama`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Folders written without `architectures` (some converters omit it) are judged by model_type.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def architecture_of(config: dict[str, Any]) -> str | None:
    """The config's architecture, from ``architectures`` or else ``model_type``."""
    architectures = config.get("architectures") or []
    return architectures[0] if architectures else _BY_MODEL_TYPE.get(config.get("model_type", ""))


class UnsupportedModelError(ValueError):
    """The checkpoint is not one of the architectures the runtime implements."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str | None

    @property
    def max_model_len(self) -> int:
        """Longest sequence this runtime computes exactly.

        The paged kernels have no sliding-window mask, so a model with a
        window is served up to the window, where full attention is identical.
        """
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        generation = {}
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            generation = json.loads(gen_path.read_text())
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(cls, c: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        arch = architecture_of(c)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch or c.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if c.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {c['hidden_act']!r} (only silu)")
        num_heads = c["num_attention_heads"]
        rope = c.get("rope_parameters") or {}
        # transformers < 5 keeps rope_theta and rope_scaling at the top level.
        rope_theta = float(rope.get("rope_theta", c.get("rope_theta", 10000.0)))
        scaling = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding_window = c.get("sliding_window")
        if is_qwen2 and not c.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // num_heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(c.get("attention_bias", False)),
            o_bias=not is_qwen2 and bool(c.get("attention_bias", False)),
            mlp_bias=bool(c.get("mlp_bias", False)),
            sliding_window=sliding_window,
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=_eos_ids(c, generation or {}),
            dtype=c.get("dtype") or c.get("torch_dtype"),
        )


def _eos_ids(config: dict, generation: dict) -> tuple[int, ...]:
    """The union of config and generation-config EOS ids (Llama 3 lists several)."""
    ids: list[int] = []
    for value in (generation.get("eos_token_id"), config.get("eos_token_id")):
        for i in value if isinstance(value, list) else [value]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)
