"""Tool-call parsers: a model's text -> content and tool calls, one module per output format.

Add one: 1. subclass :class:`services.agent.tool_parsers.base.ToolParser` in a module of its own
(``feed``/``finish`` over text deltas; the base class does the bookkeeping), 2. register it here
(or from your own package: ``TOOL_PARSERS.register("mine", "pkg.module:MyParser", doc=...)``).
``kvbus serve gateway --tool-call-parser NAME`` picks one.
"""

from services.plugins import Registry

TOOL_PARSERS = Registry(
    "tool-call parser",
    {
        "hermes": "services.agent.tool_parsers.hermes:HermesToolParser",
        "llama3_json": "services.agent.tool_parsers.llama3_json:Llama3JsonToolParser",
    },
    docs={
        "hermes": "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, Qwen2.5/Qwen3, "
                  "and kvbus's fallback prompt for templates without tools)",
        "llama3_json": "{\"name\": ..., \"parameters\": {...}} as the whole reply, optionally after "
                       "<|python_tag|>, several separated by ';' (Llama 3.1/3.2/3.3)",
    },
)
DEFAULT_TOOL_PARSER = "hermes"
"""The default model (SmolLM2) has no tool template: kvbus's fallback prompt teaches it Hermes' format."""
