"""Per-row logit work between the model's forward pass and sampling (issue 28's engine half).

``chain.LogitsProcessors`` is applied by the model runner to the rows that ask for it: penalties
(``penalties.py``), ``logit_bias``, ``min_tokens`` and the grammar masks of structured output
(``structured.py``). Each request's state between steps is a ``state.LogitsState`` on its sequence,
made by the intake (``attach``) only for requests that ask for something: the others cost nothing.
docs/engine.md ("The logits-processor chain") and docs/agents.md describe how it composes with
speculative decoding and migration.
"""

from services.engine.logits_processors.chain import LogitsProcessors, PendingMasks
from services.engine.logits_processors.state import LogitsState, wants_logit_work
from services.engine.logits_processors.structured import GrammarService, GrammarSlot

__all__ = ["GrammarService", "GrammarSlot", "LogitsProcessors", "LogitsState", "PendingMasks", "wants_logit_work"]
