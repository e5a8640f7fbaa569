"""Reasoning parsers: a model's text -> reasoning_content and content, chosen by name.

Add one: 1. a class with ``feed(text) -> (reasoning, content)`` and ``finish() -> (reasoning, content)``
in a module of its own (see ``think.py``), 2. register it here. ``--reasoning-parser NAME`` on the
gateway turns it on for chat requests.
"""

from services.plugins import Registry

REASONING_PARSERS = Registry(
    "reasoning parser",
    {
        "deepseek_r1": "services.agent.reasoning.think:DeepSeekR1ReasoningParser",
        "qwen3": "services.agent.reasoning.think:Qwen3ReasoningParser",
    },
    docs={
        "deepseek_r1": "reasoning from the start to </think> (the template opens <think>); no </think>: "
                       "all reasoning",
        "qwen3": "reasoning only inside a <think>...</think> that opens the reply (enable_thinking=false: "
                 "none)",
    },
)
