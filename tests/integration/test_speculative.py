"""Speculative decoding through the whole system (kvbus up on a real nats-server).

Greedy output with a drafter in the worker (local) or in the draft service (remote) must be the
in-process plain engine's; a draft service killed mid-stream must not stall or change a stream.
Requests go one at a time, so every decode step is one sequence alone, as in the reference.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.nats_transport import BusConfig, connect
from bus.subjects import GENERATE, WORKER_HEALTH
from schemas.common import HealthRequest
from schemas.engine import SamplingParams
from schemas.generate import GenerateRequest
from services.local_system import LocalSystem as Cluster
from tests.integration.test_disaggregated import assert_same_greedy_tokens, health

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "Repeat the following code exactly:\nimport os\n\ndef read(path):\n    with open(path) as f:\n"
    "        return f.read()\n\ndef write(path, text):\n    with open(path, 'w') as f:\n        f.write(text)\n"
    "\nRepeated:\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Here is a list: apple, banana, cherry, date, elderberry, fig, grape. Write the list again: apple,",
    "What are the three primary colors?",
]
# twenty in all, as the in-process identity test (tests/engine/test_spec_decode.py): copy-heavy text
# where drafts land and open questions where they mostly miss
TEXTS += [
    "Copy this JSON: {\"name\": \"kvbus\", \"version\": 3, \"tags\": [\"a\", \"b\"]}\nCopy:",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "SELECT id, name FROM users WHERE id = 1;\nSELECT id, name FROM users WHERE id = 2;\nSELECT",
    "Tell me a short story about a robot learning to paint.",
    "a b c d e f g h i j k l m n o p a b c d e f g h i j k l m n o p a b c d",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday, Tuesday,",
    "<ul>\n  <li>one</li>\n  <li>two</li>\n  <li>three</li>\n</ul>\nAgain:\n<ul>\n  <li>",
    "Why is the sea salty?",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "Translate to French: good morning, good evening, good night.",
    "red green blue red green blue red green blue red green",
    "Write a haiku about the ocean.",
    "The capital of France is Paris. The capital of Spain is Madrid. The capital of Italy is",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,",
    "Explain what a hash table is in one sentence.",
    "To be, or not to be, that is the question. To be, or not to be,",
]
assert len(TEXTS) == 20
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    from services.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.25))
    return [(c.token_ids, c.logprobs) for c in (engine.generate_sync([p], GREEDY)[0] for p in prompts)]


async def _stream(bus, ids: list[int], params: SamplingParams, on_chunk=None) -> list[int]:
    out: list[int] = []
    async with bus.stream(GENERATE, GenerateRequest(prompt_token_ids=ids, sampling=params)) as chunks:
        async for chunk in chunks:
            out += chunk.token_ids
            if on_chunk is not None:
                on_chunk(len(out))
    return out


async def _one_at_a_time(nats_url: str, prompts: list[list[int]]) -> list[list[int]]:
    bus = await connect(BusConfig(nats_url=nats_url, request_timeout=120))
    try:
        return [await _stream(bus, p, GREEDY) for p in prompts]
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def draft_folder(model_dir, tmp_path_factory):
    """A 6-layer cut of the target: shares its tokenizer; accepts little, which is what the identity
    check needs (many rejections and rollbacks)."""
    from services.models.truncate import write_truncated_model

    return write_truncated_model(model_dir, tmp_path_factory.mktemp("draft") / "draft", 6)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("drafter,placement", [("ngram", "local"), ("ngram", "remote"), ("model", "local"),
                                               ("model", "remote")])
def test_greedy_through_kvbus_up_matches_plain_decoding(drafter, placement, model_dir, prompts, reference,
                                                        request):
    # a model drafter's first proposal for a stream prefills its prompt: past the default 50 ms the
    # worker would decode plainly for 2 s, and how much got drafted would depend on the machine's speed
    extra = ["--draft-model", str(request.getfixturevalue("draft_folder")),
             "--engine-args", "--draft-timeout 30"] if drafter == "model" else []
    with Cluster("--aggregated", "--speculative", drafter, "--draft-placement", placement, *extra,
                 model_dir=model_dir) as cluster:
        try:
            got = asyncio.run(_one_at_a_time(cluster.nats_url, prompts))
            assert_same_greedy_tokens(reference, got, f"speculative {placement}")
            assert got == [r[0] for r in reference]
            worker = asyncio.run(health(cluster.nats_url, "worker", "worker-0")).detail
            # every request drafts in its first decode step (adaptive k starts from an assumed rate)
            assert int(worker["spec_drafted"]) >= len(prompts), worker
            if drafter == "ngram":  # the prompts copy their context: n-gram drafts must land
                assert int(worker["spec_accepted"]) > 10, worker
            # the gateway's Prometheus series, from the usage of every request that speculated
            import httpx

            metrics = httpx.get(cluster.http_url.rstrip("/") + "/metrics", timeout=30).text
            series = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("kvbus_spec_decode_"))
            assert float(series["kvbus_spec_decode_num_draft_tokens_total"]) >= len(prompts), series
            accepted = float(series["kvbus_spec_decode_num_accepted_tokens_total"])
            assert float(series["kvbus_spec_decode_num_draft_tokens_total"]) >= accepted, series
            assert float(series["kvbus_spec_decode_accept_length_count"]) >= 1, series
            assert float(series["kvbus_spec_decode_draft_time_share_count"]) >= 1, series
            if placement == "remote":
                draft = asyncio.run(health(cluster.nats_url, "draft", "draft-0")).detail
                assert int(draft["batches"]) > 0, draft
        except BaseException:
            print(cluster.log(150))
            raise


async def _wait_ready(bus, role: str, wid: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await bus.request(WORKER_HEALTH, HealthRequest(), timeout=0.5, role=role, worker_id=wid)).ready:
                return
        except Exception:
            pass
        assert time.monotonic() < deadline, f"{wid} not ready"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(900)
def test_remote_drafter_killed_mid_stream(model_dir, prompts):
    """The worker speculates with a draft service this test starts and then kills (SIGKILL) while a
    stream runs: the stream completes, with the tokens of plain decoding."""
    from services.engine import EngineConfig, LLMEngine

    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=0.25))
    want = engine.generate_sync([prompts[0]], long)[0].token_ids
    args = ("--aggregated", "--engine-args", "--speculative-method ngram --draft-placement remote --draft-timeout 0.2")
    with Cluster(*args, model_dir=model_dir) as cluster:
        draft = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", "draft", "--worker-id", "draft-x", "--nats-url",
             cluster.nats_url, "--model", str(model_dir)],
            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            async def main():
                bus = await connect(BusConfig(nats_url=cluster.nats_url, request_timeout=120))
                try:
                    await _wait_ready(bus, "draft", "draft-x")
                    # The worker's first call (kvbus up's smoke request, before this service
                    # existed) timed out and put it in a 2 s backoff: stream until the service
                    # has drafted accepted tokens, within a deadline.
                    until = time.monotonic() + 120
                    while True:
                        warm = await _stream(bus, prompts[0], long)  # the service is used
                        assert warm == want
                        detail = (await bus.request(WORKER_HEALTH, HealthRequest(), role="worker",
                                                    worker_id="worker-0")).detail
                        if int(detail["spec_accepted"]) > 0:
                            break
                        assert time.monotonic() < until, detail

                    def kill_at_some_point(n: int) -> None:
                        if n >= 8 and draft.poll() is None:
                            draft.send_signal(signal.SIGKILL)

                    t0 = time.monotonic()
                    killed = await _stream(bus, prompts[0], long, kill_at_some_point)
                    return warm, killed, time.monotonic() - t0
                finally:
                    await bus.close()

            warm, killed, seconds = asyncio.run(main())
            assert draft.poll() is not None  # it really died mid-stream
            assert warm == want and killed == want
            assert seconds < 120
        except BaseException:
            print(cluster.log(150))
            raise
        finally:
            if draft.poll() is None:
                draft.kill()
            draft.wait()
