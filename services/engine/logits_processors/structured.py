"""Structured output inside the engine: a request's grammar (compiled off the engine thread), its
token masks (filled on a helper thread while the forward pass runs) and applying them to logits.

The grammar layer itself (llguidance, bounds, the compiled-grammar cache) is services/agent/grammar.py;
this module is what the engine does with it:

* :class:`GrammarService` (one per engine, held by the intake): builds the worker's
  ``GrammarCompiler`` from the engine's tokenizer on first use (~1 s, once per process and model) and
  compiles each request's constraint on its own thread as the request arrives, so a compile (at most
  ``grammar.MAX_COMPILE_SECONDS``) overlaps its queueing and prefill instead of stalling a step.
  A moved stream's matcher is rebuilt there from the output it came with.
* :class:`GrammarSlot` (one per request): the compile's future, then the matcher; the first step that
  samples for the request waits for it (a cached grammar is ready at once).
* :func:`fill_row_masks` (the mask job), :func:`clear_tokens` (min_tokens' EOS ban folded into a
  mask, unless the grammar allows nothing else) and :func:`apply_bitmask` (a numpy path on CPU: the
  torch bit ops took ~60 ms for 8 rows of a 49k vocabulary on the 2-core VM, numpy ~1 ms).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence as Seq

import numpy as np
import torch

from schemas.engine import StructuredOutput
from services.agent import grammar

log = logging.getLogger(__name__)

_compilers: dict[tuple, grammar.GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids: Seq[int]) -> grammar.GrammarCompiler:
    """The GrammarCompiler for this tokenizer and vocabulary, built once per process (engines of one
    model share it and its cache of compiled grammars)."""
    key = (getattr(tokenizer, "name_or_path", id(tokenizer)), len(tokenizer), vocab_size, tuple(sorted(eos_token_ids)))
    with _compilers_lock:
        found = _compilers.get(key)
        if found is None:
            found = _compilers[key] = grammar.GrammarCompiler.from_hf(
                tokenizer, vocab_size=max(vocab_size, len(tokenizer)), eos_token_ids=sorted(eos_token_ids))
        return found


class GrammarSlot:
    """One request's grammar: compiling, then its matcher (or why it failed)."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future
        self.matcher: grammar.GrammarMatcher | None = None
        self.error: str | None = None

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed): :meth:`resolve` will not wait."""
        return self.matcher is not None or self.error is not None or self._future.done()

    def resolve(self) -> grammar.GrammarMatcher | None:
        """The matcher, waiting for the compile if it still runs; None (and ``error``) when it failed."""
        if self.matcher is None and self.error is None:
            try:
                self.matcher = self._future.result()
            except grammar.GrammarError as exc:
                self.error = exc.message
            except Exception as exc:  # llguidance or the tokenizer: this request fails alone
                log.exception("compiling a grammar failed")
                self.error = f"the grammar could not be built ({type(exc).__name__})"
        return self.matcher

    def fail(self, reason: str) -> None:
        self.error = reason


class GrammarService:
    """Compiles requests' constraints for one engine on a thread of its own (at most one compile runs
    at a time: a worker's cores belong to its steps)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Seq[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def start(self, constraint: StructuredOutput, prior_output_ids: Seq[int]) -> GrammarSlot:
        """Begin compiling ``constraint`` (and replaying ``prior_output_ids``, a moved stream's output)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvbus-grammar")
        return GrammarSlot(self._pool.submit(self._build, constraint, list(prior_output_ids)))

    def _build(self, constraint: StructuredOutput, prior_output_ids: list[int]) -> grammar.GrammarMatcher:
        compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return compiler.rebuild(constraint, prior_output_ids)


# --- masks ---------------------------------------------------------------------------------------


def fill_row_masks(plain: list[tuple[grammar.GrammarMatcher, int]],
                   verifying: list[tuple[grammar.GrammarMatcher, int, list[int]]], num_rows: int,
                   vocab_size: int) -> torch.Tensor:
    """The bitmask [num_rows, ceil(V/32)] int32 of the step's constrained rows: ``plain`` (matcher,
    row) one row each, ``verifying`` (matcher, first row, drafts) 1 + len(drafts) rows each, row j
    after the first j drafts. The matchers do not move. Runs on the mask thread (llguidance's
    executor computes without the GIL)."""
    bitmask = grammar.allocate_masks(num_rows, vocab_size)
    grammar.fill_masks(plain, bitmask)
    if verifying:
        grammar.fill_masks_with_drafts(verifying, bitmask)
    return bitmask


def clear_tokens(bitmask: torch.Tensor, rows: list[int], token_ids: list[list[int]]) -> None:
    """Forbid ``token_ids[i]`` in mask row ``rows[i]``, except where that would leave the row empty (a
    complete grammar allows only end-of-sequence: the grammar wins over min_tokens)."""
    if not rows:
        return
    words = bitmask.numpy()
    width = words.shape[1]
    clear = np.zeros((len(rows), width), dtype=np.int64)
    for i, ids in enumerate(token_ids):  # few ids a row (EOS and stop ids)
        for t in ids:
            if t // 32 < width:
                clear[i, t // 32] |= 1 << (t % 32)
    cleared = words[rows] & ~clear.astype(np.uint32).view(np.int32)
    has_any = (cleared != 0).any(axis=1)
    words[np.asarray(rows)[has_any]] = cleared[has_any]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token t that row i of ``bitmask`` forbids (tokens
    past the mask's width too: a model vocabulary padded beyond the tokenizer's), in place."""
    if not rows:
        return
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        grammar.apply_masks(logits, bitmask, rows)
        return
    vocab = logits.shape[1]
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little").view(bool)
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    allowed = allowed[:, :vocab]
    x = logits.numpy()
    if rows == list(range(rows[0], rows[0] + len(rows))):  # a contiguous block: masked in place
        np.copyto(x[rows[0] : rows[0] + len(rows)], -np.inf, where=~allowed)
    else:
        index = np.asarray(rows)
        block = x[index]
        np.copyto(block, -np.inf, where=~allowed)
        x[index] = block
