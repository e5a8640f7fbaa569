"""No service or bus code awaits through ``asyncio.wait_for``.

On Python 3.11 (what kvbus runs on) ``wait_for`` returns the awaited result when a cancel lands in the
tick the result does, and the cancel is lost: a gateway told to stop as a worker's chunk came in kept
streaming, and the worker generated to the context limit for a caller long gone (CI, 2026-12-07).
``async with asyncio.timeout(...)`` keeps the cancel. The bus tests check the behaviour itself
(tests/integration/test_bus_wire.py, ``..._lands_with_...``); this one keeps the call from coming back.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bus", "services", "kernels", "schemas")


def wait_for_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "wait_for"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "asyncio"]


def test_no_asyncio_wait_for_in_the_services():
    found = {str(p.relative_to(ROOT)): lines for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             if (lines := wait_for_calls(p))}
    assert not found, f"asyncio.wait_for loses cancels on Python 3.11; use asyncio.timeout: {found}"


def test_the_check_finds_a_call(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import asyncio\nasync def f(x):\n    return await asyncio.wait_for(x, 1)\n")
    assert wait_for_calls(sample) == [3]
