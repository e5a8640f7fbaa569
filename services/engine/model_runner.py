"""Turns a scheduled batch into model inputs, runs the forward pass, samples or verifies.

One step: :meth:`ModelRunner.prepare` (packed ids, positions, attention metadata, which rows
sample), the model's forward, then :meth:`ModelRunner.sample` over the rows described by
:class:`LogitsRows` (plain rows through ``sampling.sample_tokens``, verifying ones through
``spec_decode.verify``). Between the two sits the one seam for changing logits per request: the
logits-processor chain (``logits_processors.LogitsProcessors``: penalties, logit_bias, min_tokens,
grammar masks), whose masks are filled on a helper thread while the forward pass runs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kernels import compute_logprobs
from schemas.engine import TokenLogprob
from services.engine.llama import AttentionMetadata, LlamaModel
from services.engine.logits_processors import LogitsProcessors
from services.engine.sampling import sample_tokens
from services.engine.spec_decode import verify
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogitsRows:
    """Whose each row of a step's logits is: sequence ``seqs[i]`` owns ``counts[i]`` rows from
    ``starts[i]`` on. Its row j scores the token after its last token and its first j drafts
    (``seq.draft_tokens[:j]``): j = 0 for a plain row, 0..k for a sequence verifying k drafts."""

    seqs: list[Sequence]
    counts: list[int]
    starts: list[int]

    @classmethod
    def of(cls, batch: ScheduledBatch, seqs: list[Sequence]) -> LogitsRows:
        """The rows of ``batch``'s sampling sequences ``seqs`` (``prepare``'s): its decode
        sequences first, 1 + k rows each, then the prompts that completed, one row each."""
        nd = batch.num_decode
        counts = batch.num_new_tokens[:nd] + [1] * (len(seqs) - nd)
        starts = [0]
        for c in counts[:-1]:
            starts.append(starts[-1] + c)
        return cls(seqs, counts, starts)

    @property
    def is_verifying(self) -> bool:
        """Whether any sequence verifies drafts (else one row per sequence)."""
        return any(c > 1 for c in self.counts)


def _block_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


class ModelRunner:
    def __init__(self, model: LlamaModel, page_size: int, device: torch.device):
        self.model = model
        self.page_size = page_size
        self.device = device
        self.last_forward_seconds = 0.0  # the model forward alone, for the overhead figure
        self._processors: LogitsProcessors | None = None

    @property
    def processors(self) -> LogitsProcessors:
        """The logits-processor chain (made at first use: a runner that only prepares needs none)."""
        if self._processors is None:
            self._processors = LogitsProcessors(self.model.mc.vocab_size, self.device)
        return self._processors

    def prepare(self, batch: ScheduledBatch):
        """Packed ids, positions, attention metadata, and which rows sample."""
        ps = self.page_size
        nd = batch.num_decode  # decode sequences; their rows (1 + drafts each) come first
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        sampling_lens: list[int] = []  # each sampling row's KV length, with its own token
        dev = self.device
        meta = AttentionMetadata(slot_mapping=None, num_decode_tokens=0)  # type: ignore[arg-type]
        if nd:
            # A speculating sequence's drafts are decode rows too (the packed GEMM's rows, so each
            # row's projections are plain decoding's). Its 1 + k rows attend as one extend of
            # its sequence, row j seeing positions <= p + j: the KV is read once for all of them
            # (a row per draft read the whole context again: at 3,000 tokens most of the step).
            decode = batch.seqs[:nd]
            counts = batch.num_new_tokens[:nd]
            for seq, n in zip(decode, counts):
                p = seq.num_computed_tokens
                ids = [seq.token_ids[p], *seq.draft_tokens[: n - 1]]
                for j in range(n):
                    input_ids.append(ids[j])
                    positions.append(p + j)
                    slots.append(seq.page_ids[(p + j) // ps] * ps + (p + j) % ps)
                    sampling_rows.append(len(sampling_rows))
            meta.num_decode_tokens = len(input_ids)
            sampling_seqs.extend(decode)
            sampling_lens.extend(s.num_computed_tokens + n for s, n in zip(decode, counts))
            meta.decode_block_tables = _block_table([s.page_ids for s in decode], dev)
            meta.decode_seq_lens = torch.tensor(sampling_lens, dtype=torch.int32, device=dev)  # theirs alone so far
            widest = max(counts)
            if widest > 1:
                cu = [0]
                for n in counts:
                    cu.append(cu[-1] + n)
                meta.decode_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
                meta.decode_max_seqlen_q = widest
        if nd < len(batch.seqs):
            prefill = batch.seqs[nd:]
            cu, seq_lens = [0], []
            for seq, n in zip(prefill, batch.num_new_tokens[nd:]):
                start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                pages = seq.page_ids
                slots.extend(pages[p // ps] * ps + p % ps for p in range(start, end))
                cu.append(cu[-1] + n)
                seq_lens.append(end)
                if end == seq.num_tokens:  # prompt complete: its last row samples
                    sampling_rows.append(meta.num_decode_tokens + cu[-1] - 1)
                    sampling_seqs.append(seq)
                    sampling_lens.append(end)
            meta.prefill_block_tables = _block_table([s.page_ids for s in prefill], dev)
            meta.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
            meta.prefill_max_seqlen_q = max(batch.num_new_tokens[nd:])
        if len(input_ids) != batch.num_tokens:  # every scheduled token is computed, or the step fails
            raise RuntimeError(f"prepared {len(input_ids)} rows for a batch of {batch.num_tokens} tokens")
        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        rows = None if len(sampling_rows) == len(input_ids) else torch.tensor(sampling_rows, dtype=torch.int64, device=dev)
        if rows is not None and meta.decode_cu_seqlens_q is None:  # the last layer runs the sampling rows only
            meta.sample_block_tables = (_block_table([s.page_ids for s in sampling_seqs], dev) if sampling_seqs
                                        else torch.zeros((0, 1), dtype=torch.int32, device=dev))
            meta.sample_seq_lens = torch.tensor(sampling_lens, dtype=torch.int32, device=dev)
        return ids, pos, meta, rows, sampling_seqs

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[list[Sequence], list[list[int]], list[list[TokenLogprob | None]], dict[int, str]]:
        """Forward the batch; returns the sequences that sampled and, for each, the tokens to
        append (one; or, when it verified drafts, the accepted ones plus the target's next)
        and their logprobs, and the rows the sampler could not serve (no tokens; reason by row)."""
        ids, pos, meta, rows, sampling_seqs = self.prepare(batch)
        logits_rows = LogitsRows.of(batch, sampling_seqs) if sampling_seqs else None
        pending = self.processors.start(logits_rows) if logits_rows is not None else None  # masks fill meanwhile
        t0 = time.perf_counter()
        logits = self.model.forward(ids, pos, meta, rows)  # [N, V]; N = 0 when only chunks ran
        self.last_forward_seconds = time.perf_counter() - t0
        if logits_rows is None:
            return [], [], [], {}
        # NOTE: the one place the logits change before they are sampled or verified
        logits, raw, errors = self.processors.apply(logits, logits_rows, pending)
        seqs, tokens, logprobs, sample_errors = self.sample(logits, logits_rows, raw)
        errors.update(sample_errors)
        if pending is not None:
            self.processors.redraw_refused(logits, logits_rows, pending, tokens, logprobs, errors, raw)
            self.processors.accepted(seqs, tokens, errors)
        return seqs, tokens, logprobs, errors

    def sample(
        self, logits: torch.Tensor, rows: LogitsRows, raw: torch.Tensor | None = None
    ) -> tuple[list[Sequence], list[list[int]], list[list[TokenLogprob | None]], dict[int, str]]:
        """Plain rows sample together; each verifying sequence runs the acceptance rule on its rows.
        ``raw``: the logits before the chain, for logprobs (None: ``logits`` are)."""
        seqs, counts, starts = rows.seqs, rows.counts, rows.starts
        raw = logits if raw is None else raw
        if not rows.is_verifying:
            tokens, logprobs, errors = sample_tokens(logits, [s.params for s in seqs],
                                                     [s.num_generated_tokens for s in seqs], raw)
            return seqs, [[t] for t in tokens], [[lp] for lp in logprobs], errors
        plain = [i for i, c in enumerate(counts) if c == 1]
        out_tokens: list[list[int]] = [[] for _ in seqs]
        out_lps: list[list[TokenLogprob | None]] = [[] for _ in seqs]
        errors: dict[int, str] = {}
        if plain:
            idx = torch.tensor([starts[i] for i in plain], dtype=torch.int64, device=logits.device)
            tokens, logprobs, plain_errors = sample_tokens(logits[idx], [seqs[i].params for i in plain],
                                                           [seqs[i].num_generated_tokens for i in plain], raw[idx])
            for j, (i, t, lp) in enumerate(zip(plain, tokens, logprobs)):
                out_tokens[i], out_lps[i] = [t], [lp]
                if j in plain_errors:
                    errors[i] = plain_errors[j]
        for i, c in enumerate(counts):
            if c == 1:
                continue
            seq = seqs[i]
            rows_i = logits[starts[i] : starts[i] + c]
            q = seq.draft_probs[: c - 1] if seq.draft_probs is not None else None
            try:
                toks = verify(rows_i, seq.draft_tokens[: c - 1], q, seq.params, seq.num_generated_tokens)
                out_lps[i] = self._logprobs(raw[starts[i] : starts[i] + len(toks)], toks, seq)
            except Exception:  # this request fails alone; the batch goes on
                log.exception("verifying the drafts of request %s failed", seq.request_id)
                errors[i] = "the sampler failed for this request's parameters"
                continue
            out_tokens[i] = toks
        return seqs, out_tokens, out_lps, errors

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: list[int], seq: Sequence) -> list[TokenLogprob | None]:
        n = seq.params.logprobs
        if n is None:
            return [None] * len(tokens)
        ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
        chosen, top_ids, top_lps = (t.tolist() for t in compute_logprobs(logits, ids, n))
        return [
            TokenLogprob(token_id=t, logprob=chosen[j], top_token_ids=top_ids[j][:n], top_logprobs=top_lps[j][:n])
            for j, t in enumerate(tokens)
        ]
