"""Disaggregation on the engine's side: prompt pages handed from a prefill engine to a decode engine.

Two kinds of requests cross (docs/disaggregation.md):

* prefill-only (a prefill worker's): it finishes with its first token; its prompt pages from
  ``imported_first_page`` on (the receiver holds the ones before) are copied out
  (:meth:`KVHandoff.export`) and kept as a :class:`PrefillResult` until taken;
* imported (a decode worker's): its first token was sampled elsewhere and its prompt's pages
  arrive with it or later (:meth:`KVHandoff.pages_arrived`). The pages the prefix cache or host
  tier still covers are kept; the imported ones after them are written into the request's pages
  before the step that computes its first generated token (:meth:`KVHandoff.write_imported`).
  If pages before the imported ones left this pool since the worker counted them (an *import
  gap*), the scheduler computes those first and the imported pages go in once they are done
  (:meth:`KVHandoff.close_gap`).

Every check of what crosses (page range, first token, KV shape, dtype and fp8 scales) is here
and raises RequestError. The entry points (``add_prefill_request``, ``add_prefilled_request``,
``import_kv``; the engine's methods of those names call them) run on the caller's thread and
only enqueue into the engine's mailbox; this class keeps the state between them and the steps:
the prefill results waiting to be taken and the imported requests waiting for their pages
(:attr:`awaiting`, guarded by its own lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence as Seq

import torch

from kernels import gather_pages, scatter_pages
from schemas.engine import SamplingParams, TokenLogprob
from services.engine.block_manager import BlockManager
from services.engine.intake import RequestIntake
from services.engine.kv_pool import KVPool
from services.engine.outputs import PrefillResult, RequestError
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)


class KVHandoff:
    def __init__(self, kv_pool: KVPool, block_manager: BlockManager, intake: RequestIntake,
                 enqueue: Callable[[tuple[str, object]], None], vocab_size: int, device: torch.device):
        self.kv_pool = kv_pool
        self.bm = block_manager
        self.intake = intake
        self.enqueue = enqueue  # the engine's mailbox
        self.vocab_size = vocab_size
        self.device = device
        self.results: dict[str, PrefillResult] = {}  # finished prefill-only requests, until taken
        self.awaiting: dict[str, Sequence] = {}  # imported requests whose pages are on their way
        self._lock = threading.Lock()

    # ---- requests in (caller's thread) -------------------------------------------------------

    def add_prefill_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                            *, skip_pages: int = 0) -> None:
        """Compute only the prompt's KV and first token (a prefill worker's job).

        The request finishes with its first token; its prompt pages from ``skip_pages`` on are
        copied out (:meth:`take_result`; the receiver holds the ones before) and all are
        released to the prefix cache."""
        seq = self.intake.new_sequence(request_id, prompt, params or SamplingParams(), with_text=False)
        self.intake.checked(seq, self.check_skip_pages, seq, skip_pages)
        seq.imported_first_page = skip_pages
        seq.is_prefill_only = True
        seq.max_output_tokens = 1
        self.enqueue(("add", seq))

    def add_prefilled_request(self, request_id: str, prompt_token_ids: Seq[int], first_token_id: int,
                              kv: torch.Tensor | None, params: SamplingParams | None = None, *,
                              num_cached_tokens: int = 0, first_logprob: TokenLogprob | None = None,
                              kv_scales: Seq[float] = (), kv_first_page: int = 0) -> None:
        """Continue a request prefilled elsewhere: ``kv`` holds its prompt's pages from
        ``kv_first_page`` on (``[pages, layers, 2, page_size, Hkv, D]``, as :meth:`export` makes
        them) and ``first_token_id`` its first generated token, which is streamed first.

        ``kv=None``: the pages are still on their way. The first token streams now; the request
        waits outside the scheduler (holding no pages) until :meth:`import_kv` hands them over,
        or says they will not come, and then it computes its prompt here.

        The pages before ``kv_first_page`` are expected in this engine's prefix cache or
        host tier (the caller counted them when it asked for the prefill); any that left
        meanwhile are recomputed here before the imported ones are written."""
        seq = self.intake.new_sequence(request_id, prompt_token_ids, params or SamplingParams())
        self.intake.checked(seq, self._check_import, seq, first_token_id, kv, kv_scales, kv_first_page)
        seq.imported_first_page = kv_first_page
        seq.imported_kv = kv
        seq.awaiting_kv = kv is None
        seq.num_cached_tokens = num_cached_tokens
        seq.is_admitted_once = True
        if kv is None:
            with self._lock:
                self.awaiting[request_id] = seq
        self.enqueue(("import", (seq, first_token_id, first_logprob)))

    def import_kv(self, request_id: str, kv: torch.Tensor | None, kv_scales: Seq[float] = (),
                  kv_first_page: int | None = None) -> bool:
        """The pages of a request added with ``kv=None`` arrived (``kv_first_page``: where they
        start, if not where the request said). ``kv=None``, or pages that do not fit: they will
        not come, and the request computes its prompt (and first token) here, as after a
        preemption. False when the request is gone (finished at its first token, or aborted)."""
        with self._lock:
            seq = self.awaiting.pop(request_id, None)
        if seq is None:
            return False
        first_page = seq.imported_first_page if kv_first_page is None else kv_first_page
        if kv is not None:
            try:
                self.check_skip_pages(seq, first_page)
                self.check_kv(seq, kv, kv_scales, first_page)
            except RequestError as exc:
                log.warning("pages for %s do not fit (%s): computing its prompt here", request_id, exc)
                kv = None
        self.enqueue(("kv", (seq, kv, first_page)))
        return True

    def take_result(self, request_id: str) -> PrefillResult | None:
        """The exported pages of a finished prefill-only request (once)."""
        return self.results.pop(request_id, None)

    # ---- checks ----------------------------------------------------------------------------------

    def check_skip_pages(self, seq: Sequence, skip_pages: int) -> None:
        # The page holding the last prompt token is always computed (its logits give the first
        # token), so at most the full pages before it can be skipped.
        limit = (seq.num_prompt_tokens - 1) // self.bm.page_size
        if not (isinstance(skip_pages, int) and 0 <= skip_pages <= limit):
            raise RequestError(f"skip_pages must be in [0, {limit}] for a {seq.num_prompt_tokens}-token prompt "
                               f"(pages of {self.bm.page_size} tokens), got {skip_pages}")

    def _check_import(self, seq: Sequence, first_token_id: int, kv, kv_scales: Seq[float], first_page: int) -> None:
        self.check_skip_pages(seq, first_page)
        if not 0 <= first_token_id < self.vocab_size:
            raise RequestError(f"first_token_id must be in [0, {self.vocab_size})")
        if kv is not None:
            self.check_kv(seq, kv, kv_scales, first_page)

    def check_kv(self, seq: Sequence, kv, kv_scales: Seq[float], first_page: int) -> None:
        pool = self.kv_pool
        num_pages = self.bm.pages_for(seq.num_prompt_tokens) - first_page
        want = (num_pages, *pool.data.shape[1:])
        if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != want:
            raise RequestError(f"prefilled KV must be {list(want)}, got {list(getattr(kv, 'shape', []))}")
        if kv.dtype != pool.dtype:
            raise RequestError(f"prefilled KV is {kv.dtype}, this pool holds {pool.dtype}")
        if list(kv_scales) != self.kv_scales():
            raise RequestError(f"prefilled KV scales {list(kv_scales)} differ from this pool's {self.kv_scales()}")

    def kv_scales(self) -> list[float]:
        pool = self.kv_pool
        return [float(pool.k_scale), float(pool.v_scale)] if pool.is_fp8 else []

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished (or was aborted), maybe while its pages were on their way."""
        if seq.awaiting_kv:
            with self._lock:
                self.awaiting.pop(seq.request_id, None)

    # ---- on the engine thread ---------------------------------------------------------------

    def pages_arrived(self, seq: Sequence, kv: torch.Tensor | None, first_page: int) -> None:
        """``seq``'s pages came (``kv=None``: they will not; it computes its prompt here)."""
        seq.awaiting_kv = False
        seq.imported_kv, seq.imported_first_page = kv, (first_page if kv is not None else 0)

    def write_imported(self, batch: ScheduledBatch) -> None:
        """Before the forward pass: the imported pages of the prompts about to compute their first
        generated token go into their pages."""
        for seq in batch.seqs[batch.num_decode :]:
            if seq.imported_kv is not None and seq.num_computed_tokens == seq.num_tokens - 1:
                self._write_pages(seq)

    def close_gap(self, seq: Sequence) -> None:
        """After a step that computed part of an import gap (Scheduler: ``import_gap``): once the
        computed pages reach the imported ones, those go in and only the first token is left."""
        if seq.num_computed_tokens >= seq.imported_first_page * self.bm.page_size:
            seq.import_from_page = seq.imported_first_page
            seq.num_computed_tokens = seq.num_tokens - 1
            self._write_pages(seq)

    def _write_pages(self, seq: Sequence) -> None:
        # Pages before import_from_page came from this pool's prefix cache or host tier, or
        # were computed here (same tokens, same model, so the same KV); they may be shared
        # and are left alone. imported_kv starts at page imported_first_page.
        end = self.bm.pages_for(seq.num_prompt_tokens)
        start, first = seq.import_from_page, seq.imported_first_page
        assert start >= first, f"{seq}: pages {first}..{start} were neither held nor imported"
        if start < end:
            ids = torch.tensor(seq.page_ids[start:end], dtype=torch.int64, device=self.device)
            scatter_pages(self.kv_pool.data, ids, seq.imported_kv[start - first : end - first].to(self.device))
        seq.imported_kv = None

    def export(self, seq: Sequence, first_token_id: int, lp: TokenLogprob | None) -> None:
        """A prefill-only ``seq`` sampled its first token: copy its prompt pages out."""
        n = self.bm.pages_for(seq.num_prompt_tokens)
        ids = torch.tensor(seq.page_ids[seq.imported_first_page : n], dtype=torch.int64, device=self.device)
        self.results[seq.request_id] = PrefillResult(
            first_token_id=first_token_id, kv=gather_pages(self.kv_pool.data, ids), kv_scales=self.kv_scales(),
            num_cached_tokens=seq.num_cached_tokens, first_logprob=lp,
        )
