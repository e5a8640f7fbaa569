"""HiCache through the real engine: greedy output identical with L1 hits, L2 hits and across engines.

The engines run the tiny random model (tests/tiny_model.py: these tests count pages and compare
with a cold run, they do not judge text) with a tiny KV pool (10 pages of 16 tokens) so L1 evicts;
the kv_store core runs in process (LocalLink), the data path is the real shared-memory arena.
"""

from __future__ import annotations

import gc
import random
import threading

import pytest

from schemas.engine import SamplingParams
from services.engine import EngineConfig, LLMEngine, build_engine
from services.engine.kv_pool import kv_bytes_per_page
from services.kv_store.client import HostTierClient
from services.kv_store.config import KVStoreConfig
from services.kv_store.links import LocalLink
from services.kv_store.store import StoreCore

PAGE = 16
NUM_PAGES = 10
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts(n: int, length: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def page_gb(tiny_model):
    from services.engine.model_config import ModelConfig
    import torch

    return kv_bytes_per_page(ModelConfig.from_dir(tiny_model), PAGE, torch.float32) / 1024**3


def make_engine(tiny_model, page_gb, hooks=None, **kw) -> LLMEngine:
    kw.setdefault("max_running_requests", 2)
    kw.setdefault("dtype", "float32")  # the pool is sized in float32 pages (dtype auto: bfloat16 on some CPUs)
    cfg = EngineConfig(model=str(tiny_model), kv_cache_memory=page_gb * NUM_PAGES * 1.001, page_size=PAGE,
                       load_tokenizer=False, **kw)
    return build_engine(cfg, tier_hooks=hooks)


def run(engine: LLMEngine, prompt: list[int], rid: str = ""):
    return engine.generate_sync([prompt], GREEDY)[0]


@pytest.fixture(scope="module")
def reference(tiny_model, page_gb):
    engine = make_engine(tiny_model, page_gb, enable_prefix_caching=False)
    ps = prompts(4)
    return ps, [run(engine, p, f"ref{i}").token_ids for i, p in enumerate(ps)]


@pytest.fixture()
def core():
    core = StoreCore(KVStoreConfig(hicache_size=0.1, memory_reserve=0.0))
    yield core
    core.close()


def test_l2_hits_after_l1_eviction_are_identical(tiny_model, page_gb, reference, core):
    ps, ref = reference
    client = HostTierClient(LocalLink(core), owner="e1")
    engine = make_engine(tiny_model, page_gb, client)
    first = [run(engine, p, f"a{i}") for i, p in enumerate(ps)]
    assert [c.token_ids for c in first] == ref  # cold
    assert engine.block_manager.num_evictions > 0  # 4 prompts x 4 pages do not fit 10 pages
    assert core.index.num_stored > 0
    again = run(engine, ps[0], "b0")  # its pages left L1 long ago
    assert again.token_ids == ref[0]
    assert client.stats["loaded_back"] >= 3
    assert again.usage.cached_prompt_tokens >= 3 * PAGE
    assert again.usage.cached_tokens_host == client.stats["loaded_back"] * PAGE  # loaded by this request only
    assert again.usage.cached_tokens_device + again.usage.cached_tokens_host == again.usage.cached_prompt_tokens
    hot = run(engine, ps[0], "c0")  # now an L1 hit
    assert hot.token_ids == ref[0]
    # 3 pages, then the rows of the last page (the earlier run's) but the last token's
    assert hot.usage.cached_tokens_device == len(ps[0]) - 1 and hot.usage.cached_tokens_host == 0
    core.index.check()


def test_pages_written_by_one_engine_are_loaded_by_another(tiny_model, page_gb, reference, core):
    ps, ref = reference
    c1 = HostTierClient(LocalLink(core), owner="e1", write_policy="write_through")
    e1 = make_engine(tiny_model, page_gb, c1)
    assert run(e1, ps[1], "x").token_ids == ref[1]
    e1.block_manager.wait_for_copies()
    c2 = HostTierClient(LocalLink(core), owner="e2")
    e2 = make_engine(tiny_model, page_gb, c2)
    out = run(e2, ps[1], "y")
    assert out.token_ids == ref[1]
    assert c2.stats["loaded_back"] == (len(ps[1]) - 1) // PAGE
    core.index.check()


def test_a_page_changed_in_l2_is_recomputed_not_served(tiny_model, page_gb, reference, core):
    ps, ref = reference
    c1 = HostTierClient(LocalLink(core), owner="e1", write_policy="write_through")
    e1 = make_engine(tiny_model, page_gb, c1)
    run(e1, ps[2], "x")
    e1.block_manager.wait_for_copies()
    # Every L2 slot of that prompt now holds something else (as if evicted and refilled).
    for page in core.index.stored.values():
        core.arena.invalidate(page.slot)
    e1.block_manager.evict_all_cached()
    out = run(e1, ps[2], "y")
    assert out.token_ids == ref[2]
    assert c1.stats["loaded_back"] == 0


@pytest.mark.parametrize("async_min_pages", [4, 1], ids=["sync-loads", "async-loads"])
def test_no_page_leaks_after_many_requests_with_random_cancels(tiny_model, core, async_min_pages):
    """200 requests (CI size; the issue asks for 1,000 on a quiet machine: set KVBUS_LEAK_REQUESTS),
    shared prefixes, seeded random aborts (also while pages load asynchronously); then every
    tier's counts add up."""
    import os

    rng = random.Random(1234)
    n = int(os.environ.get("KVBUS_LEAK_REQUESTS", "200"))
    bases = [[rng.randrange(3, 320) for _ in range(40)] for _ in range(5)]
    client = HostTierClient(LocalLink(core), owner="e1")
    from services.engine.model_config import ModelConfig
    import torch

    page_gb = kv_bytes_per_page(ModelConfig.from_dir(tiny_model), PAGE, torch.float32) / 1024**3
    engine = make_engine(tiny_model, page_gb, client, max_running_requests=4)
    engine.block_manager.async_load_min_pages = async_min_pages
    live: list[str] = []
    for i in range(n):
        base = bases[rng.randrange(len(bases))]
        prompt = base[: rng.randrange(17, len(base) + 1)] + [rng.randrange(3, 320) for _ in range(rng.randrange(1, 8))]
        rid = f"r{i}"
        engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randrange(1, 4), temperature=0.0))
        live.append(rid)
        if rng.random() < 0.3:
            engine.abort(live.pop(rng.randrange(len(live))))
        for _ in range(rng.randrange(0, 3)):
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
    while engine.has_unfinished():
        engine.step()
    bm = engine.block_manager
    bm.wait_for_copies()
    bm.wait_for_loads()
    engine.step()
    assert engine.num_running == engine.num_waiting == 0
    assert bm.num_free_pages == bm.num_pages and bm.num_copying == 0
    assert len(bm.free_page_ids) + bm.num_cached_pages == bm.num_pages
    assert client.stats["written_back"] > 0 and client.stats["loaded_back"] > 0
    assert (bm.num_async_loads > 0) == (async_min_pages == 1)
    assert (bm.num_loads_cancelled > 0) == (async_min_pages == 1)  # aborts while loading happened
    core.index.check()
    assert core.index.num_leased == client.num_leased  # every slot leased is either held or committed


