import os
import pathlib
import subprocess
import sys

import pytest

from services.engine.page_hash import hash_page, page_hashes, root_hash

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_chain_matches_definition():
    tokens = list(range(40))
    hashes = page_hashes(tokens, 16, salt="m")
    assert len(hashes) == 2  # the partial third page is not hashed
    h0 = hash_page(root_hash("m"), tokens[:16])
    assert hashes == [h0, hash_page(h0, tokens[16:32])]


def test_prefix_property_and_dependence_on_history():
    a = page_hashes(list(range(64)), 16)
    b = page_hashes(list(range(48)) + [7] * 16, 16)
    assert a[:3] == b[:3] and a[3] != b[3]
    # Same page content after a different first page hashes differently.
    c = page_hashes([9] + list(range(1, 64)), 16)
    assert all(x != y for x, y in zip(a, c))


def test_salt_separates_namespaces():
    tokens = list(range(32))
    assert page_hashes(tokens, 16, salt="model-a") != page_hashes(tokens, 16, salt="model-b")
    assert page_hashes(tokens, 16, salt="") == page_hashes(tokens, 16, salt=b"")


def test_resume_from_parent():
    tokens = list(range(100))
    full = page_hashes(tokens, 8)
    assert page_hashes(tokens, 8, parent=full[4], start_page=5) == full[5:]
    with pytest.raises(ValueError):
        page_hashes(tokens, 8, start_page=2)
    with pytest.raises(ValueError):
        page_hashes(tokens, 0)


def test_values_are_64_bit_and_large_ids_ok():
    hashes = page_hashes([0, 2**32 - 1] * 8, 16)
    assert 0 <= hashes[0] < 2**64


def test_golden_values():
    # Changing these breaks every stored page name (router index, kv_store, events).
    assert page_hashes(list(range(32)), 16, salt="kvbus") == [17979228404854375692, 12859076288531915391]


def test_stable_across_processes_and_light_import():
    code = (
        "import sys; from services.engine.page_hash import page_hashes; "
        "print(page_hashes(list(range(32)), 16, salt='kvbus'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONHASHSEED": "123", "PATH": os.environ.get("PATH", "")},
    ).stdout
    # Same value in a fresh process with another hash seed, and no torch import
    # (the router and kv_store import this module).
    assert out.split()[-1] == "False"
    assert out.strip().rsplit(" ", 1)[0] == str(page_hashes(list(range(32)), 16, salt="kvbus"))
