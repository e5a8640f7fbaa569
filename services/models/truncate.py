"""Write a layer-skip draft model: the first N decoder layers of a local HF Llama-family folder.

The result is an ordinary HF folder (config.json with num_hidden_layers = N, the same
tokenizer files, the same embeddings, final norm and lm_head; model.safetensors), so the
``model`` drafter of speculative decoding loads it like any other: no second model has to
be downloaded, and it shares the target's tokenizer by construction.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def write_truncated_model(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Copy ``src`` into ``dst`` keeping only its first ``num_layers`` layers; returns ``dst``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src} has no safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for name in _COPY:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst


def main(argv: list[str] | None = None) -> None:
    import argparse

    from services.models import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dst")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--model", default=None, help="source folder (default: the default model)")
    args = ap.parse_args(argv)
    print(write_truncated_model(resolve_model(args.model), args.dst, args.layers))


if __name__ == "__main__":
    main()
