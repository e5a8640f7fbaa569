"""What tracing costs a decode step: tracing off against every request traced (sample ratio 1.0).

    python -m bench.trace_bench              # the default model, 8 streams x 128 tokens, 6 rounds (~5 min)
    python -m bench.trace_bench --quick      # smoke run (~1 min)

One engine on its engine thread (AsyncEngine, as a worker runs it) decodes N concurrent greedy
requests; rounds alternate between the two modes so drift hits both alike:

  off   no tracer provider, no timelines: what a worker without an OTLP endpoint runs (the code before
        tracing differs by one attribute store and one read per step);
  on    an SDK tracer provider sampling every request (ParentBased(TraceIdRatioBased(1.0))), its spans
        encoded as OTLP protobuf by a batch processor (then dropped: no network in the figure); every
        request tracked by the engine's Timelines and its spans recorded by the worker's own code
        (services/workers/trace_spans.py) when it finishes, as a worker does.

Reported per mode: the median over rounds of the mean decode step (engine step time / steps), decode
tokens/s over the round, and for ``on`` the time the event loop spent recording each request's spans.
The goal (issue 31): tracing on costs under 2% of a step; off is not measurable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from types import SimpleNamespace

from bench.common import machine, median, table
from schemas.engine import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Write a long story about a river that runs through an ancient city, told by the river itself:"


class _EncodingExporter:
    """Encodes each batch as an OTLP/HTTP payload would be (the CPU an exporter spends), then drops it."""

    def __init__(self):
        self.num_spans = 0

    def export(self, spans):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export import SpanExportResult

        encode_spans(spans).SerializeToString()
        self.num_spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis: int = 30000):
        return True


def tracer_on():
    """An SDK provider like setup_tracing's (sample everything), exporting to _EncodingExporter."""
    import bus.tracing as tracing
    from bus.tracing.setup import EXPORT_DELAY_MS, RequestIdOnEverySpan
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    exporter = _EncodingExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(1.0)))
    provider.add_span_processor(RequestIdOnEverySpan())
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    return provider, exporter, provider.get_tracer("kvbus.bench"), tracing


async def one_round(engine, worker, *, traced: bool, num_streams: int, num_tokens: int, tag: str) -> dict:
    import bus.tracing as tracing
    from services.workers import trace_spans

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    stats = engine.stats
    steps0, seconds0 = stats.num_steps, stats.step_seconds
    record_s: list[float] = []

    async def stream(i: int) -> int:
        rid = f"{tag}-{i}"
        trace = tracing.RequestTrace.start("bench", {}, request_id=rid) if traced else tracing.NO_TRACE
        timeline = trace_spans.track(worker, rid, trace)
        n = 0
        async for out in engine.generate(f"{i} {PROMPT}", params, request_id=rid):
            n += len(out.new_token_ids)
        t0 = time.perf_counter()
        trace_spans.record_engine_stages(worker, trace, timeline, ended_at=time.monotonic())
        trace.end()
        record_s.append(time.perf_counter() - t0)
        return n

    t0 = time.perf_counter()
    tokens = sum(await asyncio.gather(*(stream(i) for i in range(num_streams))))
    wall = time.perf_counter() - t0
    steps = stats.num_steps - steps0
    return {"step_ms": (stats.step_seconds - seconds0) / steps * 1e3, "tok_s": tokens / wall,
            "record_us": sum(record_s) / len(record_s) * 1e6 if traced else 0.0, "steps": steps}


async def run(args) -> None:
    from services.engine import EngineConfig
    from services.engine.async_api import AsyncEngine

    config = EngineConfig(model=args.model, kv_cache_memory=0.5, max_running_requests=args.streams)
    engine = await AsyncEngine.create(config)
    worker = SimpleNamespace(engine=engine, tier=None, config=SimpleNamespace(
        speculative_method=None, draft_placement="local", hicache_write_policy="write_back"))
    provider, exporter, tracer, tracing = tracer_on()
    untraced_tracer = tracing._tracer
    await one_round(engine, worker, traced=False, num_streams=args.streams, num_tokens=8, tag="warm")
    results: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            traced = mode == "on"
            tracing._tracer = tracer if traced else untraced_tracer
            if not traced:  # a worker that traces nothing has no timelines (one is made on first use)
                engine.engine.timelines = None
            results[mode].append(await one_round(engine, worker, traced=traced, num_streams=args.streams,
                                                 num_tokens=args.tokens, tag=f"{mode}{r}"))
            print(f"round {r} {mode}: {results[mode][-1]}", flush=True)
    provider.force_flush()
    tracing._tracer = untraced_tracer
    await engine.aclose()
    off_step = median([x["step_ms"] for x in results["off"]])
    rows = []
    for mode in ("off", "on"):
        step = median([x["step_ms"] for x in results[mode]])
        rows.append([mode, f"{step:.3f}", f"{(step / off_step - 1) * 100:+.2f}%",
                     f"{median([x['tok_s'] for x in results[mode]]):.1f}",
                     f"{median([x['record_us'] for x in results[mode]]):.0f}" if mode == "on" else "-"])
    print(f"\n{machine()}; model {engine.model_dir.name}, {args.streams} streams x {args.tokens} tokens, "
          f"{args.rounds} rounds per mode; {exporter.num_spans} spans encoded")
    print(table(rows, ["tracing", "decode step ms (median of rounds)", "vs off", "decode tok/s",
                       "recording spans, us/request"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per mode (alternating)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 streams x 32 tokens, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.tokens, args.rounds = 4, 32, 2
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
