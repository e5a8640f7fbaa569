"""The published wire contract: a JSON Schema per public subject, and one AsyncAPI 3.0 document for them all.

Both are generated from the subjects table (:mod:`bus.subjects`), the Structs it names, the error
taxonomy (:mod:`bus.errors`) and the headers (:mod:`bus.contract`): nothing here is a hand-kept copy.
The AsyncAPI document describes kvbus as the application: it *receives* requests and *sends* replies,
chunks, probes and events; a client does the mirror image.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

import bus.subjects
from bus.contract import (
    CALLER_SUBJECTS,
    ERROR_HEADERS,
    PROBE_OPT_IN,
    REPLY_HEADERS,
    REQUEST_HEADERS,
    REQUEST_ID,
    REQUIRED_ON_ERROR,
    SEQ,
    STREAM,
    WIRE_VERSION,
    Header,
)
from bus.subjects import ALL_SUBJECTS, Subject
from bus.transport import CHUNK, END, PROBE, PROBE_ACCEPT, PROBE_ALIVE, PROBE_GONE

ASYNCAPI_FILE = "asyncapi.json"


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
                         "probes (Kvbus-Stream: probe) come only if the request asked with Kvbus-Probe: accept")
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
    """Write one JSON Schema file per public subject and the AsyncAPI document; returns their paths."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for subject in ALL_SUBJECTS:
        if not subject.public:
            continue
        path = out / (subject.template.replace("{", "").replace("}", "") + ".json")
        path.write_text(json.dumps(subject_schema(subject), indent=2, sort_keys=True) + "\n")
        paths.append(path)
    path = out / ASYNCAPI_FILE
    path.write_text(json.dumps(asyncapi_document(), indent=2, sort_keys=True) + "\n")
    paths.append(path)
    return paths


# --- AsyncAPI ------------------------------------------------------------------------------------------
def contract_subjects() -> tuple[Subject, ...]:
    """Every subject a client of another language deals with: the public ones and the caller's own."""
    return tuple(s for s in ALL_SUBJECTS if s.public) + CALLER_SUBJECTS


def subject_constants() -> dict[str, str]:
    """Template -> the name of its constant in bus/subjects.py (``kvbus.v1.generate`` -> ``GENERATE``)."""
    return {v.template: k for k, v in vars(bus.subjects).items() if isinstance(v, Subject)}


def _camel(constant: str) -> str:
    first, *rest = constant.lower().split("_")
    return first + "".join(word.capitalize() for word in rest)


