"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
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


@pytest.fixture
def anyio_backend():
    """Async tests (``pytest.mark.anyio``) run on asyncio, like the services."""
    return "asyncio"