def test_l3_hits_survive_a_store_restart_and_corruption_is_recomputed(tiny_model, page_gb, reference, tmp_path):
    ps, ref = reference
    cfg = KVStoreConfig(hicache_size=page_gb * 4, memory_reserve=0.0, hicache_storage_dir=str(tmp_path),
                        hicache_l3_admit_hits=0)
    core = StoreCore(cfg)
    # write_through: pages reach L2 as computed (write_back would leave the last ones in L1 only,
    # and L1 and L2 are memory: a restart loses them, by design).
    engine = make_engine(tiny_model, page_gb, HostTierClient(LocalLink(core), owner="e1", write_policy="write_through"))
    for i in range(4):  # 16 pages through 4 L2 slots: the oldest spill to L3
        assert run(engine, ps[i]).token_ids == ref[i]
    assert core.counters["spilled_disk"] > 0
    core.close()
    restarted = StoreCore(cfg)  # re-indexes the directory on attach
    client = HostTierClient(LocalLink(restarted), owner="e2")
    fresh = make_engine(tiny_model, page_gb, client)
    on_disk = set(restarted.disk.pages)
    from services.engine.page_hash import page_hashes

    hashes = page_hashes(ps[0], PAGE)
    assert hashes[0] in on_disk
    out = run(fresh, ps[0])
    assert out.token_ids == ref[0] and client.stats["loaded_back"] >= 1 and restarted.counters["hits_disk"] >= 1
    # A corrupted page file is dropped and recomputed, never served. The victim: the first page of a
    # later prompt that reached L3. Which ones did depends on the copy thread's timing: a client's leases
    # are capped at a share of L2's 4 slots, and a page computed while its copies in flight hold them all
    # is not written through, so it never spills (the last CI found ps[1]'s first page absent).
    victims = [(i, page_hashes(ps[i], PAGE)[0]) for i in range(1, len(ps))]
    i, victim = next((i, h) for i, h in victims if h in restarted.disk)
    path = restarted.disk.dir / f"{victim:016x}.kvp"
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    path.write_bytes(bytes(blob))
    loaded = client.stats["loaded_back"]
    assert run(fresh, ps[i]).token_ids == ref[i]
    assert restarted.disk.num_corrupted == 1 and client.stats["loaded_back"] == loaded
    restarted.close()


