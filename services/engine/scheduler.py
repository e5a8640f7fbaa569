"""Continuous batching: which sequences run in the next step, with how many tokens.

Policy, each step:
1. Decode: every running sequence that is decoding gets one token. If its
   next token needs a page and none is free, the most recently admitted
   running sequence is preempted (pages released, progress dropped, back to
   the front of the queue; it is recomputed later, mostly from the prefix
   cache). A sequence alone in a full pool finishes with ``length``.
2. Prefill, within ``max_prefill_tokens``: first the running sequences whose
   prompt is only partly computed (chunked prefill), then waiting sequences
   in arrival order while ``max_running_requests`` and the pool allow. A
   waiting sequence gets pages for its whole prompt on admission (cached
   prefix pages are shared, not copied), so prefill never runs out of pages
   halfway. At most ``chunked_prefill_size`` tokens of one prompt per step.
   A waiting sequence whose next uncached pages (>= ``defer_shared_tokens``)
   a running prompt is computing waits, first in line, until they are cached;
   those behind it may go ahead (see ``_waits_for_pending``).
3. With mixed batches off, a step that has prefill work runs only prefill.

Waiting sequences hold their cached prefixes (``BlockManager.hold``, held_pages.py): the pool
evicts every cached page nobody waits for before them, so a queue longer than the pool holds keeps
the prefixes of the requests that run next instead of losing each one just before its turn.

Priority (vLLM's priority policy; ``SamplingParams.priority``, lower first): waiting sequences are
kept in (priority, arrival) order, a preempted one going back first among its priority. Running
sequences are never preempted to admit a waiting one; when a step runs out of pages the victim is
the running sequence of the worst priority, the most recently admitted among equals (with equal
priorities, exactly the order described above).

Load-back (docs/hicache.md): a sequence admitted with pages a lower tier holds
may wait for their copies in ``loading`` (status LOADING): it holds its pages
and counts toward ``max_running_requests`` but is never scheduled nor
preempted; the other sequences keep stepping. Each step first takes the
sequences whose copies landed (``BlockManager.poll_loads``) into ``running``,
computed up to the pages that were loaded and verified.

Speculative decoding: a decoding sequence that carries drafted tokens gets
1 + k decode rows (its last token and the drafts), within ``max_spec_rows``
decode rows for the whole step (spec_decode.SPEC_MAX_ROWS, the packed kernel's
range; which drafts are worth their rows the engine has already decided with
spec_decode.budget_drafts). Drafts never preempt anyone: a sequence
whose drafts need a page that is not free runs its one plain row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences of one step: the first ``num_decode`` decode (one row each, 1 + k when speculating)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decode: int = 0
    preempted: list[Sequence] = field(default_factory=list)
    out_of_pages: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def is_verifying(self, i: int) -> bool:
        """Whether sequence ``i`` verifies drafts this step (a decode sequence with 1 + k rows)."""
        return i < self.num_decode and self.num_new_tokens[i] > 1


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_running_requests: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        enable_mixed_batches: bool = True,
        max_spec_rows: int = 0,
        defer_shared_tokens: int = 32,
    ):
        self.bm = block_manager
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_size = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.enable_mixed_batches = enable_mixed_batches
        self.max_spec_rows = max_spec_rows
        self.defer_shared_tokens = max(1, defer_shared_tokens)  # see _waits_for_pending
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.loading: list[Sequence] = []  # admitted, waiting for lower-tier copies into their pages
        self.num_preemptions = 0
        self.num_import_gaps = 0  # imported sequences whose held prefix had shrunk (recomputed here)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence of its priority or a better one."""
        seq.status = SequenceStatus.WAITING
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].params.priority > seq.params.priority:
            i -= 1
        self.waiting.insert(i, seq)
        self.bm.hold(seq)  # its cached prefix outlasts pages nobody waits for

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out (finished or aborted) and release its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq.status is SequenceStatus.LOADING:
            self.loading.remove(seq)
            self.bm.free(seq)  # its pages go back once the copy thread is done with them
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            self.bm.release_held(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.loading or self.bm.num_loading:  # (loads of removed sequences only free pages)
            self._take_loaded()
        has_prefill_work = bool(self.waiting) or any(not s.is_decoding for s in self.running)
        if self.enable_mixed_batches or not has_prefill_work:
            self._schedule_decode(batch)
        self._schedule_prefill(batch)
        if not batch.seqs and not self.enable_mixed_batches and self.running:
            self._schedule_decode(batch)  # prefill work was blocked: keep decoding
        return batch

    def _take_loaded(self) -> None:
        """Sequences whose lower-tier pages landed run from now on (newest admitted)."""
        for seq in self.bm.poll_loads():
            self.loading.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if not seq.is_admitted_once:
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                seq.is_admitted_once = True
            self.running.append(seq)

    def _schedule_decode(self, batch: ScheduledBatch) -> None:
        spare_rows = self.max_spec_rows - sum(1 for s in self.running if s.is_decoding)
        for seq in list(self.running):  # admission order; victims come from the end
            if seq.status is not SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            if self._make_room(seq, batch):
                k = self._num_drafts(seq, spare_rows)
                spare_rows -= k
                self.bm.grow(seq, seq.num_tokens + k)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(1 + k)
        batch.num_decode = len(batch.seqs)

    def _num_drafts(self, seq: Sequence, spare_rows: int) -> int:
        """Drafted tokens ``seq`` verifies this step (``seq.draft_tokens`` is cut to it)."""
        k = min(len(seq.draft_tokens), spare_rows, seq.max_output_tokens - seq.num_output_tokens - 1)
        while k > 0 and not self.bm.can_grow(seq, seq.num_tokens + k):
            k -= 1
        k = max(k, 0)
        del seq.draft_tokens[k:]
        if k == 0:
            seq.draft_probs = None
        return k

    def _make_room(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Free pages for ``seq``'s next token by preempting newer sequences."""
        while not self.bm.can_grow(seq, seq.num_tokens):
            # the worst priority, the newest among equals (max keeps the first of equals it meets)
            victim = max(reversed(self.running), key=lambda s: s.params.priority)
            if victim is seq:
                if len(self.running) == 1 and self.loading:
                    pass  # a loading sequence holds pages: it runs (and can be preempted) once loaded
                elif len(self.running) == 1:
                    batch.out_of_pages.append(seq)
                else:
                    self._preempt(seq, batch)
                return False
            self._preempt(victim, batch)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        # With equal priorities victims are newer than every sequence already in the batch; a worse
        # priority may be one the batch already holds: it leaves the batch.
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_new_tokens[i]
        self.running.remove(seq)
        self.bm.free(seq)
        seq.draft_tokens, seq.draft_probs = [], None
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        i = 0  # first among its priority
        while i < len(self.waiting) and self.waiting[i].params.priority < seq.params.priority:
            i += 1
        self.waiting.insert(i, seq)
        self.bm.hold(seq, first=True)  # it runs again first: its pages go last
        batch.preempted.append(seq)

    def _prefill_chunk(self, remaining: int, budget: int, is_first: bool) -> int:
        if self.chunk_size is None:
            # No chunking: a prompt runs whole, alone if it exceeds the budget.
            return remaining if remaining <= budget or is_first else 0
        return min(remaining, self.chunk_size, budget)

    def _schedule_prefill(self, batch: ScheduledBatch) -> None:
        budget = self.max_prefill_tokens
        is_first = True
        for seq in self.running:
            if seq.is_decoding or seq in batch.out_of_pages:
                continue
            n = self._prefill_chunk(self._uncomputed(seq), budget, is_first)
            if n <= 0:
                return
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            is_first = False
        if batch.out_of_pages:
            return
        pending = self._pending_pages() if self.waiting and self.bm.enable_prefix_caching else set()
        deferred: list[Sequence] = []
        while self.waiting and len(self.running) + len(self.loading) < self.max_running_requests and budget > 0:
            seq = self.waiting[0]
            if pending and self._waits_for_pending(seq, pending):
                deferred.append(self.waiting.popleft())
                continue
            if not self.bm.can_allocate(seq, reserve=self._reserve()):
                break
            if self.chunk_size is None and not is_first and seq.num_uncomputed_tokens > budget:
                break  # would not fit this step; admit it next step
            self.waiting.popleft()
            # Loading asynchronously pays when something else can step meanwhile.
            self.bm.allocate(seq, may_wait=seq.imported_kv is None and bool(self.running or self.waiting))
            if seq.loading_ticket is not None:
                seq.status = SequenceStatus.LOADING
                self.loading.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            if not seq.is_admitted_once:
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                seq.is_admitted_once = True
            if seq.imported_kv is not None:
                # Prompt KV computed elsewhere: the engine writes the pages the prefix
                # cache did not cover before this step's forward; only the first
                # generated token is left to compute. When pages before the imported
                # ones left this pool since the worker counted them, those are
                # computed first (chunks capped by _uncomputed) and the engine writes
                # the imported pages when they are done (KVHandoff.close_gap).
                have = seq.num_computed_tokens // self.bm.page_size
                if have >= seq.imported_first_page:
                    seq.import_from_page = have
                    seq.num_computed_tokens = seq.num_tokens - 1
                else:
                    self.num_import_gaps += 1
            self.running.append(seq)
            if self.bm.enable_prefix_caching:
                pending.update(self._uncomputed_page_hashes(seq))
            n = self._prefill_chunk(self._uncomputed(seq), budget, is_first)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
            is_first = False
        self.waiting.extendleft(reversed(deferred))  # first in line again next step

    # ---- prompts that share a prefix being computed ---------------------------------------------
    # A waiting prompt whose next uncached pages some running prompt is computing right now (the
    # same system prompt, four conversations arriving at once) is not admitted this step: next
    # step those pages are in the prefix cache and it computes only what is its own. Admitting it
    # would compute the shared pages twice, in the same step. Prompts behind it are admitted past
    # it, and it goes first again at the next step (SGLang deprioritizes such requests alike).

    def _uncomputed_page_hashes(self, seq: Sequence) -> list[int]:
        """Hashes of the full prompt pages ``seq`` has yet to compute."""
        hashes = self.bm.update_hashes(seq)
        return hashes[seq.num_computed_tokens // self.bm.page_size : seq.num_prompt_tokens // self.bm.page_size]

    def _pending_pages(self) -> set[int]:
        pending: set[int] = set()
        for seq in self.running:
            if not seq.is_decoding:
                pending.update(self._uncomputed_page_hashes(seq))
        return pending

    def _waits_for_pending(self, seq: Sequence, pending: set[int]) -> bool:
        """Whether at least ``defer_shared_tokens`` of ``seq``'s next uncached tokens are pages
        in ``pending``."""
        first = self.bm.num_matched_pages(seq)
        hashes = seq.page_hashes  # extended by num_matched_pages
        want = -(-self.defer_shared_tokens // self.bm.page_size)
        run = 0
        while run < want and first + run < len(hashes) and hashes[first + run] in pending:
            run += 1
        return run >= want

    def _uncomputed(self, seq: Sequence) -> int:
        """Tokens ``seq`` still has to compute; an imported sequence filling a gap before its
        imported pages stops at them."""
        if seq.imported_kv is not None:
            gap_end = seq.imported_first_page * self.bm.page_size
            if seq.num_computed_tokens < gap_end:
                return gap_end - seq.num_computed_tokens
        return seq.num_uncomputed_tokens

    def _reserve(self) -> int:
        # Headroom so admitting a prompt does not immediately force a
        # preemption when running sequences cross a page boundary.
        return min(len(self.running), max(1, self.bm.num_pages // 64)) if self.running else 0
