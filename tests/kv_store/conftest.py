"""The kv_store tests' gpu marker. (Their tiny model is tests/conftest.py's ``tiny_model``.)"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """gpu-marked tests need CUDA (as in tests/kernels)."""
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
