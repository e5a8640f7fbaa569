"""Requests in: prompts tokenized and checked, request ids kept unique, sequences made.

Runs on the caller's thread (``add_*`` only enqueue), so every check of a request happens before
it reaches the engine's mailbox and a bad request never touches a step. A request id stays taken
from :meth:`RequestIntake.new_sequence` until the engine finishes the request
(:meth:`RequestIntake.release`). A request that asks for per-row logit work (penalties, logit_bias,
min_tokens, structured output) gets its ``LogitsState`` here, and its grammar starts compiling on the
grammar thread (``logits_processors.GrammarService``) while it queues and prefills.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence as Seq

from schemas.engine import SamplingParams
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.logits_processors import GrammarService, LogitsState, wants_logit_work
from services.engine.outputs import RequestError
from services.engine.sequence import Sequence


class RequestIntake:
    def __init__(self, *, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 pages_for: Callable[[int], int], num_pages: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.pages_for = pages_for  # BlockManager.pages_for: a prompt must fit the whole pool
        self.num_pages = num_pages
        self._live_ids: set[str] = set()
        self._lock = threading.Lock()
        self.grammar = GrammarService(tokenizer, vocab_size, eos_token_ids) if tokenizer is not None else None

    def new_sequence(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *, with_text: bool = True
    ) -> Sequence:
        """A checked request's sequence (RequestError otherwise); its id is taken until released."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need the tokenizer (load_tokenizer=True)")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        self._check_prompt(token_ids, params)
        with self._lock:
            if request_id in self._live_ids:
                raise RequestError(f"request id {request_id!r} is already running")
            self._live_ids.add(request_id)
        seq = Sequence(
            request_id, token_ids, params, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len
        )
        if self.tokenizer is not None and with_text:
            seq.detok = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        if wants_logit_work(params):
            constraint = params.structured_output
            seq.logits_state = LogitsState(seq, self.grammar.start(constraint, seq.generated_token_ids)
                                           if constraint is not None else None)
        return seq

    def checked(self, seq: Sequence, check: Callable, *args) -> None:
        """``check(*args)``; a RequestError it raises frees ``seq``'s request id first."""
        try:
            check(*args)
        except RequestError:
            self.release(seq.request_id)
            raise

    def release(self, request_id: str) -> None:
        """The request finished: its id may be used again."""
        with self._lock:
            self._live_ids.discard(request_id)

    def _check_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(token_ids)} tokens; the context length is {self.max_model_len}"
            )
        if self.pages_for(len(token_ids) + 1) > self.num_pages:
            raise RequestError(f"the prompt has {len(token_ids)} tokens, more than the whole KV pool holds")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the tokenizer (load_tokenizer=True)")
        if params.structured_output is not None and self.tokenizer is None:
            raise RequestError("structured output needs the tokenizer (load_tokenizer=True)")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}")
        if params.num_prior_output_tokens >= len(token_ids):
            raise RequestError(f"num_prior_output_tokens ({params.num_prior_output_tokens}) must be less than the "
                               f"prompt's {len(token_ids)} tokens")
        if params.n != 1:
            raise RequestError(f"an engine runs one sequence per request (n={params.n}): the gateway runs one "
                               "request per choice")
