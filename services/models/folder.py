"""Checks on a local Hugging Face model folder, and what `kvbus model info` reports.

Everything here reads only small files (config.json, tokenizer_config.json and
safetensors headers), so validating a folder costs milliseconds and never
imports torch or transformers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# The runtime's own contract (plain json parsing, no torch): one list of what kvbus serves.
from services.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, architecture_of

_SAFETENSORS_ITEMSIZE = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WHAT_TO_DO = "pass --model PATH to a local Hugging Face folder or run `kvbus model prepare`"


class ModelError(Exception):
    """A model folder that kvbus cannot serve, or a default model it cannot prepare.

    The message says what is wrong and what to do about it."""


def is_hub_id(model: str) -> bool:
    """True for strings shaped like a Hugging Face Hub id ("org/name")."""
    return bool(_HUB_ID.match(model)) and not model.startswith((".", "~"))


def read_safetensors_header(path: Path) -> dict:
    """Parse a safetensors header and check it describes exactly the bytes on disk.

    Catches truncated, zero-filled and half-written files without reading the data."""
    try:
        file_size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{path} is too short to be a safetensors file ({file_size} bytes)")
            header_len = int.from_bytes(prefix, "little")
            if not 2 <= header_len <= min(file_size - 8, _MAX_HEADER_BYTES):
                raise ModelError(f"{path} has an unreadable safetensors header (length {header_len})")
            header = json.loads(f.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} has an unreadable safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelError(f"{path} has an unreadable safetensors header (not a JSON object)")
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            expected = math.prod(info["shape"]) * _SAFETENSORS_ITEMSIZE[info["dtype"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{path}: malformed safetensors entry for {name!r}") from exc
        if end - start != expected:
            raise ModelError(f"{path}: tensor {name!r} spans {end - start} bytes, expected {expected}")
        data_end = max(data_end, end)
    if 8 + header_len + data_end != file_size:
        raise ModelError(
            f"{path} is {file_size} bytes but its header describes {8 + header_len + data_end}"
            " (truncated or corrupt)"
        )
    return header


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files a folder's weights live in (one file, or the shards of an index)."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelError(f"{index} is not a valid safetensors index: {exc}") from exc
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelError(f"model folder {model_dir} is missing weight shards {missing}")
        return [model_dir / s for s in shards]
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
    hint = f" (found {', '.join(others)}: re-save it with safe_serialization=True)" if others else ""
    raise ModelError(
        f"model folder {model_dir} has no safetensors weights (model.safetensors or"
        f" model.safetensors.index.json){hint}; {WHAT_TO_DO}"
    )


def read_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelError(f"model folder {model_dir} has no config.json; {WHAT_TO_DO}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{config_path} is not valid JSON ({exc}); {WHAT_TO_DO}") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{config_path} is not a JSON object; {WHAT_TO_DO}")
    return config


def validate_model_dir(model_dir: Path) -> dict:
    """Check a folder is a servable model (config, supported architecture, weights, tokenizer).

    Returns its config.json as a dict; raises ModelError saying what is wrong."""
    if not model_dir.exists():
        raise ModelError(f"model folder {model_dir} does not exist; {WHAT_TO_DO}")
    if not model_dir.is_dir():
        kind = "a GGUF file" if model_dir.suffix == ".gguf" else "a file"
        raise ModelError(
            f"{model_dir} is {kind}, not a model folder; kvbus serves Hugging Face folders"
            f" (config.json + safetensors); {WHAT_TO_DO}"
        )
    config = read_config(model_dir)
    architecture = architecture_of(config)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"model folder {model_dir} has architecture {architecture or 'unknown'}"
            f" (model_type {config.get('model_type')!r}); kvbus supports"
            f" {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:  # what the runtime itself would refuse (e.g. an activation other than silu)
        ModelConfig.from_dict(config)
    except (ValueError, KeyError) as exc:
        raise ModelError(f"model folder {model_dir} cannot be served: {exc}") from None
    for path in weight_files(model_dir):
        read_safetensors_header(path)
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ModelError(
            f"model folder {model_dir} has no tokenizer (tokenizer.json or tokenizer.model);"
            f" copy the tokenizer files of the model into it"
        )
    return config


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What `kvbus model info` prints: read from the folder's files, no weights loaded."""

    path: Path
    architecture: str
    num_params: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool


def model_info(model_dir: Path) -> ModelInfo:
    config = validate_model_dir(model_dir)
    generation_path = model_dir / "generation_config.json"
    generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
    num_params = 0
    for path in weight_files(model_dir):
        header = read_safetensors_header(path)
        num_params += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    tokenizer_config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = {}
    if tokenizer_config_path.is_file():
        tokenizer_config = json.loads(tokenizer_config_path.read_text())
    mc = ModelConfig.from_dict(config, generation)
    return ModelInfo(
        path=model_dir,
        architecture=mc.architecture,
        num_params=num_params,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        vocab_size=mc.vocab_size,
        context_length=config.get("max_position_embeddings", 0),
        tie_word_embeddings=mc.tie_word_embeddings,
        bos_token_id=generation.get("bos_token_id", mc.bos_token_id),
        eos_token_ids=mc.eos_token_ids,
        has_chat_template=(model_dir / "chat_template.jinja").is_file()
        or (model_dir / "chat_template.json").is_file()
        or bool(tokenizer_config.get("chat_template")),
    )
