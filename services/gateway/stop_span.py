"""Stop strings across a migration: the text a dead worker held back, joined to the next worker's.

A worker holds back the end of its text while it could be the start of a stop string (the
detokenizer's rule), so when it dies, that held-back text (recovered by the gateway from the
streamed token ids) is exactly where a stop string may have begun. The next worker continues
from the same tokens but matches stop strings in its own new text only: a stop string that
begins in the held-back text and ends in the new text would go unseen, and the caller would get
text past the stop. :class:`HeldText` closes that gap: it holds the new worker's first chunks until
its text is long enough to finish any stop string begun in the held-back text (or the stream
ends), then either passes everything on as one chunk with the held-back text in front, or, when
a stop string spans the two, ends the stream there with finish reason ``stop``, as one worker
would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from schemas.worker import TokenChunk


class HeldText:
    """The start of a migrated stream, given the text the previous worker held back."""

    def __init__(self, held: str, stops: Sequence[str]):
        self.held = held
        self.stops = [s for s in stops if s]
        # a stop string begun in `held` ends within this many characters of new text
        self.need = max((len(s) for s in self.stops), default=1) - 1
        self.is_open = bool(held)
        self._chunks: list[TokenChunk] = []
        self._text = ""

    def feed(self, chunk: TokenChunk) -> tuple[list[TokenChunk], bool]:
        """What to pass on now, and whether the stream ends with it (a stop string across the
        migration ends it; the caller then closes the new worker's stream). A stream cut short has
        no usage (the new worker never reported one) and ``stop_end`` set."""
        if not self.is_open:
            return [chunk], chunk.finish_reason is not None
        self._chunks.append(chunk)
        self._text += chunk.text
        if not self.stops or chunk.finish_reason is not None or len(self._text) >= self.need:
            self.is_open = False
            return [self._release()], self._chunks[-1].finish_reason is not None or self._cut is not None
        return [], False

    _cut: int | None = None
    stop_end: int | None = None
    """Once a stop string across the point was found: where it ends, in held-back text + new text."""

    def _release(self) -> TokenChunk:
        text = self.held + self._text
        spans = [(i, i + len(s)) for s in self.stops if (i := text.find(s)) != -1 and i < len(self.held)]
        if not spans:
            return msgspec.structs.replace(_merge(self._chunks), text=text)
        self._cut, end = min(spans)
        self.stop_end = end
        # keep the chunks up to the one whose text completes the stop string (the caller may trim
        # further: a chunk's text can lag its tokens, see WorkerStreams._stopped_across)
        kept, length = [], len(self.held)
        for c in self._chunks:
            kept.append(c)
            length += len(c.text)
            if length >= end:
                break
        return msgspec.structs.replace(_merge(kept), text=text[: self._cut], finish_reason="stop", usage=None)


def _merge(chunks: list[TokenChunk]) -> TokenChunk:
    last = chunks[-1]
    lps = [lp for c in chunks for lp in (c.logprobs or ())]
    return TokenChunk(token_ids=[t for c in chunks for t in c.token_ids], text="".join(c.text for c in chunks),
                      finish_reason=last.finish_reason, usage=last.usage, logprobs=lps or None, timings=None)