@pytest.mark.parametrize("policy,after_first,after_hits", [
    ("write_back", 0, 0),  # nothing evicted yet: nothing copied
    ("write_through", 5, 5),  # every page as computed (the 4th fills while decoding), then the tail
    ("write_through_selective", 0, 4),  # after 2 L1 hits: 3 prompt pages, and the 4th whose rows repeats copy
])
def test_write_policies_are_observable(tiny_model, core, policy, after_first, after_hits):
    from services.engine.model_config import ModelConfig
    import torch

    page_gb = kv_bytes_per_page(ModelConfig.from_dir(tiny_model), PAGE, torch.float32) / 1024**3
    client = HostTierClient(LocalLink(core), owner=policy, write_policy=policy, selective_hits=2)
    engine = make_engine(tiny_model, page_gb * 4, client)  # 40 pages: no eviction here
    engine.block_manager.write_back_window = 0  # only the policy's own moments copy
    prompt = [random.Random(5).randrange(3, 320) for _ in range(60)]  # 3 cacheable pages
    run(engine, prompt)
    engine.step()
    engine.block_manager.wait_for_copies()
    assert client.stats["written_back"] == after_first
    for _ in range(2):
        run(engine, prompt)
    engine.block_manager.wait_for_copies()
    assert client.stats["written_back"] == after_hits
    assert engine.block_manager.num_evictions == 0


# ---- asynchronous load-back through the real engine and client --------------------------------


class LoadGate:
    """Holds the client's load jobs on the copy thread until ``release`` (no sleeps)."""

    def __init__(self, client: HostTierClient):
        self.opened, self.entered = threading.Event(), threading.Event()
        run = client._load_job

        def gated(*args):
            self.entered.set()
            assert self.opened.wait(120), "the test never released the gate"
            run(*args)

        client._load_job = gated

    def release(self) -> None:
        self.opened.set()


