"""The in-process engine: requests in, streamed tokens out, one batch per step.

Sync use::

    engine = LLMEngine(EngineConfig(model="/path/to/model"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

Async use: services wrap it (``async_api.AsyncEngine``), which steps it on its own thread::

    engine = await AsyncEngine.create(EngineConfig(...))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8)): ...

``add_request`` and ``abort`` only enqueue; ``step`` drains that mailbox
first, so they are safe to call from another thread while a step runs.

A step is a short sequence of phases (:meth:`LLMEngine.step`); each feature is a collaborator:
the scheduler and block manager (which sequences run, on which pages), the model runner
(forward, sampling, verification), the :class:`~services.engine.speculation.Speculator`
(drafts) and the :class:`~services.engine.handoff.KVHandoff` (pages exported to and imported
from other engines).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence as Seq
from pathlib import Path

import msgspec
import torch

from kernels.cpu_path import this_cpu
from schemas.engine import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from services.config import ConfigError
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.core_lease import CoreLease
from services.engine.dtypes import resolve_dtype
from services.engine.handoff import KVHandoff
from services.engine.intake import RequestIntake
from services.engine.kv_pool import KVPool
from services.engine.linear import can_prepack, prepack_weights
from services.engine.llama import LlamaModel
from services.engine.model_config import ModelConfig
from services.engine.model_runner import ModelRunner
from services.engine.outputs import Completion, EngineStats, PrefillResult
from services.engine.scheduler import ScheduledBatch, Scheduler
from services.engine.sequence import Sequence
from services.engine.speculation import Speculator
from services.engine.tier_hooks import CacheTierHooks
from services.engine.weights import load_weights

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *,
                 tier_hooks: CacheTierHooks | list[CacheTierHooks] | None = None):
        """Load the model and size the KV pool. Process-wide torch settings (threads, the global
        seed) are not made here: see ``process.configure_torch``."""
        self.config = config = config or EngineConfig()
        # the engine thread holds it around each step (async_api.py)
        self.core_lease = CoreLease(config.core_lease) if config.core_lease else None
        self.device = torch.device(config.device)
        from services.models import resolve_model

        if config.model is not None and (Path(config.model).expanduser() / "config.json").is_file():
            # Name the architectures we implement before the folder checks run.
            ModelConfig.from_dir(Path(config.model).expanduser())
        self.model_dir = resolve_model(config.model)
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        dtype_name, dtype_why = resolve_dtype(config.dtype, config.device)
        self.dtype = _TORCH_DTYPES[dtype_name]
        log.info("dtype %s (%s)", dtype_name, dtype_why)
        if self.device.type == "cpu":
            this_cpu()  # builds or loads the native kernels and logs the path chosen for this CPU, once
        if config.kv_cache_dtype == "fp8_e4m3":
            kv_dtype = torch.float8_e4m3fn
        else:
            kv_dtype = _TORCH_DTYPES.get(config.kv_cache_dtype, self.dtype)
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        weights = load_weights(self.model_dir, mc, self.dtype, config.device)
        if config.prepack_weights and can_prepack(self.device, self.dtype):
            prepack_weights(weights)
        num_pages = KVPool.pages_for_budget(
            mc, config.page_size, kv_dtype, self.device, config.kv_cache_memory, config.effective_mem_fraction
        )
        if num_pages < 2:
            raise ConfigError(f"the KV budget holds {num_pages} pages of {config.page_size} tokens; raise kv_cache_memory")
        self.kv_pool = KVPool(mc, num_pages, config.page_size, kv_dtype, self.device, config.kv_fp8_scale,
                              prefault=config.kv_prefault, huge_pages=config.kv_huge_pages)
        self.block_manager = BlockManager(
            num_pages, config.page_size, salt=config.cache_salt,
            enable_prefix_caching=config.enable_prefix_caching, hooks=tier_hooks,
            reuse_tails=config.reuse_tail_pages, copy_rows=self.kv_pool.copy_rows,
            async_load_min_pages=config.async_load_min_pages, load_timeout=config.load_back_timeout,
        )
        self.block_manager.hooks.bind(self.kv_pool)  # the tier copies pages in and out of it
        self.model = LlamaModel(mc, weights, self.kv_pool, self.max_model_len)
        self.runner = ModelRunner(self.model, config.page_size, self.device)
        self.tokenizer = self._load_tokenizer() if config.load_tokenizer else None
        self.stats = EngineStats()
        self.speculator = Speculator(
            self._make_drafter() if config.speculative_method else None,
            max_k=config.num_speculative_tokens, greedy_only=config.speculative_greedy_only, stats=self.stats,
            projection_seconds=self.model.projection_seconds, core_lease=self.core_lease,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=config.chunked_prefill_size,
            enable_mixed_batches=config.enable_mixed_batches,
            max_spec_rows=self.speculator.max_rows,
        )
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.intake = RequestIntake(tokenizer=self.tokenizer, vocab_size=mc.vocab_size,
                                    max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                    pages_for=self.block_manager.pages_for, num_pages=num_pages)
        self._mailbox: deque[tuple[str, object]] = deque()  # what add_*, import_kv and abort enqueue
        self.handoff = KVHandoff(self.kv_pool, self.block_manager, self.intake, self._mailbox.append,
                                 mc.vocab_size, self.device)
        self._seqs: dict[str, Sequence] = {}
        self.driver = None
        """The async face stepping this engine on its thread (``async_api.AsyncEngine``), if any:
        a step asks it first whether this thread may step, and hands it early outputs."""
        self.last_batch: ScheduledBatch | None = None  # the latest step's batch (traces read it: timeline.py)
        self.timelines = None  # timeline.Timelines of the requests a worker traces (None: it traces none)
        log.info(
            "engine ready: %s %s on %s, %d KV pages x %d tokens (%.2f GB, %s)",
            mc.architecture, self.dtype, config.device, num_pages, config.page_size,
            self.kv_pool.num_bytes / 1024**3, kv_dtype,
        )

    def _load_tokenizer(self):
        from services.models.tokenizer_files import load_tokenizer

        return load_tokenizer(self.model_dir)

    def _make_drafter(self):
        from services.draft.base import DRAFTERS

        return DRAFTERS.get(self.config.speculative_method).from_config(self.config, target_dir=str(self.model_dir))

    @property
    def drafter(self):
        """The drafter speculative decoding uses (None: off)."""
        return self.speculator.drafter

    def set_drafter(self, drafter) -> None:
        """Use ``drafter`` (a services.draft.base.Drafter) for speculation; None turns it off.
        Call while the engine is idle."""
        self.speculator.set_drafter(drafter)
        self.scheduler.max_spec_rows = self.speculator.max_rows

    # ---- requests -------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> None:
        """Validate and enqueue a request; it joins the batch at the next step."""
        self._mailbox.append(("add", self.intake.new_sequence(request_id, prompt, params or SamplingParams())))

    # disaggregation: the prompt's pages cross between engines (handoff.py has the details)

    def add_prefill_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                            *, skip_pages: int = 0) -> None:
        """Compute only the prompt's KV and first token; its pages from ``skip_pages`` on are
        copied out for :meth:`take_prefill_result` (``KVHandoff.add_prefill_request``)."""
        self.handoff.add_prefill_request(request_id, prompt, params, skip_pages=skip_pages)

    def take_prefill_result(self, request_id: str) -> PrefillResult | None:
        """The exported pages of a finished prefill-only request (once)."""
        return self.handoff.take_result(request_id)

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Seq[int], first_token_id: int,
                              kv: torch.Tensor | None, params: SamplingParams | None = None, *,
                              num_cached_tokens: int = 0, first_logprob: TokenLogprob | None = None,
                              kv_scales: Seq[float] = (), kv_first_page: int = 0) -> None:
        """Continue a request prefilled elsewhere from its first token and its prompt's pages from
        ``kv_first_page`` on (``kv=None``: they come later, through :meth:`import_kv`;
        ``KVHandoff.add_prefilled_request``)."""
        self.handoff.add_prefilled_request(
            request_id, prompt_token_ids, first_token_id, kv, params, num_cached_tokens=num_cached_tokens,
            first_logprob=first_logprob, kv_scales=kv_scales, kv_first_page=kv_first_page)

    def import_kv(self, request_id: str, kv: torch.Tensor | None, kv_scales: Seq[float] = (),
                  kv_first_page: int | None = None) -> bool:
        """The pages of a request added with ``kv=None`` arrived (None: they will not); False when
        the request is gone (``KVHandoff.import_kv``)."""
        return self.handoff.import_kv(request_id, kv, kv_scales, kv_first_page)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step; its pages return to the pool and a
        final output with finish_reason ``abort`` is produced. Unknown ids are ignored."""
        self._mailbox.append(("abort", request_id))

    def abort_all(self) -> list[RequestOutput]:
        """On the stepping thread, after a failed step: abort every request; their final outputs."""
        return [self._finish(seq, "abort", []) for seq in list(self._seqs.values())]

    def has_unfinished(self) -> bool:
        return bool(self._mailbox) or self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        """Admitted requests: running, or waiting for their KV pages from a lower tier."""
        return len(self.scheduler.running) + len(self.scheduler.loading)

    @property
    def num_waiting(self) -> int:
        """Queued requests, and imported ones whose pages are on their way."""
        return len(self.scheduler.waiting) + len(self.handoff.awaiting)

    # ---- the step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Drain the mailbox, run one batch, return what each request produced."""
        if self.driver is not None:
            self.driver.before_step()  # a caller's thread may not step beside a running engine thread
        t0 = time.perf_counter()
        outputs = self._drain_mailbox()
        if outputs and self.driver is not None and self.driver.post_early(outputs):
            # first tokens of prefills done elsewhere (1P1D) and aborts reach their streams now,
            # not after this step's forward pass (one decode step less of TTFT)
            outputs = []
        self.speculator.draft(self.scheduler.running, self.scheduler.max_spec_rows)
        self.block_manager.tier_tick()  # lower cache tiers: reclaim landed copies, start new ones
        batch = self.last_batch = self.scheduler.schedule()
        outputs += [self._finish(seq, "length", []) for seq in batch.out_of_pages]
        if batch.is_empty:
            if self.scheduler.loading:  # only lower-tier copies to wait for: wait (not spin) for one
                self.block_manager.wait_loads(0.05)
            return outputs
        self.handoff.write_imported(batch)
        sampled = self.runner.run(batch)
        self._advance(batch)
        outputs += self._append_sampled(batch, *sampled)
        self._account(batch, time.perf_counter() - t0)
        return outputs

    def _drain_mailbox(self) -> list[RequestOutput]:
        outputs = []
        while self._mailbox:
            kind, item = self._mailbox.popleft()
            if kind == "add":
                self._seqs[item.request_id] = item
                self.scheduler.add(item)
            elif kind == "import":
                seq, first_token_id, first_logprob = item
                self._seqs[seq.request_id] = seq
                out = self._append(seq, [first_token_id], [first_logprob])
                if not out.finished and not seq.awaiting_kv:
                    self.scheduler.add(seq)
                outputs.append(out)
            elif kind == "kv":
                seq, kv, first_page = item
                if self._seqs.get(seq.request_id) is not seq or seq.finish_reason is not None:
                    continue  # finished at its first token, or aborted, meanwhile
                self.handoff.pages_arrived(seq, kv, first_page)
                self.scheduler.add(seq)
            else:
                seq = self._seqs.get(item)
                if seq is not None:
                    outputs.append(self._finish(seq, "abort", []))
                else:  # a prefill that finished before its caller gave up: drop its copied pages
                    self.handoff.take_result(item)
        return outputs

    def _advance(self, batch: ScheduledBatch) -> None:
        """Credit each sequence with the tokens the forward pass computed and index its full pages
        (a verifying one is credited when it knows what it accepted: :meth:`_append`)."""
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if batch.is_verifying(i):
                continue
            seq.num_computed_tokens += n
            if seq.imported_kv is not None and seq.num_computed_tokens < seq.num_tokens - 1:
                self.handoff.close_gap(seq)
            self.block_manager.index_computed_pages(seq)

    def _append_sampled(self, batch: ScheduledBatch, seqs: list[Sequence], tokens: list[list[int]],
                        logprobs: list[list[TokenLogprob | None]], errors: dict[int, str]) -> list[RequestOutput]:
        outputs = []
        for i, (seq, toks, lps) in enumerate(zip(seqs, tokens, logprobs)):
            if i in errors:
                outputs.append(self._fail(seq, errors[i]))
                continue
            try:
                verified = batch.is_verifying(i)  # (the sampling sequences start with the batch's decode ones)
                if verified:
                    self.speculator.verified(seq, len(toks) - 1)
                outputs.append(self._append(seq, toks, lps, verified=verified))
            except Exception:  # e.g. the detokenizer: this request fails alone, the batch goes on
                log.exception("request %s failed after its token was sampled", seq.request_id)
                outputs.append(self._fail(seq, "internal error finishing this request's step"))
        return outputs

    def _account(self, batch: ScheduledBatch, step_s: float) -> None:
        st = self.stats
        st.num_steps += 1
        st.forward_seconds += self.runner.last_forward_seconds
        st.num_decode_tokens += batch.num_decode
        st.num_prefill_tokens += sum(batch.num_new_tokens[batch.num_decode :])
        st.step_seconds += step_s
        self.speculator.observe_step(batch, step_s)

    # ---- tokens out -------------------------------------------------------

    def _append(self, seq: Sequence, tokens: list[int], lps: list[TokenLogprob | None], *,
                verified: bool = False) -> RequestOutput:
        """Append ``tokens`` one by one (a stop drops the rest). ``verified``: they are a
        speculating sequence's accepted drafts and the target's next token, so its KV rolls back
        to them: computed up to the last one, pages past it freed, only pages full of accepted
        tokens indexed."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            seq.token_ids.append(token)
            kept.append(token)
            reason = seq.stop_reason(token)
            if reason is not None:
                break
        if verified:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.truncate(seq, seq.num_computed_tokens)
            self.block_manager.index_computed_pages(seq)
        out_lps = [lp for lp in lps[: len(kept)] if lp is not None] or None
        if reason is not None:
            return self._finish(seq, reason, kept, out_lps)
        self.speculator.commit(seq, kept)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=kept,
            new_text=seq.detok.take(False) if seq.detok is not None else "",
            logprobs=out_lps,
        )

    def _finish(
        self, seq: Sequence, reason: FinishReason, new_ids: list[int], lps: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        if seq.is_prefill_only and new_ids and seq.page_ids:
            self.handoff.export(seq, new_ids[0], lps[0] if lps else None)
        self.scheduler.remove(seq)
        self.speculator.close(seq.request_id)
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        self.intake.release(seq.request_id)
        self.handoff.forget(seq)
        usage = seq.usage()
        self.stats.num_prompt_tokens += usage.prompt_tokens
        self.stats.num_cached_prompt_tokens += usage.cached_prompt_tokens
        self.stats.num_cached_device_tokens += usage.cached_tokens_device
        self.stats.num_cached_host_tokens += usage.cached_tokens_host
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=seq.detok.take(True) if seq.detok is not None else "",
            finished=True,
            finish_reason=reason,
            usage=usage,
            logprobs=lps,
        )

    def _fail(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish one request the engine could not serve (pages freed); its output carries the error."""
        out = self._finish(seq, "abort", [])
        return msgspec.structs.replace(out, new_text="", error=f"request {seq.request_id}: {reason}")

    # ---- run to completion ----------------------------------------------

    def generate_sync(
        self, prompts: Seq[str | Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run ``prompts`` together to the end (batched); results in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        ids = [f"sync-{uuid.uuid4().hex}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params):
            self.add_request(rid, prompt, p)
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        lps: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id not in tokens:
                    continue
                tokens[out.request_id] += out.new_token_ids
                texts[out.request_id].append(out.new_text)
                if out.logprobs:
                    lps[out.request_id] += out.logprobs
                if out.finished:
                    done[out.request_id] = out
        return [
            Completion(
                request_id=rid, token_ids=tokens[rid], text="".join(texts[rid]),
                finish_reason=done[rid].finish_reason, usage=done[rid].usage,
                logprobs=lps[rid] if p.logprobs is not None else None,
            )
            for rid, p in zip(ids, params)
        ]
