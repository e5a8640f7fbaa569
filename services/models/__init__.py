"""Model provisioning: the default model's one-time conversion, and `--model` folders.

    resolve_model(None)      -> the converted SmolLM2-135M-Instruct (prepared on first use)
    resolve_model("PATH")    -> a validated local Hugging Face folder
    model_main(argv)         -> `kvbus model prepare|info`

Importing this package does not import torch or transformers; only a
conversion does.
"""

from services.models.cache import (
    DEFAULT_MODEL_NAME,
    cache_root,
    default_model_dir,
    ensure_model,
    prepare_default_model,
    resolve_model,
)
from services.models.cli import model_main
from services.models.folder import SUPPORTED_ARCHITECTURES, ModelError, ModelInfo, model_info

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SUPPORTED_ARCHITECTURES",
    "ModelError",
    "ModelInfo",
    "cache_root",
    "default_model_dir",
    "ensure_model",
    "model_info",
    "model_main",
    "prepare_default_model",
    "resolve_model",
]
