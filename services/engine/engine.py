"""The in-process engine: requests in, streamed tokens out, one batch per step.

Sync use::

    engine = LLMEngine(EngineConfig(model="/path/to/model"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

Async use (the step runs in a worker thread, the event loop stays free)::

    async for out in engine.generate("Hello", SamplingParams(max_tokens=8)): ...

``add_request`` and ``abort`` only enqueue; ``step`` drains that mailbox
first, so they are safe to call from another thread while a step runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence as Seq
from pathlib import Path

import msgspec
import torch

from kernels import gather_pages, scatter_pages
from kernels.sampling import GREEDY_EPS
from schemas.engine import FinishReason, RequestOutput, SamplingParams, TokenLogprob, Usage
from services.config import ConfigError
from services.engine.async_api import AsyncEngineMixin
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.core_lease import CoreLease
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.kv_pool import KVPool
from services.engine.linear import can_prepack, prepack_weights
from services.engine.llama import LlamaModel
from services.engine.model_config import ModelConfig
from services.engine.model_runner import ModelRunner
from services.engine.outputs import Completion, EngineStats, PrefillResult, RequestError
from services.engine.scheduler import Scheduler
from services.engine.sequence import Sequence
from services.engine.spec_decode import (
    EMA_WEIGHT,
    INITIAL_ACCEPTANCE,
    PROBE_INTERVAL,
    ROW_COST,
    SPEC_MAX_ROWS,
    RowCost,
    budget_drafts,
    choose_k,
)
from services.engine.tier_hooks import CacheTierHooks
from services.engine.weights import load_weights

log = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine(AsyncEngineMixin):
    def __init__(self, config: EngineConfig | None = None, *,
                 tier_hooks: CacheTierHooks | list[CacheTierHooks] | None = None):
        self.config = config = config or EngineConfig()
        if config.device == "cpu":
            torch.set_num_threads(config.num_threads or len(os.sched_getaffinity(0)) or 1)
        # the engine thread holds it around each step (engine_thread.py)
        self.core_lease = CoreLease(config.core_lease) if config.core_lease else None
        torch.manual_seed(config.seed)
        self.device = torch.device(config.device)
        from services.models import resolve_model

        if config.model is not None and (Path(config.model).expanduser() / "config.json").is_file():
            # Name the architectures we implement before the folder checks run.
            ModelConfig.from_dir(Path(config.model).expanduser())
        self.model_dir = resolve_model(config.model)
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        self.dtype = _TORCH_DTYPES.get(config.dtype) or _TORCH_DTYPES.get(mc.dtype or "", torch.float32)
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
            reuse_tails=config.reuse_tail_pages, async_load_min_pages=config.async_load_min_pages,
            load_timeout=config.load_back_timeout,
        )
        self.block_manager.bind(self.kv_pool)
        self.scheduler = Scheduler(
            self.block_manager,
            max_running_requests=config.max_running_requests,
            max_prefill_tokens=config.max_prefill_tokens,
            chunked_prefill_size=config.chunked_prefill_size,
            enable_mixed_batches=config.enable_mixed_batches,
            max_spec_rows=SPEC_MAX_ROWS if config.speculative_method else 0,
        )
        self.model = LlamaModel(mc, weights, self.kv_pool, self.max_model_len)
        self.runner = ModelRunner(self.model, config.page_size, self.device)
        self.tokenizer = self._load_tokenizer() if config.load_tokenizer else None
        self.drafter = self._make_drafter() if config.speculative_method else None
        self.row_cost: RowCost | None = self._measure_row_cost() if self.drafter is not None else None
        self._decode_other_s: float | None = None  # moving average, decode-only steps (_draft's budget)
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.stats = EngineStats()
        self._mailbox: deque[tuple[str, object]] = deque()
        self._seqs: dict[str, Sequence] = {}
        self._live_ids: set[str] = set()
        self._prefill_results: dict[str, PrefillResult] = {}
        self._awaiting_kv: dict[str, Sequence] = {}  # imported requests whose pages are on their way
        self._lock = threading.Lock()
        self._init_async()
        log.info(
            "engine ready: %s %s on %s, %d KV pages x %d tokens (%.2f GB, %s)",
            mc.architecture, self.dtype, config.device, num_pages, config.page_size,
            self.kv_pool.num_bytes / 1024**3, kv_dtype,
        )

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)

    def _make_drafter(self):
        from services.draft.base import make_drafter

        c = self.config
        return make_drafter(
            c.speculative_method, min_n=c.ngram_min, max_n=c.ngram_max, model=c.draft_model,
            target_dir=str(self.model_dir), device=c.device,
        )

    def set_drafter(self, drafter) -> None:
        """Use ``drafter`` (a services.draft.base.Drafter) for speculation; None turns it off.
        Call while the engine is idle."""
        self.drafter = drafter
        self.scheduler.max_spec_rows = SPEC_MAX_ROWS if drafter is not None else 0
        if drafter is not None and self.row_cost is None:
            self.row_cost = self._measure_row_cost()

    def _measure_row_cost(self) -> RowCost:
        """How a decode step's projection time grows with its rows, timed on this machine (~0.3 s
        for the default model): what the draft budget weighs drafts against. Engines that share
        the host's cores time it holding the core lease, so they do not skew each other's."""
        with self.core_lease if self.core_lease is not None else contextlib.nullcontext():
            cost = RowCost.measure(self.model.projection_seconds)
        log.info("speculation: projections read in %.1f ms a step and cost %.2f ms a row computed (~%d rows free)",
                 cost.memory_s * 1e3, cost.row_s * 1e3, int(cost.memory_s / cost.row_s) if cost.row_s > 0 else 0)
        return cost

    # ---- requests -------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> None:
        """Validate and enqueue a request; it joins the batch at the next step."""
        seq = self._new_sequence(request_id, prompt, params or SamplingParams())
        self._mailbox.append(("add", seq))

    def add_prefill_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
        *, skip_pages: int = 0,
    ) -> None:
        """Compute only the prompt's KV and first token (a prefill worker's job).

        The request finishes with its first token; its prompt pages from
        ``skip_pages`` on are copied out (:meth:`take_prefill_result`; the
        receiver holds the ones before) and all are released to the prefix cache.
        """
        seq = self._new_sequence(request_id, prompt, params or SamplingParams(), with_text=False)
        try:
            self._check_skip_pages(seq, skip_pages)
        except RequestError:
            with self._lock:
                self._live_ids.discard(request_id)
            raise
        seq.imported_first_page = skip_pages
        seq.is_prefill_only = True
        seq.max_output_tokens = 1
        self._mailbox.append(("add", seq))

    def take_prefill_result(self, request_id: str) -> PrefillResult | None:
        """The exported pages of a finished prefill-only request (once)."""
        return self._prefill_results.pop(request_id, None)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        first_token_id: int,
        kv: torch.Tensor | None,
        params: SamplingParams | None = None,
        *,
        num_cached_tokens: int = 0,
        first_logprob: TokenLogprob | None = None,
        kv_scales: Seq[float] = (),
        kv_first_page: int = 0,
    ) -> None:
        """Continue a request prefilled elsewhere: ``kv`` holds its prompt's pages from
        ``kv_first_page`` on (``[pages, layers, 2, page_size, Hkv, D]``, as :meth:`prefill`
        exports them) and ``first_token_id`` its first generated token, which is streamed first.

        ``kv=None``: the pages are still on their way. The first token streams now; the request
        waits outside the scheduler (holding no pages) until :meth:`import_kv` hands them over,
        or says they will not come, and then it computes its prompt here.

        The pages before ``kv_first_page`` are expected in this engine's prefix cache or
        host tier (the caller counted them when it asked for the prefill); any that left
        meanwhile are recomputed here before the imported ones are written."""
        params = params or SamplingParams()
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        try:
            self._check_skip_pages(seq, kv_first_page)
            self._check_first_token(first_token_id)
            if kv is not None:
                self._check_imported_kv(seq, kv, kv_scales, kv_first_page)
        except RequestError:
            with self._lock:
                self._live_ids.discard(request_id)
            raise
        seq.imported_first_page = kv_first_page
        seq.imported_kv = kv
        seq.awaiting_kv = kv is None
        seq.num_cached_tokens = num_cached_tokens
        seq.is_admitted_once = True
        if kv is None:
            with self._lock:
                self._awaiting_kv[request_id] = seq
        self._mailbox.append(("import", (seq, first_token_id, first_logprob)))

    def import_kv(self, request_id: str, kv: torch.Tensor | None, kv_scales: Seq[float] = (),
                  kv_first_page: int | None = None) -> bool:
        """The pages of a request added with ``kv=None`` arrived (``kv_first_page``: where they
        start, if not where the request said). ``kv=None``, or pages that do not fit: they will
        not come, and the request computes its prompt (and first token) here, as after a
        preemption. False when the request is gone (finished at its first token, or aborted)."""
        with self._lock:
            seq = self._awaiting_kv.pop(request_id, None)
        if seq is None:
            return False
        first_page = seq.imported_first_page if kv_first_page is None else kv_first_page
        if kv is not None:
            try:
                self._check_skip_pages(seq, first_page)
                self._check_imported_kv(seq, kv, kv_scales, first_page)
            except RequestError as exc:
                log.warning("pages for %s do not fit (%s): computing its prompt here", request_id, exc)
                kv = None
        self._mailbox.append(("kv", (seq, kv, first_page)))
        return True

    def _check_first_token(self, first_token_id: int) -> None:
        vocab = self.model_config.vocab_size
        if not 0 <= first_token_id < vocab:
            raise RequestError(f"first_token_id must be in [0, {vocab})")

    def _check_imported_kv(self, seq: Sequence, kv, kv_scales: Seq[float], first_page: int) -> None:
        pool = self.kv_pool
        num_pages = self.block_manager.pages_for(seq.num_prompt_tokens) - first_page
        want = (num_pages, *pool.data.shape[1:])
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            raise RequestError(f"prefilled KV must be {list(want)}, got {list(getattr(kv, 'shape', []))}")
        if kv.dtype != pool.dtype:
            raise RequestError(f"prefilled KV is {kv.dtype}, this pool holds {pool.dtype}")
        if list(kv_scales) != self._kv_scales():
            raise RequestError(f"prefilled KV scales {list(kv_scales)} differ from this pool's {self._kv_scales()}")

    def _check_skip_pages(self, seq: Sequence, skip_pages: int) -> None:
        # The page holding the last prompt token is always computed (its logits give the first
        # token), so at most the full pages before it can be skipped.
        limit = (seq.num_prompt_tokens - 1) // self.block_manager.page_size
        if not (isinstance(skip_pages, int) and 0 <= skip_pages <= limit):
            raise RequestError(f"skip_pages must be in [0, {limit}] for a {seq.num_prompt_tokens}-token prompt "
                               f"(pages of {self.block_manager.page_size} tokens), got {skip_pages}")

    def _kv_scales(self) -> list[float]:
        pool = self.kv_pool
        return [float(pool.k_scale), float(pool.v_scale)] if pool.is_fp8 else []

    def _new_sequence(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *, with_text: bool = True
    ) -> Sequence:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need the tokenizer (load_tokenizer=True)")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        self._check_prompt(token_ids, params)
        with self._lock:
            if request_id in self._live_ids:
                raise RequestError(f"request id {request_id!r} is already running")
            self._live_ids.add(request_id)
        seq = Sequence(
            request_id, token_ids, params, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
        )
        if self.tokenizer is not None and with_text:
            seq.detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        return seq

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens; the context length is {self.max_model_len}"
            )
        if self.block_manager.pages_for(len(token_ids) + 1) > self.block_manager.num_pages:
            raise RequestError(f"the prompt has {len(token_ids)} tokens, more than the whole KV pool holds")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the tokenizer (load_tokenizer=True)")

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step; its pages return to the pool and a
        final output with finish_reason ``abort`` is produced. Unknown ids are ignored."""
        self._mailbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        return bool(self._mailbox) or self.scheduler.num_unfinished > 0

    @property
    def num_running(self) -> int:
        """Admitted requests: running, or waiting for their KV pages from a lower tier."""
        return len(self.scheduler.running) + len(self.scheduler.loading)

    @property
    def num_waiting(self) -> int:
        """Queued requests, and imported ones whose pages are on their way."""
        return len(self.scheduler.waiting) + len(self._awaiting_kv)

    # ---- the step -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Drain the mailbox, run one batch, return what each request produced."""
        if self._thread is not None:
            self._claim_sync()
        t0 = time.perf_counter()
        outputs = self._drain_mailbox()
        if outputs and self.post_outputs is not None and self.post_outputs(outputs):
            # first tokens of prefills done elsewhere (1P1D) and aborts reach their streams now,
            # not after this step's forward pass (one decode step less of TTFT)
            outputs = []
        if self.drafter is not None:
            self._draft()
        self.block_manager.tier_tick()  # lower cache tiers: reclaim landed copies, start new ones
        batch = self.scheduler.schedule()
        for seq in batch.out_of_pages:
            outputs.append(self._finish(seq, "length", []))
        if batch.is_empty:
            if self.scheduler.loading:  # only lower-tier copies to wait for: wait (not spin) for one
                self.block_manager.wait_loads(0.05)
            return outputs
        for seq in batch.seqs[batch.num_decode :]:
            if seq.imported_kv is not None and seq.num_computed_tokens == seq.num_tokens - 1:
                self._write_imported_pages(seq)
        sampled_seqs, tokens, logprobs, errors = self.runner.run(batch)
        nd = batch.num_decode
        verifying = {id(s) for s, n in zip(batch.seqs[:nd], batch.num_new_tokens[:nd]) if n > 1}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if id(seq) in verifying:
                continue  # speculated: computed up to what it accepts (_append_verified)
            seq.num_computed_tokens += n
            if seq.imported_kv is not None and seq.num_computed_tokens < seq.num_tokens - 1:
                self._close_import_gap(seq)
            self.block_manager.index_computed_pages(seq)
        for i, (seq, toks, lps) in enumerate(zip(sampled_seqs, tokens, logprobs)):
            if i in errors:
                outputs.append(self._fail(seq, errors[i]))
                continue
            try:
                if id(seq) in verifying:
                    outputs.append(self._append_verified(seq, toks, lps))
                else:
                    outputs.append(self._append_token(seq, toks[0], lps[0]))
            except Exception:  # e.g. the detokenizer: this request fails alone, the batch goes on
                log.exception("request %s failed after its token was sampled", seq.request_id)
                outputs.append(self._fail(seq, "internal error finishing this request's step"))
        st = self.stats
        st.num_steps += 1
        st.forward_seconds += self.runner.last_forward_seconds
        st.num_decode_tokens += batch.num_decode
        st.num_prefill_tokens += sum(batch.num_new_tokens[batch.num_decode :])
        step_s = time.perf_counter() - t0
        st.step_seconds += step_s
        if self.row_cost is not None and batch.num_decode == len(batch.seqs):
            # what a decode step costs beside its projections (attention, norms, sampling): the
            # draft budget divides a step's tokens by its whole time
            other = max(0.0, step_s - self.row_cost.seconds(sum(batch.num_new_tokens)))
            prev = self._decode_other_s
            self._decode_other_s = other if prev is None else (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * other
        return outputs

    # ---- speculative decoding (docs/speculative.md) --------------------------

    def _draft(self) -> None:
        """Ask the drafter for every decoding sequence's drafts, k chosen per sequence."""
        t0 = time.perf_counter()
        decoding = [s for s in self.scheduler.running if s.is_decoding]
        for seq in decoding:
            seq.draft_tokens, seq.draft_probs = [], None
        if len(decoding) >= self.scheduler.max_spec_rows:
            return  # no room for a draft within SPEC_MAX_ROWS (the packed kernel's range)
        drafter = self.drafter
        greedy_only = self.config.speculative_greedy_only
        wants: dict[str, int] = {}
        for seq in decoding:
            if greedy_only and seq.params.temperature >= GREEDY_EPS:  # the sampler's own greedy test
                continue  # sampled: plain decoding (its seeded draws stay those of plain sampling)
            k = self._spec_k(seq)
            if k:
                if not drafter.has(seq.request_id):
                    drafter.open(seq.request_id, seq.token_ids)
                wants[seq.request_id] = k
        if not wants:
            return
        proposals = drafter.propose_many(wants)
        spent = time.perf_counter() - t0  # every sequence that asked waited for the whole call
        drafted: list[tuple[Sequence, list[int], object]] = []
        for seq in decoding:
            if seq.request_id in wants:
                seq.draft_seconds += spent
            prop = proposals.get(seq.request_id)
            if prop is not None and prop.position == seq.num_tokens and prop.tokens:
                drafted.append((seq, list(prop.tokens[: wants[seq.request_id]]), prop.probs))
        if drafted:
            # which drafts are worth their rows in this step (spec_decode.budget_drafts)
            # (a rate floored at ROW_COST: a sequence at rate 0 still gets its probe draft on a free row)
            rates = [max(ROW_COST, s.spec_acceptance if s.spec_acceptance >= 0 else INITIAL_ACCEPTANCE)
                     for s, _, _ in drafted]
            counts = budget_drafts(rates, [len(t) for _, t, _ in drafted], len(decoding), self.row_cost,
                                   self.scheduler.max_spec_rows, other_s=self._decode_other_s or 0.0)
            for (seq, tokens, probs), n in zip(drafted, counts):
                if n:
                    seq.draft_tokens = tokens[:n]
                    seq.draft_probs = probs
        self.stats.draft_seconds += time.perf_counter() - t0

    def _spec_k(self, seq: Sequence) -> int:
        rate = seq.spec_acceptance if seq.spec_acceptance >= 0 else INITIAL_ACCEPTANCE
        k = choose_k(rate, self.config.num_speculative_tokens, self.drafter.cost_per_token)
        if k == 0:
            seq.spec_idle_steps += 1
            if seq.spec_idle_steps >= PROBE_INTERVAL:
                seq.spec_idle_steps, k = 0, 1
        return k

    def _append_verified(self, seq: Sequence, tokens: list[int], lps: list) -> RequestOutput:
        """Append a speculating sequence's verified tokens one by one (a stop drops the rest),
        then roll its KV back to them: computed up to the last one, pages past it freed,
        only pages full of accepted tokens indexed."""
        drafted, accepted = len(seq.draft_tokens), len(tokens) - 1
        seq.draft_tokens, seq.draft_probs = [], None
        seq.num_drafted_tokens += drafted
        seq.num_accepted_tokens += accepted
        seq.num_spec_steps += 1
        rate = accepted / drafted
        prev = seq.spec_acceptance
        seq.spec_acceptance = rate if prev < 0 else (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * rate
        st = self.stats
        st.num_drafted_tokens += drafted
        st.num_accepted_tokens += accepted
        st.num_spec_steps += 1
        st.accepted_length_counts[accepted] = st.accepted_length_counts.get(accepted, 0) + 1
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        kept: list[int] = []
        reason: FinishReason | None = None
        for token in tokens:
            seq.token_ids.append(token)
            kept.append(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                break
        seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.truncate(seq, seq.num_computed_tokens)
        self.block_manager.index_computed_pages(seq)
        out_lps = [lp for lp in lps[: len(kept)] if lp is not None] or None
        if reason is not None:
            return self._finish(seq, reason, kept, out_lps)
        if self.drafter is not None and self.drafter.has(seq.request_id):
            self.drafter.commit(seq.request_id, kept)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=kept,
            new_text=seq.detok.take(False) if seq.detok is not None else "",
            logprobs=out_lps,
        )

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
                out = self._append_token(seq, first_token_id, first_logprob)
                if not out.finished and not seq.awaiting_kv:
                    self.scheduler.add(seq)
                outputs.append(out)
            elif kind == "kv":
                seq, kv, first_page = item
                if self._seqs.get(seq.request_id) is not seq or seq.finish_reason is not None:
                    continue  # finished at its first token, or aborted, meanwhile
                seq.awaiting_kv = False
                seq.imported_kv, seq.imported_first_page = kv, (first_page if kv is not None else 0)
                self.scheduler.add(seq)
            else:
                seq = self._seqs.get(item)
                if seq is not None:
                    outputs.append(self._finish(seq, "abort", []))
                else:  # a prefill that finished before its caller gave up: drop its copied pages
                    self._prefill_results.pop(item, None)
        return outputs

    def _close_import_gap(self, seq: Sequence) -> None:
        """An imported sequence whose held prefix had shrunk computed the pages up to its
        imported ones (Scheduler: ``import_gap``); once there, its imported pages go in."""
        if seq.num_computed_tokens >= seq.imported_first_page * self.block_manager.page_size:
            seq.import_from_page = seq.imported_first_page
            seq.num_computed_tokens = seq.num_tokens - 1
            self._write_imported_pages(seq)

    def _write_imported_pages(self, seq: Sequence) -> None:
        # Pages before import_from_page came from this pool's prefix cache or host tier, or
        # were computed here (same tokens, same model, so the same KV); they may be shared
        # and are left alone. imported_kv starts at page imported_first_page.
        end = self.block_manager.pages_for(seq.num_prompt_tokens)
        start, first = seq.import_from_page, seq.imported_first_page
        assert start >= first, f"{seq}: pages {first}..{start} were neither held nor imported"
        if start < end:
            ids = torch.tensor(seq.page_ids[start:end], dtype=torch.int64, device=self.device)
            scatter_pages(self.kv_pool.data, ids, seq.imported_kv[start - first : end - first].to(self.device))
        seq.imported_kv = None

    def _export_prompt_pages(self, seq: Sequence, first_token_id: int, lp: TokenLogprob | None) -> None:
        n = self.block_manager.pages_for(seq.num_prompt_tokens)
        ids = torch.tensor(seq.page_ids[seq.imported_first_page : n], dtype=torch.int64, device=self.device)
        self._prefill_results[seq.request_id] = PrefillResult(
            first_token_id=first_token_id, kv=gather_pages(self.kv_pool.data, ids), kv_scales=self._kv_scales(),
            num_cached_tokens=seq.num_cached_tokens, first_logprob=lp,
        )

    def _append_token(self, seq: Sequence, token: int, lp: TokenLogprob | None) -> RequestOutput:
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        reason = self._stop_reason(seq, token)
        lps = [lp] if lp is not None else None
        if reason is not None:
            return self._finish(seq, reason, [token], lps)
        if self.drafter is not None and self.drafter.has(seq.request_id):
            self.drafter.commit(seq.request_id, [token])
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[token],
            new_text=seq.detok.take(False) if seq.detok is not None else "",
            logprobs=lps,
        )

    @staticmethod
    def _stop_reason(seq: Sequence, token: int) -> FinishReason | None:
        """Why ``seq`` stops after its newly appended ``token``, if it does."""
        if token in seq.stop_token_ids:
            return "stop"
        if seq.detok is not None and seq.detok.add(token):
            return "stop"
        if seq.num_output_tokens >= seq.max_output_tokens:
            return "length"
        return None

    def _finish(
        self, seq: Sequence, reason: FinishReason, new_ids: list[int], lps: list[TokenLogprob] | None = None
    ) -> RequestOutput:
        if seq.is_prefill_only and new_ids and seq.page_ids:
            self._export_prompt_pages(seq, new_ids[0], lps[0] if lps else None)
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.close(seq.request_id)
        seq.finish_reason = reason
        self._seqs.pop(seq.request_id, None)
        with self._lock:
            self._live_ids.discard(seq.request_id)
            if seq.awaiting_kv:
                self._awaiting_kv.pop(seq.request_id, None)
        usage = self._usage(seq)
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

    @staticmethod
    def _usage(seq: Sequence) -> Usage:
        host = min(seq.num_loaded_tokens, seq.num_cached_tokens)
        return Usage(
            prompt_tokens=seq.num_prompt_tokens,
            cached_prompt_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            draft_tokens=seq.num_drafted_tokens,
            accepted_draft_tokens=seq.num_accepted_tokens,
            mean_accepted_length=(
                (seq.num_accepted_tokens + seq.num_spec_steps) / seq.num_spec_steps if seq.num_spec_steps else 0.0
            ),
            draft_seconds=round(seq.draft_seconds, 6),
            cached_tokens_device=seq.num_cached_tokens - host,
            cached_tokens_host=host,
        )

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
