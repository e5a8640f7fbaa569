"""The chain the model runner applies between the forward pass and sampling (or verification).

Per step, for the rows of the sequences that ask for something (``LogitsRows``; a verifying sequence
owns 1 + k rows, row j scoring the token after its first j drafts):

1. :meth:`LogitsProcessors.start`, before the forward pass: each constrained sequence's matcher is
   brought up to date and the grammar masks of its rows are filled on the mask thread (llguidance
   computes them without the GIL) while the engine thread runs the model. A *deferred* row gets no
   mask now (below);
2. :meth:`LogitsProcessors.apply`, on the logits: penalties (repetition, frequency, presence, on
   the tokens of each row's context only; row j of a verifying sequence counts its first j drafts as
   output), then ``logit_bias``, then ``min_tokens`` (EOS and stop ids at -inf while the row's output
   index is below it; folded into the grammar's mask where there is one), then the grammar masks.
   One gather/scatter per kind over all its rows;
3. :meth:`LogitsProcessors.redraw_refused`, after sampling: a deferred row's token, drawn without
   the mask, stands when the grammar allows it; a refused one is drawn again from the row with its
   mask, filled then on the engine thread;
4. :meth:`LogitsProcessors.accepted`: the matchers take the tokens to append, so a token the
   grammar cannot accept fails its request before it is streamed.

Deferred rows are a constrained sequence's single row (no drafts, no min_tokens hold) whose sampler
is argmax or temperature alone (no top-k, top-p, min-p). For those, drawing from the unmasked row
and drawing again from the masked one when the grammar refuses the token is exactly drawing from
the masked row: with p the row's distribution and A the tokens the grammar allows, token a in A comes
out with probability p(a) + (1 - p(A)) * p(a) / p(A) = p(a) / p(A) (for argmax: the masked argmax is
the argmax whenever the grammar allows it). The second draw is independent of the first (a seeded
request draws it at its own offset). A truncating sampler is not deferred: its kept set depends on
the mask. Most steps need no mask then (inside a JSON string, nearly every token fits); on few cores
the mask thread otherwise slows the forward pass it overlaps by about what it computes.

A request whose grammar fails (it did not compile, a limit was hit, a token does not fit) fails
alone: its rows are left as they came and the runner reports it as that request's error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from services.engine.logits_processors.penalties import add_tokens, apply_penalties
from services.engine.logits_processors.structured import apply_bitmask, clear_tokens, fill_row_masks
from services.engine.sampling import sample_tokens

log = logging.getLogger(__name__)

REDRAW_OFFSET = 1 << 30
"""Added to a seeded row's output index for its second draw, so that draw is independent of the first
(the Triton sampler keys its noise by offset << 32: this stays inside int64)."""


@dataclass
class PendingMasks:
    """Grammar masks of one step being filled: mask row i is logits row ``rows[i]``."""

    rows: list[int] = field(default_factory=list)
    future: concurrent.futures.Future | None = None
    deferred: list[tuple[int, object, int]] = field(default_factory=list)
    """(sequence index, matcher, logits row) of deferred rows: masked only when the grammar refuses the
    token drawn without the mask (:meth:`LogitsProcessors.redraw_refused`)."""
    bitmask: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)  # by sequence index (LogitsRows.seqs)


class LogitsProcessors:
    def __init__(self, vocab_size: int, device: torch.device, *, overlap: bool = True, defer_masks: bool = True):
        self.vocab_size = vocab_size
        self.device = device
        self.overlap = overlap
        """Fill grammar masks on the mask thread during the forward pass (else after it, inline)."""
        self.defer_masks = defer_masks
        """A deferred row (argmax or temperature-only sampling, one row, no min_tokens hold) gets its
        mask only when the grammar refuses the token drawn without it (False: every row is masked)."""
        self.num_deferred_checked = 0
        self.num_deferred_redrawn = 0
        """Deferred rows whose token was checked against the grammar, and those it refused (then
        masked and drawn again)."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.mask_wait_seconds = 0.0
        """Time the engine thread waited for masks after the forward pass (the overlap's remainder)."""
        self.seconds = 0.0
        """Time the engine thread spent in the chain (start, apply, accepted; the mask wait included)."""

    # ---- before the forward pass ----------------------------------------------------------------

    def start(self, rows) -> PendingMasks | None:
        """Bring the constrained sequences' matchers up to date and start filling their rows' masks.
        None when no row asks for anything of the chain."""
        if not any(s.logits_state is not None for s in rows.seqs):
            return None
        t0 = time.perf_counter()
        pending = PendingMasks()
        plain, verifying, min_rows, min_ids = [], [], [], []
        for i, (seq, start, count) in enumerate(zip(rows.seqs, rows.starts, rows.counts)):
            state = seq.logits_state
            if state is None or state.grammar is None:
                continue
            matcher = state.matcher(seq)
            if matcher is None:
                pending.errors[i] = state.error
                continue
            holding = bool(state.min_tokens) and seq.num_output_tokens < state.min_tokens
            if count == 1 and state.deferrable and self.defer_masks and not holding:
                pending.deferred.append((i, matcher, start))
                continue
            first = len(pending.rows)
            if count == 1:
                plain.append((matcher, first))
            else:
                verifying.append((matcher, first, list(seq.draft_tokens[: count - 1])))
            for j in range(count):
                if state.min_tokens and seq.num_output_tokens + j < state.min_tokens:
                    min_rows.append(first + j)
                    min_ids.append(state.stop_token_ids)
            pending.rows.extend(range(start, start + count))
        if pending.rows:
            job = (plain, verifying, len(pending.rows), self.vocab_size, min_rows, min_ids)
            if self.overlap:
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvbus-masks")
                pending.future = self._pool.submit(_fill, *job)
            else:
                pending.bitmask = _fill(*job)
        self.seconds += time.perf_counter() - t0
        return pending

    # ---- on the logits ------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, rows, pending: PendingMasks | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, str]]:
        """(the processed logits, the raw ones when a processed row wants logprobs else None, errors by
        sequence index). ``logits`` [N, V] is changed in place unless raw logits are kept."""
        if pending is None:
            return logits, None, {}
        t_apply = time.perf_counter()
        logits = logits.contiguous()  # (the kinds below index the flat logits; the model's are contiguous)
        errors = dict(pending.errors)
        work = [i for i, s in enumerate(rows.seqs) if s.logits_state is not None and i not in errors]
        raw = None
        if any(rows.seqs[i].logits_state.wants_logprobs for i in work):
            raw, logits = logits, logits.clone()  # logprobs are the raw model's (kernels.compute_logprobs)
        self._penalise(logits, rows, [i for i in work if rows.seqs[i].logits_state.has_penalties])
        self._bias(logits, rows, [i for i in work if rows.seqs[i].logits_state.bias_ids is not None])
        self._ban_stops(logits, rows, [i for i in work if rows.seqs[i].logits_state.grammar is None])
        if pending.future is not None:
            t0 = time.perf_counter()
            try:
                pending.bitmask = pending.future.result()
            except Exception:  # llguidance failed for the batch: each constrained request fails alone
                log.exception("filling grammar masks failed")
                for i, s in enumerate(rows.seqs):
                    if s.logits_state is not None and s.logits_state.grammar is not None and i not in errors:
                        errors[i] = "structured output: computing the grammar's mask failed"
                pending.rows = []
            self.mask_wait_seconds += time.perf_counter() - t0
        if pending.rows:
            for i, s in enumerate(rows.seqs):
                if s.logits_state and s.logits_state.grammar:
                    _note_mask_error(i, s, s.logits_state.grammar.matcher, errors)
            apply_bitmask(logits, pending.bitmask, pending.rows)
        self.seconds += time.perf_counter() - t_apply
        return logits, raw, errors

    def _penalise(self, logits: torch.Tensor, rows, seq_indexes: list[int]) -> None:
        """Every penalised row's context pairs, gathered, penalised and scattered back at once (row j of
        a verifying sequence counts its first j drafts as output)."""
        if not seq_indexes:
            return
        row_ids, ids, counts, params = [], [], [], []
        for i in seq_indexes:
            seq = rows.seqs[i]
            st = seq.logits_state
            base_ids, base_counts = st.context(seq)
            for j in range(rows.counts[i]):
                row_ids_j, counts_j = (base_ids, base_counts) if j == 0 else \
                    add_tokens(base_ids, base_counts.copy(), seq.draft_tokens[:j])
                ids.append(row_ids_j)
                counts.append(counts_j)
                row_ids.append(rows.starts[i] + j)
                params.append((st.repetition, st.frequency, st.presence))
        sizes = [len(x) for x in ids]
        per_pair = np.repeat(np.asarray(params, dtype=np.float32), sizes, axis=0)  # [pairs, 3]
        uses_repetition = any(p[0] != 1.0 for p in params)
        apply_penalties(logits, np.repeat(np.asarray(row_ids, dtype=np.int64), sizes), np.concatenate(ids),
                        np.concatenate(counts), np.ascontiguousarray(per_pair[:, 0]) if uses_repetition else None,
                        np.ascontiguousarray(per_pair[:, 1]), np.ascontiguousarray(per_pair[:, 2]))

    def _bias(self, logits: torch.Tensor, rows, seq_indexes: list[int]) -> None:
        if not seq_indexes:
            return
        flat, v = [], []
        vocab = logits.shape[1]
        for i in seq_indexes:
            st, start, count = rows.seqs[i].logits_state, rows.starts[i], rows.counts[i]
            flat.append((torch.arange(start, start + count) * vocab).repeat_interleave(len(st.bias_ids))
                        + st.bias_ids.repeat(count))
            v.append(st.bias_values.repeat(count))
        dev = logits.device  # (ids are distinct within a row: no two values land on one logit)
        logits.view(-1).index_add_(0, torch.cat(flat).to(dev), torch.cat(v).to(dev, logits.dtype))

    def _ban_stops(self, logits: torch.Tensor, rows, seq_indexes: list[int]) -> None:
        """min_tokens for rows without a grammar (with one it is folded into the mask: ``_fill``)."""
        r, t = [], []
        for i in seq_indexes:
            seq = rows.seqs[i]
            st = seq.logits_state
            for j in range(rows.counts[i]):
                if seq.num_output_tokens + j < st.min_tokens:
                    r.extend([rows.starts[i] + j] * len(st.stop_token_ids))
                    t.extend(st.stop_token_ids)
        if r:
            flat = torch.tensor(r, dtype=torch.int64) * logits.shape[1] + torch.tensor(t, dtype=torch.int64)
            logits.view(-1).index_fill_(0, flat.to(logits.device), float("-inf"))

    # ---- after sampling -----------------------------------------------------------------------------

    def redraw_refused(self, logits: torch.Tensor, rows, pending: PendingMasks | None, tokens: list[list[int]],
                       logprobs: list, errors: dict[int, str], raw: torch.Tensor | None) -> None:
        """Deferred rows: a token the grammar allows stands; a refused one is drawn again from the row
        with the grammar's mask (filled now, on the engine thread), at its own seeded offset.
        ``tokens`` and ``logprobs`` (by sequence index) change in place."""
        if pending is None or not pending.deferred:
            return
        t0 = time.perf_counter()
        drawn = [(i, m, row) for i, m, row in pending.deferred if i not in errors and tokens[i]]
        refused = [(i, m, row) for i, m, row in drawn if not m.accept_drafts(tokens[i][:1])]
        self.num_deferred_checked += len(drawn)
        self.num_deferred_redrawn += len(refused)
        if refused:
            self._redraw(logits, rows, refused, tokens, logprobs, errors, raw)
        self.seconds += time.perf_counter() - t0

    def _redraw(self, logits, rows, refused, tokens, logprobs, errors, raw) -> None:
        try:
            bitmask = _fill([(m, k) for k, (_, m, _) in enumerate(refused)], [], len(refused), self.vocab_size, [], [])
        except Exception:  # llguidance failed: each of these requests fails alone
            log.exception("filling grammar masks failed")
            for i, _, _ in refused:
                errors.setdefault(i, "structured output: computing the grammar's mask failed")
            return
        for i, m, _ in refused:
            _note_mask_error(i, rows.seqs[i], m, errors)
        refused = [r for r in refused if r[0] not in errors]
        if not refused:
            return
        at = [row for _, _, row in refused]
        apply_bitmask(logits, bitmask, at)
        index = torch.tensor(at, dtype=torch.int64, device=logits.device)
        seqs = [rows.seqs[i] for i, _, _ in refused]
        new, lps, sample_errors = sample_tokens(
            logits.index_select(0, index), [s.params for s in seqs],
            [s.num_generated_tokens + REDRAW_OFFSET for s in seqs],
            raw.index_select(0, index) if raw is not None else None)
        for k, (i, _, _) in enumerate(refused):
            if k in sample_errors:
                errors[i] = sample_errors[k]
            else:
                tokens[i], logprobs[i] = [new[k]], [lps[k]]

    def accepted(self, seqs, tokens: list[list[int]], errors: dict[int, str]) -> None:
        """The tokens each sequence will append: its matcher takes them; one the grammar cannot accept
        adds that sequence to ``errors``."""
        t0 = time.perf_counter()
        for i, (seq, toks) in enumerate(zip(seqs, tokens)):
            state = seq.logits_state
            if state is None or state.grammar is None or i in errors:
                continue
            state.accept(seq, toks)
            if state.error is not None:
                errors[i] = state.error
        self.seconds += time.perf_counter() - t0


def _note_mask_error(i: int, seq, matcher, errors: dict[int, str]) -> None:
    """A limit hit while computing a mask fails that request (sequence index ``i``) alone."""
    if matcher is not None and matcher.error and i not in errors:
        errors[i] = seq.logits_state.error = f"structured output: {matcher.error}"


def _fill(plain, verifying, num_rows: int, vocab_size: int, min_rows: list[int], min_ids: list[list[int]]):
    bitmask = fill_row_masks(plain, verifying, num_rows, vocab_size)
    clear_tokens(bitmask, min_rows, min_ids)
    return bitmask
