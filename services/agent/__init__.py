"""What agents need beyond plain text (docs/agents.md): tools, tool calls, reasoning, structured output.

- ``tools``: tools and tool_choice checked (JSON Schema meta-schema), the history's calls matched.
- ``tool_prompt``: the fallback prompt format for chat templates that take no tools.
- ``tool_parsers``: model output -> tool calls, one module per format, chosen by name (TOOL_PARSERS).
- ``reasoning``: ``<think>...</think>`` -> reasoning_content, chosen by name (REASONING_PARSERS).
- ``output``: the two parsers over one stream of text, as the gateway runs them for HTTP and NATS alike.
- ``grammar``: constrained decoding through llguidance: compile with bounds, cache, per-request matchers.

Nothing here imports the bus or an actor; ``grammar`` is the only module that imports llguidance or torch.
"""
