"""JSON Schema for every public subject, so other languages can generate clients."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from bus.subjects import ALL_SUBJECTS, Subject


def subject_schema(subject: Subject) -> dict:
    types = [subject.request] + ([subject.reply] if subject.reply is not None else [])
    (request_schema, *reply_schema), components = msgspec.json.schema_components(
        types, ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": subject.template,
        "description": subject.description,
        "x-kvbus": {
            "subject": subject.template,
            "queue_group": subject.queue,
            "streamed": subject.streamed,
            "content_type": subject.encoding.value,
            "reply_is": ("stream of chunks ended by an empty message with header Kvbus-Stream: end; "
                         "skip messages with Kvbus-Stream: probe (a liveness request you may answer)")
            if subject.streamed else "one message",
            "errors": "empty body with headers Kvbus-Error-Code and Kvbus-Error-Message",
        },
        "type": "object",
        "properties": {
            "request": request_schema,
            **({"reply": reply_schema[0]} if reply_schema else {}),
        },
        "$defs": components,
    }


def export_schemas(directory: str | Path) -> list[Path]:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for subject in ALL_SUBJECTS:
        if not subject.public:
            continue
        path = out / (subject.template.replace("{", "").replace("}", "") + ".json")
        path.write_text(json.dumps(subject_schema(subject), indent=2, sort_keys=True) + "\n")
        paths.append(path)
    return paths
