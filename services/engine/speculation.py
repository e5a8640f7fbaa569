"""Speculative decoding on the engine's side: who drafts, how many tokens, and what verification taught.

The :class:`Speculator` owns the drafter (``services/draft``) and every decision about drafts
(docs/speculative.md):

* per sequence, k from its moving-average acceptance (``spec_decode.choose_k``), with a
  one-token probe every ``PROBE_INTERVAL`` idle steps so a rate that dropped can recover;
* per step, which drafts are worth their verification rows (``spec_decode.budget_drafts``)
  against this machine's measured :class:`~services.engine.spec_decode.RowCost` and the moving
  average of what a decode step costs beside its projections.

Drafts of a request under a grammar are cut at the first token the grammar forbids (its matcher
validates them without moving); verification then sees each row masked for the drafts before it
(the logits-processor chain), so a draft the target would not produce under the grammar is rejected.

The engine calls it at three points of a step: :meth:`draft` before scheduling, :meth:`verified`
for each sequence whose drafts the model runner verified (``spec_decode.verify``), and
:meth:`observe_step` after the step; :meth:`commit` and :meth:`close` keep the drafter's streams
in step with the tokens appended. With no drafter every call returns at once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from kernels.sampling import GREEDY_EPS
from services.engine.outputs import EngineStats
from services.engine.scheduler import ScheduledBatch
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

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, drafter, *, max_k: int, greedy_only: bool, stats: EngineStats,
                 projection_seconds: Callable[[int], float], core_lease=None):
        self.drafter = None
        self.max_k = max_k
        """Most tokens drafted per sequence and step (EngineConfig.num_speculative_tokens)."""
        self.greedy_only = greedy_only
        """Draft for greedy requests only (EngineConfig.speculative_greedy_only)."""
        self.stats = stats
        self.projection_seconds = projection_seconds  # LlamaModel.projection_seconds: what RowCost times
        self.core_lease = core_lease
        self.row_cost: RowCost | None = None
        self.decode_other_s: float | None = None
        """Moving average of a decode-only step's time beside its projections (the budget's other_s)."""
        self.set_drafter(drafter)

    @property
    def max_rows(self) -> int:
        """Decode rows a step may use with drafts (the scheduler's ``max_spec_rows``; 0: off)."""
        return SPEC_MAX_ROWS if self.drafter is not None else 0

    def set_drafter(self, drafter) -> None:
        """Use ``drafter`` (a services.draft.base.Drafter); None turns speculation off."""
        self.drafter = drafter
        if drafter is not None and self.row_cost is None:
            self.row_cost = self.measure_row_cost()

    def measure_row_cost(self) -> RowCost:
        """How a decode step's projection time grows with its rows, timed on this machine (~0.3 s
        for the default model): what the draft budget weighs drafts against. Engines that share
        the host's cores time it holding the core lease, so they do not skew each other's."""
        with self.core_lease if self.core_lease is not None else contextlib.nullcontext():
            cost = RowCost.measure(self.projection_seconds)
        log.info("speculation: projections read in %.1f ms a step and cost %.2f ms a row computed (~%d rows free)",
                 cost.memory_s * 1e3, cost.row_s * 1e3, int(cost.memory_s / cost.row_s) if cost.row_s > 0 else 0)
        return cost

    # ---- before scheduling -----------------------------------------------------------------

    def draft(self, running: list[Sequence], max_rows: int) -> None:
        """Set ``draft_tokens`` (and ``draft_probs``) of every decoding sequence in ``running``:
        the drafter's proposal, k chosen per sequence, cut to what the step's row budget grants
        (at most ``max_rows`` decode rows, the scheduler's; it may cut them further)."""
        if self.drafter is None:
            return
        t0 = time.perf_counter()
        decoding = [s for s in running if s.is_decoding]
        for seq in decoding:
            seq.draft_tokens, seq.draft_probs = [], None
        if len(decoding) >= max_rows:
            return  # no room for a draft within SPEC_MAX_ROWS (the packed kernel's range)
        wants = self._wants(decoding)
        if not wants:
            return
        proposals = self.drafter.propose_many(wants)
        spent = time.perf_counter() - t0  # every sequence that asked waited for the whole call
        drafted: list[tuple[Sequence, list[int], object]] = []
        for seq in decoding:
            if seq.request_id in wants:
                seq.draft_seconds += spent
            prop = proposals.get(seq.request_id)
            if prop is not None and prop.position == seq.num_tokens and prop.tokens:
                tokens = list(prop.tokens[: wants[seq.request_id]])
                if seq.logits_state is not None:  # a grammar's request: cut at the first token it forbids
                    del tokens[seq.logits_state.num_allowed_drafts(seq, tokens):]
                if tokens:
                    drafted.append((seq, tokens, prop.probs))
        if drafted:
            # which drafts are worth their rows in this step (spec_decode.budget_drafts)
            # (a rate floored at ROW_COST: a sequence at rate 0 still gets its probe draft on a free row)
            rates = [max(ROW_COST, _rate(s)) for s, _, _ in drafted]
            counts = budget_drafts(rates, [len(t) for _, t, _ in drafted], len(decoding), self.row_cost,
                                   max_rows, other_s=self.decode_other_s or 0.0)
            for (seq, tokens, probs), n in zip(drafted, counts):
                if n:
                    seq.draft_tokens = tokens[:n]
                    seq.draft_probs = probs
        self.stats.draft_seconds += time.perf_counter() - t0

    def _wants(self, decoding: list[Sequence]) -> dict[str, int]:
        """How many tokens to ask the drafter for, by request (opening the streams it lacks)."""
        wants: dict[str, int] = {}
        for seq in decoding:
            if self.greedy_only and seq.params.temperature >= GREEDY_EPS:  # the sampler's own greedy test
                continue  # sampled: plain decoding (its seeded draws stay those of plain sampling)
            k = self.k_for(seq)
            if k:
                if not self.drafter.has(seq.request_id):
                    self.drafter.open(seq.request_id, seq.token_ids)
                wants[seq.request_id] = k
        return wants

    def k_for(self, seq: Sequence) -> int:
        """Drafts worth asking for ``seq`` at its acceptance rate (adaptive k, with probes)."""
        k = choose_k(_rate(seq), self.max_k, self.drafter.cost_per_token)
        if k == 0:
            seq.spec_idle_steps += 1
            if seq.spec_idle_steps >= PROBE_INTERVAL:
                seq.spec_idle_steps, k = 0, 1
        return k

    # ---- after the forward pass --------------------------------------------------------------

    def verified(self, seq: Sequence, num_accepted: int) -> None:
        """``seq``'s drafts were verified and ``num_accepted`` of them accepted: its acceptance
        average and the counters learn it, and its drafts are spent."""
        drafted = len(seq.draft_tokens)
        seq.draft_tokens, seq.draft_probs = [], None
        seq.num_drafted_tokens += drafted
        seq.num_accepted_tokens += num_accepted
        seq.num_spec_steps += 1
        rate = num_accepted / drafted
        prev = seq.spec_acceptance
        seq.spec_acceptance = rate if prev < 0 else (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * rate
        st = self.stats
        st.num_drafted_tokens += drafted
        st.num_accepted_tokens += num_accepted
        st.num_spec_steps += 1
        st.accepted_length_counts[num_accepted] = st.accepted_length_counts.get(num_accepted, 0) + 1

    def observe_step(self, batch: ScheduledBatch, step_s: float) -> None:
        """A step of ``step_s`` seconds ran ``batch``: a decode-only one teaches what a step costs
        beside its projections (attention, norms, sampling); the draft budget divides a step's
        tokens by its whole time."""
        if self.row_cost is None or batch.num_decode != len(batch.seqs):
            return
        other = max(0.0, step_s - self.row_cost.seconds(batch.num_tokens))
        prev = self.decode_other_s
        self.decode_other_s = other if prev is None else (1 - EMA_WEIGHT) * prev + EMA_WEIGHT * other

    def commit(self, seq: Sequence, tokens: list[int]) -> None:
        """``tokens`` were appended to ``seq`` (it goes on): the drafter's stream follows."""
        if self.drafter is not None and self.drafter.has(seq.request_id):
            self.drafter.commit(seq.request_id, tokens)

    def close(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.close(request_id)


def _rate(seq: Sequence) -> float:
    """``seq``'s moving-average acceptance rate (INITIAL_ACCEPTANCE before its first verification)."""
    return seq.spec_acceptance if seq.spec_acceptance >= 0 else INITIAL_ACCEPTANCE