def warm_l2(tiny_model, page_gb, core, ps, ref):
    """An engine whose L2 holds ps[0]'s and ps[1]'s pages (evicted from L1 by the others)."""
    client = HostTierClient(LocalLink(core), owner="e1")
    engine = make_engine(tiny_model, page_gb, client)
    engine.block_manager.write_back_window = 0  # copies at eviction only: the gated copy thread holds no write
    engine.block_manager.async_load_min_pages = 2
    assert [run(engine, p).token_ids for p in ps] == ref
    return client, engine


def collect(engine, outs, steps=1):
    for _ in range(steps):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)


def start_gated_load(tiny_model, page_gb, core, ps, ref):
    """Request "other" (ps[1]) steps; request "loader" (ps[0]) is admitted and its L2 load is held
    on the copy thread by the returned gate."""
    client, engine = warm_l2(tiny_model, page_gb, core, ps, ref)
    gate = LoadGate(client)
    outs: dict = {}
    engine.add_request("other", ps[1], GREEDY)
    collect(engine, outs)
    engine.add_request("loader", ps[0], GREEDY)
    collect(engine, outs)
    assert gate.entered.wait(60)
    return client, engine, gate, outs


def test_async_load_back_lets_another_request_step_and_is_identical(tiny_model, page_gb, reference, core):
    ps, ref = reference
    client, engine = warm_l2(tiny_model, page_gb, core, ps, ref)
    gate = LoadGate(client)
    outs: dict = {}
    engine.add_request("other", ps[1], GREEDY)  # nothing else runs: its own L2 hits load synchronously
    collect(engine, outs)
    assert len(outs["other"]) == 1 and engine.scheduler.loading == []
    loaded = client.stats["loaded_back"]
    engine.add_request("loader", ps[0], GREEDY)
    collect(engine, outs)
    assert gate.entered.wait(60)
    (seq,) = engine.scheduler.loading
    assert seq.request_id == "loader" and seq.num_computed_tokens == 0
    collect(engine, outs, 2)  # the load is held: the other request keeps producing tokens
    assert len(outs["other"]) == 4 and "loader" not in outs and engine.scheduler.loading == [seq]
    while not outs["other"][-1].finished:
        collect(engine, outs)
    assert "loader" not in outs and engine.num_running == 1  # admitted, loading
    gate.release()  # from here the step has nothing to run but the load: it waits for it to land
    while engine.has_unfinished():
        collect(engine, outs)
    tokens = {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()}
    assert tokens == {"other": ref[1], "loader": ref[0]}
    usage = outs["loader"][-1].usage
    assert usage.cached_tokens_host == 3 * PAGE and client.stats["loaded_back"] == loaded + 3
    bm = engine.block_manager
    bm.wait_for_copies()
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages
    core.index.check()


def test_async_load_failing_verification_partway_recomputes_the_rest(tiny_model, page_gb, reference, core):
    ps, ref = reference
    client, engine, gate, outs = start_gated_load(tiny_model, page_gb, core, ps, ref)
    from services.engine.page_hash import page_hashes

    second = page_hashes(ps[0], PAGE)[1]
    core.arena.invalidate(client.mirror[second])  # evicted and refilled while queued for the copy
    loaded, failed = client.stats["loaded_back"], client.stats["verify_failed"]
    gate.release()
    while engine.has_unfinished():
        collect(engine, outs)
    assert [t for o in outs["loader"] for t in o.new_token_ids] == ref[0]
    assert client.stats["loaded_back"] == loaded + 1 and client.stats["verify_failed"] == failed + 1
    assert outs["loader"][-1].usage.cached_tokens_host == PAGE
    bm = engine.block_manager
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages


