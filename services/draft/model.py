"""The ``model`` drafter: a small model of the target's family, on kvbus's own engine code.

It loads a local HF folder (for example a layer-skip copy of the target written by
``services.models.truncate``) and keeps, per request, a sequence with its own paged KV
cache (its own pool and block manager, no prefix caching). ``propose`` first computes
the tokens committed since the last call (one extend pass for every request), then
drafts greedily one decode pass per token, all requests batched. ``commit`` rolls the
KV back to the longest prefix the drafted tokens share with what the target accepted,
so accepted drafts keep their KV and rejected ones are recomputed from the correction.
Greedy drafting proposes with q = 1 (the rejection sampler's one-hot case).

A folder whose tokenizer differs from the target's is refused (:class:`DraftError`):
its token ids would mean other text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from schemas.engine import SamplingParams
from services.draft.base import Drafter, DraftError, Proposal
from services.engine.block_manager import BlockManager
from services.engine.kv_pool import KVPool
from services.engine.linear import can_prepack, prepack_weights
from services.engine.llama import LlamaModel
from services.engine.model_config import ModelConfig
from services.engine.model_runner import ModelRunner
from services.engine.scheduler import ScheduledBatch
from services.engine.sequence import Sequence
from services.engine.weights import load_weights

_GREEDY = SamplingParams(temperature=0.0)


def _vocab_fingerprint(model_dir: Path) -> tuple:
    """What must match for token ids to mean the same text: vocab size, tokens, added tokens."""
    config = json.loads((model_dir / "config.json").read_text())
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():
        tok = json.loads(tok_file.read_text())
        model = tok.get("model", {})
        vocab = model.get("vocab")
        added = sorted((a["id"], a["content"]) for a in tok.get("added_tokens", []))
        return config.get("vocab_size"), json.dumps(vocab, sort_keys=True), json.dumps(model.get("merges")), added
    from services.models.tokenizer_files import load_tokenizer

    t = load_tokenizer(model_dir)
    return config.get("vocab_size"), sorted(t.get_vocab().items())


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    if _vocab_fingerprint(target_dir) != _vocab_fingerprint(draft_dir):
        raise DraftError(
            f"draft model {draft_dir} does not share the target's tokenizer ({target_dir}): "
            "speculative decoding needs the same vocabulary"
        )


def _param_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def _size_ratio(draft_dir: Path, target_dir: Path) -> float:
    """Drafting a token as a share of a target decode step: both read their weights once a step."""
    return _param_bytes(draft_dir) / max(1, _param_bytes(target_dir))


class ModelDrafter(Drafter):
    name = "model"
    UNKNOWN_COST = 0.4
    """cost_per_token assumed when the draft model's size cannot be compared with the target's."""

    def __init__(
        self, *, model: str | None, target_dir: str | None = None, device: str = "cpu",
        kv_cache_memory: float = 0.125, page_size: int = 16, cost_per_token: float | None = None,
    ):
        from services.models import resolve_model

        if not model:
            raise DraftError("the model drafter needs a draft model folder (draft_model)")
        self.model_dir = Path(resolve_model(model))
        if target_dir is not None:
            check_same_tokenizer(Path(target_dir), self.model_dir)
            self.cost_per_token = _size_ratio(self.model_dir, Path(target_dir))
        if cost_per_token is not None:  # measured by the caller (or 0 to always draft, for tests)
            self.cost_per_token = cost_per_token
        self.mc = mc = ModelConfig.from_dir(self.model_dir)
        self.device = torch.device(device)
        weights = load_weights(self.model_dir, mc, torch.float32, device)
        if can_prepack(self.device, torch.float32):
            prepack_weights(weights)
        num_pages = KVPool.pages_for_budget(mc, page_size, torch.float32, self.device, kv_cache_memory, 0.25)
        self.pool = KVPool(mc, num_pages, page_size, torch.float32, self.device, 1.0)
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=False)
        self.max_model_len = mc.max_model_len
        self.runner = ModelRunner(LlamaModel(mc, weights, self.pool, mc.max_model_len), page_size, self.device)
        self.seqs: dict[str, Sequence] = {}
        self.committed: dict[str, int] = {}  # stream length; token_ids past it are drafts

    @classmethod
    def from_config(cls, config, *, target_dir: str | None = None) -> ModelDrafter:
        return cls(model=config.draft_model, target_dir=target_dir, device=config.device)

    @classmethod
    def config_problem(cls, config) -> tuple[str, str] | None:
        return ("draft_model", "is needed with speculative_method=model") if not config.draft_model else None

    @classmethod
    def cost_for(cls, config, *, target_dir: str | None = None) -> float:
        """The draft model's weights over the target's (a decode step reads its weights once)."""
        from services.models import resolve_model

        try:
            return _size_ratio(Path(resolve_model(config.draft_model)), Path(target_dir))
        except Exception:  # a folder this process cannot see (the draft service's host)
            return cls.UNKNOWN_COST

    def has(self, request_id: str) -> bool:
        return request_id in self.seqs

    def open(self, request_id: str, prompt_ids: Seq[int]) -> None:
        self.close(request_id)
        self.seqs[request_id] = Sequence(request_id, list(prompt_ids), _GREEDY, max_model_len=self.max_model_len)
        self.committed[request_id] = len(prompt_ids)

    def close(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        self.committed.pop(request_id, None)
        if seq is not None:
            self.bm.free(seq)

    def commit(self, request_id: str, tokens: Seq[int]) -> None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return
        n = self.committed[request_id]
        drafts = seq.token_ids[n:]
        same = 0
        while same < min(len(drafts), len(tokens)) and drafts[same] == tokens[same]:
            same += 1
        seq.token_ids = seq.token_ids[:n] + list(tokens)
        self.committed[request_id] = len(seq.token_ids)
        # KV stays valid for the committed prefix and the drafts the target accepted
        seq.num_computed_tokens = min(seq.num_computed_tokens, n + same)
        self.bm.truncate(seq, seq.num_computed_tokens)

    def propose(self, request_id: str, k: int) -> Proposal | None:
        return self.propose_many({request_id: k})[request_id]

    @torch.inference_mode()
    def propose_many(self, wants: dict[str, int]) -> dict[str, Proposal | None]:
        out: dict[str, Proposal | None] = {rid: None for rid in wants}
        live: list[tuple[str, Sequence, int]] = []
        for rid, k in wants.items():
            seq = self.seqs.get(rid)
            if seq is None or k <= 0:
                continue
            n = self.committed[rid]
            del seq.token_ids[n:]  # drafts of an earlier call that were never committed
            seq.num_computed_tokens = min(seq.num_computed_tokens, n - 1)
            k = min(k, self.max_model_len - n - 1)
            if k <= 0 or not self.bm.can_grow(seq, n + k):
                continue
            self.bm.grow(seq, n + k)
            live.append((rid, seq, k))
        if not live:
            return out
        # 1. catch up on what was committed since the last call; the last row gives draft 1
        batch = ScheduledBatch(seqs=[s for _, s, _ in live], num_new_tokens=[s.num_uncomputed_tokens for _, s, _ in live])
        _, tokens, _, _ = self.runner.run(batch)  # greedy drafts: argmax never fails
        for (_, seq, _), toks in zip(live, tokens):
            seq.num_computed_tokens = seq.num_tokens
            seq.token_ids.append(toks[0])
        # 2. one decode pass per further draft, for the requests that want more
        for step in range(1, max(k for _, _, k in live)):
            more = [s for _, s, k in live if k > step]
            batch = ScheduledBatch(seqs=more, num_new_tokens=[1] * len(more), num_decode=len(more))
            _, tokens, _, _ = self.runner.run(batch)
            for seq, toks in zip(more, tokens):
                seq.num_computed_tokens += 1
                seq.token_ids.append(toks[0])
        for rid, seq, k in live:
            n = self.committed[rid]
            out[rid] = Proposal(position=n, tokens=seq.token_ids[n : n + k])
        return out
