"""Traces without Jaeger: the local OTLP/HTTP receiver of ``kvbus up --trace`` and ``kvbus trace``.

- ``spans.py``: one plain record per span, from OTLP protobuf, the receiver's file or Jaeger;
- ``receiver.py``: the OTLP/HTTP receiver writing spans to a JSON-lines file;
- ``jaeger.py``: a trace read back from Jaeger's query API;
- ``waterfall.py``: a trace drawn in the terminal.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_file() -> Path:
    """Where ``kvbus up --trace`` writes spans and ``kvbus trace`` reads them ($KVBUS_TRACE_FILE, else
    ~/.cache/kvbus/traces.jsonl)."""
    override = os.environ.get("KVBUS_TRACE_FILE")
    return Path(override) if override else Path.home() / ".cache" / "kvbus" / "traces.jsonl"
