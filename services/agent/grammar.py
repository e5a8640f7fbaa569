"""Constrained decoding through llguidance: compile a StructuredOutput once (bounded, cached), then one
matcher per request that says which tokens may come next.

Why llguidance (tried beside xgrammar 0.2.9 on these machines, SmolLM2's tokenizer): both install as
CPU wheels, but xgrammar compiles a grammar's masks ahead of time, with no way to bound or interrupt
it (a 20,000-value enum took 28 s, holding a core), while llguidance builds lazily under explicit
resource limits (the same enum: 0.1 s) and refuses what exceeds them; it also needs no torch.

What the engine half calls (issue 28; this module has no engine wiring of its own):

- :func:`check` at the gateway: a spec's grammar builds within the limits (no tokenizer needed).
- :class:`GrammarCompiler` per worker (one per tokenizer): ``matcher(constraint)`` from a bounded LRU
  cache of compiled grammars; ``rebuild(constraint, token_ids)`` for a migrated request.
- :class:`GrammarMatcher` per request: ``accept``, ``accept_drafts`` (how many drafted tokens the
  grammar allows), ``fill_mask``, ``rollback``, ``is_finished``; a grammar error fails that request
  alone (``error``), never the batch.
- :func:`allocate_masks`, :func:`fill_masks` (one call for the batch, llguidance's threads, no GIL),
  :func:`fill_masks_with_drafts` (a verifying sequence's rows) and :func:`apply_masks` (the batch's
  rows of the logits).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bus.errors import InvalidArgument
from schemas.engine import StructuredOutput

MAX_COMPILE_SECONDS = 2.0
"""A grammar that takes longer than this to build is refused (after the fact: llguidance's limits
below keep the build itself short; this catches what they let through)."""
LIMITS = dict(
    max_grammar_size=200_000,  # symbols in the grammar's productions (llguidance's default: 500k)
    initial_lexer_fuel=1_000_000,  # building the lexer's regexes, ~20 ms of work
    step_lexer_fuel=200_000,  # one token's mask, lexer side: ~15 ms at most
    step_max_items=50_000,  # one token's mask, parser side: ~2.5 ms at most
    max_lexer_states=100_000,  # ~100-200 MB at most
)
"""llguidance's resource limits: past any of them a grammar is refused when built, or its request fails
(alone) mid-generation."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON: a sampler cannot loop on whitespace forever."""


class GrammarError(InvalidArgument):
    """A structured-output spec that does not compile within the limits (invalid, unsupported or too big)."""



def _llg():
    import llguidance

    return llguidance


def _limits():
    return _llg().LLParserLimits(**LIMITS)


def grammar_text(constraint: StructuredOutput) -> str:
    """The spec as a grammar llguidance builds (its JSON or Lark form)."""
    llg = _llg().LLMatcher
    try:
        if constraint.kind == "json_object":
            return llg.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if constraint.kind == "json_schema":
            return llg.grammar_from_json_schema(constraint.spec, overrides=JSON_OPTIONS)
        if constraint.kind == "regex":
            return llg.grammar_from_regex(constraint.spec)
        return llg.grammar_from_lark(constraint.spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"structured output ({constraint.kind}) is invalid: {exc}") from None


def check(constraint: StructuredOutput) -> None:
    """GrammarError unless the spec builds within the limits (the gateway's check; no tokenizer)."""
    started = time.monotonic()
    message = _llg().LLMatcher.validate_grammar(grammar_text(constraint), None, limits=_limits())
    _refuse_slow(constraint, started)
    if message:
        raise GrammarError(f"structured output ({constraint.kind}) cannot be enforced: {message}")


def _refuse_slow(constraint: StructuredOutput, started: float) -> None:
    seconds = time.monotonic() - started
    if seconds > MAX_COMPILE_SECONDS:
        raise GrammarError(f"structured output ({constraint.kind}) took {seconds:.1f}s to compile; the limit is "
                           f"{MAX_COMPILE_SECONDS:g}s (simplify the schema)")


def json_schema_constraint(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=json.dumps(schema, ensure_ascii=False))


# --- per request --------------------------------------------------------------------------------


class GrammarMatcher:
    """Where one request is in its grammar. NOTE: not thread-safe; one per request."""

    def __init__(self, matcher: Any, constraint: StructuredOutput):
        self._m = matcher
        self.constraint = constraint
        self.num_tokens = 0
        """Tokens accepted so far (what rollback can undo)."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and ``error`` set) when the grammar forbids it."""
        ok = self._m.consume_token(token_id)
        self.num_tokens += ok
        return ok

    def accept_drafts(self, token_ids: Sequence[int]) -> int:
        """How many leading drafted tokens the grammar allows (the state does not move): speculation
        rejects the draft from there on."""
        return self._m.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (drafts the target model rejected)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")
        self.num_tokens -= num_tokens

    def fill_mask(self, bitmask: Any, row: int = 0) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, bit t%32 of word t//32 is token t)."""
        view = bitmask[row]
        if not (bitmask.dtype.itemsize == 4 and view.is_contiguous() and not view.is_cuda):
            raise ValueError("fill_mask needs a contiguous CPU int32 bitmask (allocate_masks)")
        self._m.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete: only an end-of-sequence token may follow."""
        return self._m.is_stopped()

    @property
    def can_finish(self) -> bool:
        """End-of-sequence is allowed now (the output so far is a whole sentence of the grammar)."""
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the grammar failed (a forbidden token, or a resource limit): fail this request alone."""
        return self._m.get_error() or None if self._m.is_error() else None


