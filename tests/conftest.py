"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest

# Nothing is ever loaded from a hub, tests included.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """A servable model folder: KVBUS_TEST_MODEL if set, else the default
    SmolLM2-135M-Instruct from the kvbus cache (converted on first use, ~25 s)."""
    from services.models import ensure_model, resolve_model

    override = os.environ.get("KVBUS_TEST_MODEL")
    if override:
        return resolve_model(override)
    return ensure_model()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, model_dir) -> Path:
    """A tiny random Llama (tests/tiny_model.py) with the default model's tokenizer: for tests
    that count pages or steps, not judge text (fast on 2 cores)."""
    from tests.tiny_model import save_tiny_model

    path, _ = save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=model_dir)
    return path


@pytest.fixture
def anyio_backend():
    """Async tests (``pytest.mark.anyio``) run on asyncio, like the services."""
    return "asyncio"


@pytest.fixture(autouse=True)
def _seeded_random(request):
    """Every test starts from a fixed random state, derived from its id: a draw a test forgot to
    seed is the same draw on every run, so it cannot flake (and reordering tests changes nothing).

    Tests still seed their own draws explicitly (a torch.Generator, random.Random(n)); this is
    the backstop for torch's, numpy's and Python's global generators.
    """
    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed)
    import sys

    if "torch" in sys.modules:  # a test that never imports torch does not pay for it
        sys.modules["torch"].manual_seed(seed)
    yield