def _draft07(schema):
    """msgspec writes JSON Schema 2020-12; AsyncAPI's default schema format is a draft-07 superset,
    whose tuples are ``items: [...]`` (an array-like Struct's ``prefixItems``)."""
    if isinstance(schema, list):
        return [_draft07(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _draft07(v) for k, v in schema.items()}
    if "prefixItems" in out:
        rest = out.pop("items", None)
        out["items"] = out.pop("prefixItems")
        if rest is not None:
            out["additionalItems"] = rest
    return out


def _headers(headers: tuple[Header, ...], required: tuple[Header, ...] = (),
             only: dict[Header, str] | None = None) -> dict:
    only = only or {}
    return {
        "type": "object",
        "properties": {h.name: h.schema(only.get(h)) for h in headers},
        "required": [h.name for h in headers if h in required],
    }


def _message(name: str, title: str, summary: str, headers: dict, payload: str | None = None) -> dict:
    message = {
        "name": name,
        "title": title,
        "summary": summary,
        "contentType": "application/json",
        "headers": headers,
        "correlationId": {"description": "Every message of one request carries its id.",
                          "location": f"$message.header#/{REQUEST_ID.name}"},
    }
    if payload is not None:
        message["payload"] = {"$ref": f"#/components/schemas/{payload}"}
    return message


def _shared_messages() -> dict[str, dict]:
    stream_end = _headers(REPLY_HEADERS + (STREAM, SEQ), (REQUEST_ID, STREAM, SEQ), {STREAM: END})
    probe = _headers((REQUEST_ID, STREAM), (REQUEST_ID, STREAM), {STREAM: PROBE})
    return {
        "streamEnd": _message("StreamEnd", "End of a stream", "The streamed reply is complete (empty body).",
                              stream_end),
        "error": _message("Error", "Error", "The request failed: empty body, the reason in the headers. It "
                          "ends a stream too.", _headers(ERROR_HEADERS, REQUIRED_ON_ERROR)),
        "probe": _message("Probe", "Interest probe", "Sent only to a caller whose request carried "
                          f"{PROBE_OPT_IN.name}: {PROBE_ACCEPT}. "
                          "A NATS request with an empty body: skip it, or answer on its reply subject. No "
                          "answer means alive; 'no responders' (the caller's connection is gone) cancels.",
                          probe),
        "probeAlive": _message("ProbeAlive", "Still reading", "An answer to a probe: the stream is still read.",
                               _headers((STREAM,), (STREAM,), {STREAM: PROBE_ALIVE})),
        "probeGone": _message("ProbeGone", "Gone", "An answer to a probe: nobody reads the stream; the server "
                              "cancels it and frees what it held.",
                              _headers((STREAM,), (STREAM,), {STREAM: PROBE_GONE})),
    }


def _parameters(subject: Subject) -> dict:
    return {f: {"description": f"The {f.replace('_', ' ')} (one subject token: no '.', '*', '>' or spaces)."}
            for f in subject.fields}


def _info() -> dict:
    return {
        "title": "kvbus NATS API",
        "version": WIRE_VERSION,
        "description": (
            "Every subject carries its version in its name (kvbus.v1.*). Send a JSON request on a subject "
            "with a reply subject (a NATS inbox); the reply comes to that inbox: one message, or for a "
            "streamed subject chunks (Kvbus-Stream: chunk, Kvbus-Seq 0, 1, ...) and an empty end message "
            "(Kvbus-Stream: end). An error is an empty body with Kvbus-Error-Code (a closed set) and "
            "Kvbus-Error-Message, and ends a stream (when no service listens on a subject, nats-server itself "
            "answers on your inbox with an empty status message, header Status: 503, 'no responders'). "
            "Nothing else reaches your inbox unless you ask: with "
            f"{PROBE_OPT_IN.name}: {PROBE_ACCEPT} on a streamed request the server "
            "probes it (Kvbus-Stream: probe) so that a caller that vanished has its work cancelled. Without "
            "it, Kvbus-Timeout (seconds you will wait), a CancelEvent on kvbus.v1.cancel and the services' "
            "own time limits end work you abandoned. Versioning: within v1 only additive changes happen "
            "(new optional fields, which readers must ignore; new subjects; new error detail in messages); "
            "removing or retyping a field, a new required field, a new value in a closed set, a removed "
            "subject or a changed header set comes as v2 subjects beside v1 (docs/architecture.md)."
        ),
    }


def asyncapi_document() -> dict:
    """The AsyncAPI 3.0 document of every subject in :func:`contract_subjects`."""
    subjects = contract_subjects()
    types = list(dict.fromkeys(t for s in subjects for t in (s.request, s.reply) if t is not None))
    _, schemas = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    messages = _shared_messages()
    channels: dict[str, dict] = {
        "probeAnswer": {"address": None, "title": "A probe's reply subject",
                        "description": "The reply subject of a probe (a NATS request): answer there, or not.",
                        "messages": {"alive": {"$ref": "#/components/messages/probeAlive"},
                                     "gone": {"$ref": "#/components/messages/probeGone"}}},
    }
    operations: dict[str, dict] = {}
    constants = subject_constants()
    for subject in subjects:
        cid = _camel(constants[subject.template])
        x_kvbus = {"version": WIRE_VERSION, "streamed": subject.streamed, "queue_group": subject.queue}
        channel = {"address": subject.template, "title": subject.template, "description": subject.description,
                   "parameters": _parameters(subject), "x-kvbus": x_kvbus}
        request_headers = REQUEST_HEADERS + ((PROBE_OPT_IN,) if subject.streamed else ())
        kind = "request" if subject.reply is not None else "event"
        messages[f"{cid}{kind.capitalize()}"] = _message(
            subject.request.__name__, f"{subject.template} {kind}", subject.description,
            _headers(request_headers), subject.request.__name__)
        channel["messages"] = {kind: {"$ref": f"#/components/messages/{cid}{kind.capitalize()}"}}
        if not channel["parameters"]:
            del channel["parameters"]
        channels[cid] = channel
        own = {"$ref": f"#/channels/{cid}/messages/{kind}"}
        if subject.reply is None:  # an event: a public one flows out of kvbus, the caller's own flows in
            action = "receive" if subject in CALLER_SUBJECTS else "send"
            operations[cid] = {"action": action, "channel": {"$ref": f"#/channels/{cid}"}, "title": subject.template,
                               "summary": subject.description, "messages": [own], "x-kvbus": x_kvbus}
            continue
        reply_channel = f"{cid}Reply"
        if subject.streamed:
            messages[f"{cid}Chunk"] = _message(
                subject.reply.__name__, f"{subject.template} chunk", "One piece of the streamed reply.",
                _headers(REPLY_HEADERS + (STREAM, SEQ), (REQUEST_ID, STREAM, SEQ), {STREAM: CHUNK}),
                subject.reply.__name__)
            replies = {"chunk": f"{cid}Chunk", "end": "streamEnd", "error": "error", "probe": "probe"}
        else:
            messages[f"{cid}Reply"] = _message(
                subject.reply.__name__, f"{subject.template} reply", "The one reply.",
                _headers(REPLY_HEADERS, (REQUEST_ID,)), subject.reply.__name__)
            replies = {"reply": f"{cid}Reply", "error": "error"}
        channels[reply_channel] = {
            "address": None, "title": f"{subject.template} reply inbox",
            "description": "The caller's inbox: the reply subject it sent the request with.",
            "messages": {k: {"$ref": f"#/components/messages/{m}"} for k, m in replies.items()}}
        answers = [k for k in replies if k != "probe"]
        operations[cid] = {
            "action": "receive", "channel": {"$ref": f"#/channels/{cid}"}, "title": subject.template,
            "summary": subject.description,
            "description": ("Streamed: chunks, then an end message or an error." if subject.streamed
                            else "One reply, or an error."),
            "messages": [own], "x-kvbus": x_kvbus,
            "reply": {"channel": {"$ref": f"#/channels/{reply_channel}"},
                      "messages": [{"$ref": f"#/channels/{reply_channel}/messages/{k}"} for k in answers]}}
        if subject.streamed:
            operations[f"{cid}Probe"] = {
                "action": "send", "channel": {"$ref": f"#/channels/{reply_channel}"},
                "title": f"{subject.template} interest probe",
                "summary": f"Only when the request carried {PROBE_OPT_IN.name}: at most every probe interval "
                           "(1 s by default) while the stream runs.",
                "messages": [{"$ref": f"#/channels/{reply_channel}/messages/probe"}],
                "reply": {"channel": {"$ref": "#/channels/probeAnswer"},
                          "messages": [{"$ref": "#/channels/probeAnswer/messages/alive"},
                                       {"$ref": "#/channels/probeAnswer/messages/gone"}]}}
    return {
        "asyncapi": "3.0.0",
        "id": f"urn:kvbus:wire:{WIRE_VERSION}",
        "info": _info(),
        "defaultContentType": "application/json",
        "servers": {"local": {"host": "127.0.0.1:4222", "protocol": "nats",
                              "description": "kvbus up's nats-server (its NATS URL is printed at start)"}},
        "channels": channels,
        "operations": operations,
        "components": {"schemas": _draft07(schemas), "messages": messages},
    }