# --- per worker ---------------------------------------------------------------------------------


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the last ``cache_size`` grammars (LRU).

    A compiled grammar is a matcher in its start state; a request gets a copy (cheap), so the second
    request with the same schema skips the build."""

    def __init__(self, tokenizer: Any, *, cache_size: int = 64):
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer = tokenizer
        """An llguidance LLTokenizer."""
        self.vocab_size: int = tokenizer.vocab_size
        self.cache_size = cache_size
        self._cache: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        """Grammars built (cache misses)."""

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, *, vocab_size: int | None = None,
                eos_token_ids: Sequence[int] | None = None, cache_size: int = 64) -> GrammarCompiler:
        """From a transformers fast tokenizer (about a second: build one per worker). ``vocab_size``:
        the model's logits width when it exceeds the tokenizer's; ``eos_token_ids``: every token that
        ends a sequence (the only ones allowed once the grammar is complete)."""
        import llguidance.hf

        eos = list(eos_token_ids) if eos_token_ids else None
        return cls(llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos),
                   cache_size=cache_size)

    @classmethod
    def for_model(cls, model_dir: str | Path, **kwargs) -> GrammarCompiler:
        from services.engine.model_config import ModelConfig
        from services.models.tokenizer_files import load_tokenizer

        config = ModelConfig.from_dir(Path(model_dir))
        tokenizer = load_tokenizer(model_dir)
        return cls.from_hf(tokenizer, vocab_size=max(config.vocab_size, len(tokenizer)),
                           eos_token_ids=list(config.eos_token_ids), **kwargs)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar (from the cache when there); GrammarError if it cannot be built."""
        key = (constraint.kind, constraint.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        text = grammar_text(constraint)
        started = time.monotonic()
        matcher = _llg().LLMatcher(self.tokenizer, text, log_level=0, limits=_limits())  # NOTE: drops the GIL
        _refuse_slow(constraint, started)
        if matcher.is_error():
            raise GrammarError(f"structured output ({constraint.kind}) cannot be enforced: {matcher.get_error()}")
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(self.compile(constraint).deep_copy(), constraint)

    def rebuild(self, constraint: StructuredOutput, token_ids: Sequence[int]) -> GrammarMatcher:
        """A matcher that has accepted ``token_ids`` (the output so far of a migrated request);
        GrammarError when they break the grammar."""
        matcher = self.matcher(constraint)
        for i, token_id in enumerate(token_ids):
            if not matcher.accept(token_id):
                raise GrammarError(f"token {i} of the output so far ({token_id}) breaks the grammar: {matcher.error}")
        return matcher

    def __len__(self) -> int:
        return len(self._cache)


# --- per batch ----------------------------------------------------------------------------------


def allocate_masks(batch_size: int, vocab_size: int) -> Any:
    """An int32 bitmask [batch_size, ceil(vocab_size / 32)], every token allowed."""
    import torch

    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_executor = None


def fill_masks(rows: Sequence[tuple[GrammarMatcher, int]], bitmask: Any) -> None:
    """Fill ``bitmask[row]`` for each (matcher, row), in parallel on llguidance's threads (no GIL)."""
    global _executor
    if not rows:
        return
    if not bitmask.is_contiguous() or bitmask.is_cuda:
        raise ValueError("fill_masks needs a contiguous CPU int32 bitmask (allocate_masks)")
    if _executor is None:
        _executor = _llg().LLExecutor()
    _executor.unsafe_compute_mask_ptr([(m._m, row) for m, row in rows], bitmask.data_ptr(),
                                      bitmask.shape[1] * 4, bitmask.shape[0])


def fill_masks_with_drafts(rows: Sequence[tuple[GrammarMatcher, int, Sequence[int]]], bitmask: Any) -> None:
    """Speculation's rows: for each (matcher, start, drafts), ``bitmask[start]`` gets the mask now and
    ``bitmask[start + 1 + i]`` the mask after ``drafts[:i + 1]`` (the rows a verifying sequence owns,
    model_runner.LogitsRows). The matchers do not move. Rows after a draft the grammar forbids are left
    as they were: cut the draft there first (``accept_drafts``)."""
    global _executor
    if not rows:
        return
    if not bitmask.is_contiguous() or bitmask.is_cuda:
        raise ValueError("fill_masks_with_drafts needs a contiguous CPU int32 bitmask (allocate_masks)")
    if _executor is None:
        _executor = _llg().LLExecutor()
    _executor.unsafe_compute_mask_ptr_with_draft_token([(m._m, row, list(drafts)) for m, row, drafts in rows],
                                                       bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def apply_masks(logits: Any, bitmask: Any, rows: Sequence[int] | None = None) -> None:
    """Set the logits of forbidden tokens to -inf, in place.

    logits: [B, V] (any device, any float dtype); bitmask: [len(rows), W] int32 (CPU or the logits'
    device), row i of the mask for row rows[i] of the logits (all rows, in order, when None). Tokens
    past the mask's 32*W (a model vocabulary padded beyond the tokenizer's) are forbidden.
    """
    import torch

    # bits: [R, W, 32] -> allowed: [R, 32*W]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.to(logits.device, non_blocking=True).unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bits.shape[0], -1).bool()
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    if rows is None:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        index = torch.as_tensor(rows, device=logits.device, dtype=torch.long)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
