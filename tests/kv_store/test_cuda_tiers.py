"""HiCache's CUDA data path: copies on the client's copy stream, ordered by events.

gpu-marked (skipped without CUDA; bench/gpu_check.sh runs them on a GPU machine). The
tiny random Llama here needs no downloaded model; the ``default`` case of the engine
test uses the real SmolLM2 (services.models), token for token against an engine
without prefix caching on the same device.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from schemas.engine import SamplingParams
from services.engine.kv_pool import KVPool, kv_bytes_per_page
from services.engine.model_config import ModelConfig
from services.kv_store.client import HostTierClient
from services.kv_store.config import KVStoreConfig
from services.kv_store.links import LocalLink
from services.kv_store.store import StoreCore

pytestmark = pytest.mark.gpu

PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_cuda_model(tmp_path_factory):
    """The tiny random Llama of tests/tiny_model.py, without the default model's tokenizer
    (the engines here run on token ids: load_tokenizer=False; the folder check wants a file)."""
    from tests.tiny_model import save_tiny_model

    path, _ = save_tiny_model(tmp_path_factory.mktemp("tiny-llama-cuda"))
    (path / "tokenizer.json").write_text("{}")
    return path


@pytest.fixture()
def core():
    core = StoreCore(KVStoreConfig(hicache_size=0.2, memory_reserve=0.0))
    yield core
    core.close()


def cuda_pool(model_dir, num_pages=8) -> KVPool:
    mc = ModelConfig.from_dir(model_dir)
    pool = KVPool(mc, num_pages, PAGE, torch.float32, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen, device="cuda"))
    return pool


def tokens_of(i: int) -> tuple[int, ...]:
    return tuple(range(i * PAGE, (i + 1) * PAGE))


def write(client: HostTierClient, pages: list[int]) -> None:
    for p in pages:
        assert client.write_back(1000 + p, 0, tokens_of(p), p)
    done: list = []
    while len(done) < len(pages):
        got = client.wait_written(30.0)
        assert got, "write-back did not land"
        done += got
    assert sorted(done) == sorted((p, True) for p in pages)


def test_write_back_and_load_back_round_trip_on_the_copy_stream(tiny_cuda_model, core):
    pool = cuda_pool(tiny_cuda_model)
    client = HostTierClient(LocalLink(core), owner="g")
    client.bind(pool)
    assert client.stream is not None and client.stream != torch.cuda.current_stream()
    write(client, [0, 1, 2])
    for p in (0, 1, 2):  # the slot holds the page's bytes
        slot = client.mirror[1000 + p]
        want = pool.data[p].cpu().view(torch.uint8).reshape(-1).numpy()
        assert np.array_equal(core.arena.slot_data(slot), want)
    # Asynchronous load into pages 4..6; the engine's stream waits on the copy's event.
    assert client.lookup([1000, 1001, 1002]) == 3
    ticket = client.start_load([1000, 1001, 1002], [tokens_of(p) for p in (0, 1, 2)], [4, 5, 6])
    got = client.wait_loaded(30.0)
    assert got == [(ticket, 3)]
    for src, dst in ((0, 4), (1, 5), (2, 6)):
        assert torch.equal(pool.data[dst], pool.data[src])  # runs after the wait_event on this stream
    # A slot refilled under the reader fails verification: it and the rest are not served.
    pool.data[7].zero_()
    core.arena.invalidate(client.mirror[1001])
    ticket = client.start_load([1000, 1001], [tokens_of(0), tokens_of(1)], [3, 7])
    assert client.wait_loaded(30.0) == [(ticket, 1)]
    assert torch.equal(pool.data[3], pool.data[0]) and int(pool.data[7].count_nonzero()) == 0
    assert client.stats["verify_failed"] == 1
    # The synchronous path (short runs) agrees.
    pool.data[3].zero_()
    assert client.load_back([1002], [tokens_of(2)], [3]) == 1
    assert torch.equal(pool.data[3], pool.data[2])
    client.close()


def test_write_back_copies_what_the_engine_stream_wrote_last(tiny_cuda_model, core):
    """The copy stream starts after the engine's stream: a page written by a long kernel
    chain just before write_back is copied with its final contents, not stale ones."""
    pool = cuda_pool(tiny_cuda_model)
    client = HostTierClient(LocalLink(core), owner="g")
    client.bind(pool)
    n = pool.data[0].numel()
    x = torch.randn(2048, 2048, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    for _ in range(30):  # keeps the engine's stream busy for a while
        x = torch.tanh(x @ x / 2048)
    pool.data[0].view(-1).copy_(x.view(-1)[:n])
    write(client, [0])
    final = pool.data[0].cpu().view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(core.arena.slot_data(client.mirror[1000]), final)
    client.close()


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_engine_on_cuda_is_identical_with_l2_hits_sync_and_async(which, request, core):
    from services.engine import EngineConfig, LLMEngine

    model = request.getfixturevalue("tiny_cuda_model" if which == "tiny" else "model_dir")
    mc = ModelConfig.from_dir(model)
    page_gb = kv_bytes_per_page(mc, PAGE, torch.float32) / 1024**3

    def engine(hooks=None, **kw):
        cfg = EngineConfig(model=str(model), device="cuda", dtype="float32", kv_cache_memory=page_gb * 10 * 1.001,
                           page_size=PAGE, load_tokenizer=False, max_running_requests=2, **kw)
        return LLMEngine(cfg, tier_hooks=hooks)

    ps = prompts(4, 60, min(mc.vocab_size, 20000))
    ref_engine = engine(enable_prefix_caching=False)
    ref = [c.token_ids for c in ref_engine.generate_sync(ps, GREEDY)]
    del ref_engine
    client = HostTierClient(LocalLink(core), owner="g")
    e = engine(client)
    bm = e.block_manager
    assert client.stream is not None
    for p, r in zip(ps, ref):  # cold; 4 x 4 pages through 10: L1 evicts, write-back on the copy stream
        assert e.generate_sync([p], GREEDY)[0].token_ids == r
    assert bm.num_evictions > 0 and client.stats["written_back"] > 0
    out = e.generate_sync([ps[0]], GREEDY)[0]  # nothing else runs: a synchronous load
    assert out.token_ids == ref[0] and out.usage.cached_tokens_host >= PAGE
    # Asynchronous: ps[2] loads on the copy stream while ps[1] steps.
    bm.async_load_min_pages = 1
    bm.evict_all_cached()
    bm.wait_for_copies()
    e.add_request("a", ps[1], GREEDY)
    got: dict[str, list[int]] = {"a": [], "b": []}
    for o in e.step():
        got[o.request_id] += o.new_token_ids
    e.add_request("b", ps[2], GREEDY)
    while e.has_unfinished():
        for o in e.step():
            got[o.request_id] += o.new_token_ids
    assert got == {"a": ref[1], "b": ref[2]}
    assert bm.num_async_loads > 0
    bm.wait_for_copies()
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages
    core.index.check()
    client.close()