def test_abort_while_loading_frees_the_pages_after_the_copy(tiny_model, page_gb, reference, core):
    ps, ref = reference
    client, engine, gate, outs = start_gated_load(tiny_model, page_gb, core, ps, ref)
    bm = engine.block_manager
    engine.abort("loader")
    collect(engine, outs)
    assert outs["loader"][-1].finish_reason == "abort" and engine.scheduler.loading == []
    assert bm.num_loading == 1  # its pages are still the copy thread's
    held = bm.num_used_pages
    gate.release()
    bm.wait_for_loads()
    while engine.has_unfinished():
        collect(engine, outs)
    assert [t for o in outs["other"] for t in o.new_token_ids] == ref[1]
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages and held > 0
    assert len(bm.free_page_ids) + bm.num_cached_pages == bm.num_pages
    core.index.check()


def test_a_load_held_past_its_timeout_is_recomputed_identically(tiny_model, page_gb, reference, core):
    ps, ref = reference
    client, engine, gate, outs = start_gated_load(tiny_model, page_gb, core, ps, ref)
    bm = engine.block_manager
    bm.clock = lambda: float("inf")  # from now on every load in flight is past its timeout
    for _ in range(100):  # (both need 7 steps; the copy thread still holds the load)
        if not engine.has_unfinished():
            break
        collect(engine, outs)
    assert {rid: [t for o in os for t in o.new_token_ids] for rid, os in outs.items()} == {"other": ref[1], "loader": ref[0]}
    assert outs["loader"][-1].usage.cached_tokens_host == 0 and bm.num_load_timeouts == 1
    assert bm.num_loading == 1  # the pages the copy writes are still its own
    gate.release()
    bm.wait_for_loads()
    bm.wait_for_copies()
    assert bm.num_loading == 0 and bm.num_free_pages == bm.num_pages
    core.index.check()


def test_the_next_turn_reuses_the_answer_from_l1_from_l2_and_across_engines(tiny_model, page_gb, core):
    """Chat: turn 2 is turn 1's prompt and answer plus a new message. The answer's computed rows
    (a tail, block_manager.py) are reused from L1, from L2 after L1 evicted them, and by another
    engine: the output is the cold run's, and only the answer's last token and the new message
    are computed."""
    scored = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    cold = make_engine(tiny_model, page_gb, enable_prefix_caching=False)
    conversations = []
    for seed in range(3):
        rng = random.Random(seed)
        turn1 = [rng.randrange(100, 20000) for _ in range(40)]
        answer = run(cold, turn1).token_ids
        turn2 = turn1 + answer + [rng.randrange(100, 20000) for _ in range(10)]
        conversations.append((turn1, answer, turn2, cold.generate_sync([turn2], scored)[0]))  # 2 pages + 13 rows
    del cold  # (two engines at a time: CI's process holds many)
    gc.collect()

    e1 = make_engine(tiny_model, page_gb, HostTierClient(LocalLink(core), owner="e1"))
    e2 = make_engine(tiny_model, page_gb, HostTierClient(LocalLink(core), owner="e2"))
    for where, (turn1, answer, turn2, ref) in zip(("l1", "l2", "other engine"), conversations):
        reused = len(turn1) + len(answer) - 1
        assert run(e1, turn1).token_ids == answer
        if where != "l1":
            e1.block_manager.evict_all_cached()  # write_back: every page, the tail too, goes to L2
        engine = e2 if where == "other engine" else e1
        before = engine.stats.num_prefill_tokens
        out = engine.generate_sync([turn2], scored)[0]
        assert out.token_ids == ref.token_ids, where
        # the same KV, not merely the same argmax: every chosen token's logprob as in the cold run
        got, want = [lp.logprob for lp in out.logprobs], [lp.logprob for lp in ref.logprobs]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, (where, got, want)
        assert out.usage.cached_prompt_tokens == reused, where
        assert (out.usage.cached_tokens_device if where == "l1" else out.usage.cached_tokens_host) == reused
        assert engine.stats.num_prefill_tokens - before == len(turn2) - reused
    assert e1.block_manager.num_tail_hits == 1 and e1.block_manager.num_tail_loads == 1
    assert e2.block_manager.num_tail_loads == 1  # e2 never saw that conversation: found by hash
    core.index.check()
