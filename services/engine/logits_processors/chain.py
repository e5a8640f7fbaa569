"""The chain the model runner applies between the forward pass and sampling (or verification).

Per step, for the rows of the sequences that ask for something (``LogitsRows``; a verifying sequence
owns 1 + k rows, row j scoring the token after its first j drafts):

1. :meth:`LogitsProcessors.start`, before the forward pass: each constrained sequence's matcher is
   brought up to date and the grammar masks of all its rows are filled on the mask thread (llguidance
   computes them without the GIL) while the engine thread runs the model;
2. :meth:`LogitsProcessors.apply`, on the logits: penalties (repetition, frequency, presence; row j
   of a verifying sequence counts its first j drafts as output), then ``logit_bias``, then
   ``min_tokens`` (EOS and stop ids at -inf while the row's output index is below it; folded into
   the grammar's mask where there is one), then the grammar masks. One tensor operation per kind over
   all its rows;
3. :meth:`LogitsProcessors.accepted`, after sampling or verification: the matchers take the tokens
   to append, so a token the grammar cannot accept fails its request before it is streamed.

A request whose grammar fails (it did not compile, a limit was hit, a token does not fit) fails
alone: its rows are left as they came and the runner reports it as that request's error.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import torch

from services.engine.logits_processors.penalties import apply_penalties
from services.engine.logits_processors.structured import apply_bitmask, clear_tokens, fill_row_masks

log = logging.getLogger(__name__)


@dataclass
class PendingMasks:
    """Grammar masks of one step being filled: mask row i is logits row ``rows[i]``."""

    rows: list[int] = field(default_factory=list)
    future: concurrent.futures.Future | None = None
    bitmask: torch.Tensor | None = None
    errors: dict[int, str] = field(default_factory=dict)  # by sequence index (LogitsRows.seqs)


class LogitsProcessors:
    def __init__(self, vocab_size: int, device: torch.device, *, overlap: bool = True):
        self.vocab_size = vocab_size
        self.device = device
        self.overlap = overlap
        """Fill grammar masks on the mask thread during the forward pass (else after it, inline)."""
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.mask_wait_seconds = 0.0
        """Time the engine thread waited for masks after the forward pass (the overlap's remainder)."""

    # ---- before the forward pass ----------------------------------------------------------------

    def start(self, rows) -> PendingMasks | None:
        """Bring the constrained sequences' matchers up to date and start filling their rows' masks.
        None when no row asks for anything of the chain."""
        if not any(s.logits_state is not None for s in rows.seqs):
            return None
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
        return pending

    # ---- on the logits ------------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, rows, pending: PendingMasks | None
              ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, str]]:
        """(the processed logits, the raw ones when a processed row wants logprobs else None, errors by
        sequence index). ``logits`` [N, V] is changed in place unless raw logits are kept."""
        if pending is None:
            return logits, None, {}
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
            for i, s in enumerate(rows.seqs):  # a limit hit while computing a mask fails that request
                matcher = s.logits_state.grammar.matcher if s.logits_state and s.logits_state.grammar else None
                if matcher is not None and matcher.error and i not in errors:
                    errors[i] = s.logits_state.error = f"structured output: {matcher.error}"
            apply_bitmask(logits, pending.bitmask, pending.rows)
        return logits, raw, errors

    def _rows_of(self, rows, seq_indexes: list[int]) -> tuple[list[int], list[int]]:
        """(the logits rows of these sequences, for each the position of its sequence in seq_indexes)."""
        out, owner = [], []
        for k, i in enumerate(seq_indexes):
            out.extend(range(rows.starts[i], rows.starts[i] + rows.counts[i]))
            owner.extend([k] * rows.counts[i])
        return out, owner

    def _penalise(self, logits: torch.Tensor, rows, seq_indexes: list[int]) -> None:
        if not seq_indexes:
            return
        dev, vocab = logits.device, logits.shape[1]
        seqs = [rows.seqs[i] for i in seq_indexes]
        states = [s.logits_state for s in seqs]
        row_ids, owner = self._rows_of(rows, seq_indexes)
        owner_t = torch.tensor(owner, dtype=torch.int64, device=dev)
        counts = torch.stack([st.counts(s, vocab, dev) for s, st in zip(seqs, states)]).index_select(0, owner_t)
        # row j of a verifying sequence scores the token after its first j drafts: they count as output
        draft_rows, draft_ids, base = [], [], 0
        for i in seq_indexes:
            drafts = rows.seqs[i].draft_tokens
            for j in range(1, rows.counts[i]):
                draft_rows.extend([base + j] * j)
                draft_ids.extend(drafts[:j])
            base += rows.counts[i]
        if draft_rows:
            counts.index_put_((torch.tensor(draft_rows, device=dev), torch.tensor(draft_ids, device=dev)),
                              torch.ones(len(draft_rows), device=dev), accumulate=True)
        uses_repetition = any(st.repetition != 1.0 for st in states)
        prompt = (torch.stack([st.prompt_mask(s, vocab, dev) for s, st in zip(seqs, states)]).index_select(0, owner_t)
                  if uses_repetition else None)

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=dev).index_select(0, owner_t)

        index = torch.tensor(row_ids, dtype=torch.int64, device=dev)
        x = apply_penalties(logits.index_select(0, index), counts, prompt,
                            per_row([st.repetition for st in states]) if uses_repetition else None,
                            per_row([st.frequency for st in states]), per_row([st.presence for st in states]))
        logits.index_copy_(0, index, x)

    def _bias(self, logits: torch.Tensor, rows, seq_indexes: list[int]) -> None:
        if not seq_indexes:
            return
        r, t, v = [], [], []
        for i in seq_indexes:
            st, start, count = rows.seqs[i].logits_state, rows.starts[i], rows.counts[i]
            r.append(torch.arange(start, start + count).repeat_interleave(len(st.bias_ids)))
            t.append(st.bias_ids.repeat(count))
            v.append(st.bias_values.repeat(count))
        dev = logits.device
        logits.index_put_((torch.cat(r).to(dev), torch.cat(t).to(dev)), torch.cat(v).to(dev, logits.dtype),
                          accumulate=True)

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
            dev = logits.device
            logits.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                              torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))

    # ---- after sampling -----------------------------------------------------------------------------

    def accepted(self, seqs, tokens: list[list[int]], errors: dict[int, str]) -> None:
        """The tokens each sequence will append: its matcher takes them; one the grammar cannot accept
        adds that sequence to ``errors``."""
        for i, (seq, toks) in enumerate(zip(seqs, tokens)):
            state = seq.logits_state
            if state is None or state.grammar is None or i in errors:
                continue
            state.accept(seq, toks)
            if state.error is not None:
                errors[i] = state.error


def _fill(plain, verifying, num_rows: int, vocab_size: int, min_rows: list[int], min_ids: list[list[int]]):
    bitmask = fill_row_masks(plain, verifying, num_rows, vocab_size)
    clear_tokens(bitmask, min_rows, min_ids)
    return bitmask
