"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the stream's tail.

For n from ``max_n`` down to ``min_n``, the last n tokens of the stream (prompt plus
output) are searched for earlier in the stream; at the most recent match, the
tokens that followed it are the proposal. No model, microseconds per call: agent
output that copies from its context (files, tool output, code being edited) is
where it pays.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.draft.base import Drafter, Proposal


class NgramDrafter(Drafter):
    name = "ngram"
    cost_per_token = 0.0

    def __init__(self, *, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram drafter needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.streams: dict[str, list[int]] = {}

    @classmethod
    def from_config(cls, config, *, target_dir: str | None = None) -> NgramDrafter:
        return cls(min_n=config.ngram_min, max_n=config.ngram_max)

    @classmethod
    def config_problem(cls, config) -> tuple[str, str] | None:
        if not 1 <= config.ngram_min <= config.ngram_max:
            return "ngram_min", "must be in [1, ngram_max]"
        return None

    def has(self, request_id: str) -> bool:
        return request_id in self.streams

    def open(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.streams[request_id] = list(prompt_ids)

    def commit(self, request_id: str, tokens: Sequence[int]) -> None:
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.extend(tokens)

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def propose(self, request_id: str, k: int) -> Proposal | None:
        stream = self.streams.get(request_id)
        if stream is None or k <= 0:
            return None
        tokens = lookup(stream, k, self.min_n, self.max_n)
        return Proposal(position=len(stream), tokens=tokens) if tokens else None


def lookup(stream: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the stream's
    last n tokens, trying the longest n first."""
    length = len(stream)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = list(stream[length - n :])
        first = tail[0]
        # most recent earlier occurrence: scan start positions backwards
        for start in range(length - n - 1, -1, -1):
            if stream[start] == first and list(stream[start : start + n]) == tail:
                follow = list(stream[start + n : start + n + k])
                if follow:
                    return follow
                break
    return []
