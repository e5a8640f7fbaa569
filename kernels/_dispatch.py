"""Backend choice and the small kernel registry.

Each public kernel is registered as (reference, launcher[, cpu]). The dispatcher looks at the
device of the first tensor argument: CUDA -> Triton launcher, CPU -> the native CPU launcher where
one exists and serves the call (``cpu_ok``), else the plain-torch reference.
`KVBUS_KERNELS` overrides: `triton` forces the launcher (with `TRITON_INTERPRET=1` on CPU for
the kernel tests), `torch` forces the reference, `auto` (or unset) is the default. The variable is read once, on the first call (a bad value
raises ValueError then); `set_backend` overrides it in-process (tests), and `set_backend(None)`
makes the next call read the environment again.
NOTE: the engine calls these ~8 times per layer per step: dispatch must stay ~1 us, so no
os.environ lookup per call.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch

ENV_VAR = "KVBUS_KERNELS"
BACKENDS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class Kernel:
    name: str
    reference: Callable
    launcher: Callable | None
    cpu: Callable | None = None


KERNELS: dict[str, Kernel] = {}


_mode: str | None = None  # resolved backend; None = read KVBUS_KERNELS on the next call


def _validated(mode: str) -> str:
    if mode not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={mode!r} is not one of {', '.join(BACKENDS)}")
    return mode


def backend_mode() -> str:
    """auto | triton | torch, from KVBUS_KERNELS unless set_backend overrode it."""
    global _mode
    if _mode is None:
        _mode = _validated(os.environ.get(ENV_VAR, "auto") or "auto")
    return _mode


def set_backend(mode: str | None) -> None:
    """Force a backend in this process; None re-reads KVBUS_KERNELS on the next call."""
    global _mode
    _mode = None if mode is None else _validated(mode)


def use_triton(t: torch.Tensor) -> bool:
    mode = _mode or backend_mode()
    return mode == "triton" or (mode == "auto" and t.is_cuda)


def register(
    name: str, reference: Callable, launcher: Callable | None,
    cpu: Callable | None = None, cpu_ok: Callable[..., bool] | None = None,
) -> Callable:
    """Register a kernel and return its dispatching entry point (signature of the reference).

    ``cpu`` is a native CPU launcher used in ``auto`` mode for CPU tensors when
    ``cpu_ok(*args, **kwargs)`` says it serves the call (dtype, layout, extension built)."""
    KERNELS[name] = Kernel(name, reference, launcher, cpu)

    @functools.wraps(reference)
    def dispatch(*args, **kwargs):
        mode = _mode or backend_mode()
        if mode == "auto":
            if args[0].is_cuda:
                if launcher is not None:
                    return launcher(*args, **kwargs)
            elif cpu is not None and cpu_ok(*args, **kwargs):
                return cpu(*args, **kwargs)
        elif mode == "triton" and launcher is not None:
            return launcher(*args, **kwargs)
        return reference(*args, **kwargs)

    dispatch.__name__ = dispatch.__qualname__ = name
    return dispatch
