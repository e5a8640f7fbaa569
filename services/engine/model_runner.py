"""Turns a scheduled batch into model inputs, runs the forward pass, samples."""

from __future__ import annotations

import time

import torch

from schemas.engine import TokenLogprob
from services.engine.llama import AttentionMetadata, LlamaModel
from services.engine.sampling import sample_tokens
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence


def _block_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)


class ModelRunner:
    def __init__(self, model: LlamaModel, page_size: int, device: torch.device):
        self.model = model
        self.page_size = page_size
        self.device = device
        self.last_forward_seconds = 0.0  # the model forward alone, for the overhead figure

    def prepare(self, batch: ScheduledBatch):
        """Packed ids, positions, attention metadata, and which rows sample."""
        ps = self.page_size
        nd = batch.num_decode
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampling_rows: list[int] = []
        sampling_seqs: list[Sequence] = []
        dev = self.device
        meta = AttentionMetadata(slot_mapping=None, num_decode_tokens=nd)  # type: ignore[arg-type]
        if nd:
            decode = batch.seqs[:nd]
            seq_lens = []
            for row, seq in enumerate(decode):
                p = seq.num_computed_tokens
                input_ids.append(seq.token_ids[p])
                positions.append(p)
                slots.append(seq.page_ids[p // ps] * ps + p % ps)
                seq_lens.append(p + 1)
                sampling_rows.append(row)
            sampling_seqs.extend(decode)
            meta.decode_block_tables = _block_table([s.page_ids for s in decode], dev)
            meta.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
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
                    sampling_rows.append(nd + cu[-1] - 1)
                    sampling_seqs.append(seq)
            meta.prefill_block_tables = _block_table([s.page_ids for s in prefill], dev)
            meta.prefill_cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=dev)
            meta.prefill_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
            meta.prefill_max_seqlen_q = max(batch.num_new_tokens[nd:])
        meta.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        rows = None if len(sampling_rows) == len(input_ids) else torch.tensor(sampling_rows, dtype=torch.int64, device=dev)
        return ids, pos, meta, rows, sampling_seqs

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch
    ) -> tuple[list[Sequence], list[int | None], list[TokenLogprob | None], dict[int, str]]:
        """Forward the batch; returns the sequences that sampled, their tokens and logprobs, and
        the rows the sampler could not serve (token None; reason by row)."""
        ids, pos, meta, rows, sampling_seqs = self.prepare(batch)
        t0 = time.perf_counter()
        logits = self.model.forward(ids, pos, meta, rows)  # [N, V]; N = 0 when only chunks ran
        self.last_forward_seconds = time.perf_counter() - t0
        if not sampling_seqs:
            return [], [], [], {}
        tokens, logprobs, errors = sample_tokens(logits, sampling_seqs)
        return sampling_seqs, tokens, logprobs, errors
