"""Incremental detokenization and stop strings.

Text is decoded over a small sliding window of token ids (with a few prompt
tokens as left context, so SentencePiece leading spaces survive) and only
released once it no longer ends in an incomplete UTF-8 character. With stop
strings, the last ``len(longest stop) - 1`` characters are held back until
they cannot start a match, so a stop string never leaks into the stream.
"""

from __future__ import annotations

from schemas.engine import SamplingParams

_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        context = prompt_ids[-_PROMPT_CONTEXT:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""  # all output text so far (cut at a stop string)
        self.num_emitted_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> bool:
        """Append one generated token; True when a stop string matched."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return False  # nothing printable yet (e.g. half a multi-byte character)
        delta = full[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        before = len(self.text)
        self.text += delta
        if self.stop:
            search_from = max(0, before - self.hold)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return True
        return False

    def take(self, finished: bool) -> str:
        """Text not yet returned; while running, hold back a possible stop-string start."""
        end = len(self.text) if finished else max(self.num_emitted_chars, len(self.text) - self.hold)
        out = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return out
