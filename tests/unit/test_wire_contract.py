"""The published wire contract never breaks within a version (docs/architecture.md, "Versioning the wire").

``kvbus schemas export`` is compared with the committed snapshot in tests/wire_snapshot/: a removed
or retyped field, a new required field, a new value in a closed set (an enum, an error code, a
``Kvbus-Stream`` frame), a removed subject, a changed header set or a changed reply shape fails as
breaking: that needs ``v2`` subjects beside ``v1``. An additive change (a new optional field, a new
subject) is allowed; the snapshot is then refreshed on purpose with

    rm -rf tests/wire_snapshot && .venv/bin/kvbus schemas export tests/wire_snapshot
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from bus.contract import STREAM, WIRE_VERSION
from bus.errors import ErrorCode
from bus.subjects import ALL_SUBJECTS, CANCEL, PREFIX
from schemas.export import ASYNCAPI_FILE, asyncapi_document, contract_subjects, export_schemas, subject_constants

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "tests" / "wire_snapshot"
REFRESH = "rm -rf tests/wire_snapshot && .venv/bin/kvbus schemas export tests/wire_snapshot"
CONSTRAINTS = ("pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
               "minLength", "maxLength", "maxItems", "additionalItems")
PROSE = {"description", "title", "summary"}


# --- the comparison -----------------------------------------------------------------------------------
class Changes:
    def __init__(self) -> None:
        self.breaking: list[str] = []
        self.additive: list[str] = []


def _resolve(schema: dict, root: dict) -> dict:
    while isinstance(schema, dict) and "$ref" in schema:
        schema = root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if kind else set()


def _values(schema: dict) -> set | None:
    """The closed set of values a schema allows, if it is one (enum, const, oneOf of consts)."""
    if "enum" in schema:
        return set(map(json.dumps, schema["enum"]))
    if "const" in schema:
        return {json.dumps(schema["const"])}
    alternatives = schema.get("oneOf")
    if alternatives and all("const" in a for a in alternatives):
        return {json.dumps(a["const"]) for a in alternatives}
    return None


def compare_schemas(old: dict, new: dict, where: str, old_root: dict, new_root: dict, out: Changes,
                    seen: set | None = None) -> None:
    seen = set() if seen is None else seen
    old, new = _resolve(old, old_root), _resolve(new, new_root)
    if (id(old), id(new)) in seen:
        return
    seen.add((id(old), id(new)))
    if _types(old) != _types(new):
        out.breaking.append(f"{where}: type {sorted(_types(old))} became {sorted(_types(new))}")
        return
    old_values, new_values = _values(old), _values(new)
    if old_values != new_values:
        if old_values is None or new_values is None:
            out.breaking.append(f"{where}: a closed set of values appeared or went")
        else:
            if old_values - new_values:
                out.breaking.append(f"{where}: values removed from a closed set: {sorted(old_values - new_values)}")
            if new_values - old_values:
                out.breaking.append(f"{where}: new values in a closed set: {sorted(new_values - old_values)}")
    for key in CONSTRAINTS:
        if old.get(key) != new.get(key) and not isinstance(old.get(key), dict):
            out.breaking.append(f"{where}: {key} {old.get(key)!r} became {new.get(key)!r}")
    if "default" in old and not isinstance(old["default"], (dict, list)) and old["default"] != new.get("default"):
        out.breaking.append(f"{where}: default {old['default']!r} became {new.get('default')!r}")
    if old.get("additionalProperties", True) is not False and new.get("additionalProperties", True) is False:
        out.breaking.append(f"{where}: unknown fields, accepted before, are now refused")
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    old_required, new_required = set(old.get("required", ())), set(new.get("required", ()))
    for name, schema in old_props.items():
        if name not in new_props:
            out.breaking.append(f"{where}.{name}: removed")
        else:
            compare_schemas(schema, new_props[name], f"{where}.{name}", old_root, new_root, out, seen)
    for name in new_props.keys() - old_props.keys():
        if name in new_required:
            out.breaking.append(f"{where}.{name}: new and required")
        else:
            out.additive.append(f"{where}.{name}: new optional field")
    for name in (new_required - old_required) & old_props.keys():
        out.breaking.append(f"{where}.{name}: became required")
    _compare_items(old, new, where, old_root, new_root, out, seen)
    for key in ("anyOf", "oneOf", "allOf"):
        old_alts, new_alts = old.get(key), new.get(key)
        if old_alts is None and new_alts is None or _values(old) is not None:
            continue
        if old_alts is None or new_alts is None or len(old_alts) != len(new_alts):
            out.breaking.append(f"{where}: the alternatives ({key}) changed")
            continue
        for i, (a, b) in enumerate(zip(old_alts, new_alts)):
            compare_schemas(a, b, f"{where}|{i}", old_root, new_root, out, seen)


def _compare_items(old: dict, new: dict, where: str, old_root: dict, new_root: dict, out: Changes,
                   seen: set) -> None:
    old_items, new_items = old.get("items"), new.get("items")
    if isinstance(old_items, list) and isinstance(new_items, list):  # a tuple (an array-like Struct)
        for i, schema in enumerate(old_items):
            if i >= len(new_items):
                out.breaking.append(f"{where}[{i}]: removed")
            else:
                compare_schemas(schema, new_items[i], f"{where}[{i}]", old_root, new_root, out, seen)
        if len(new_items) > len(old_items):
            out.additive.append(f"{where}: {len(new_items) - len(old_items)} new optional tuple item(s)")
        if new.get("minItems", 0) > old.get("minItems", 0):
            out.breaking.append(f"{where}: minItems {old.get('minItems', 0)} became {new['minItems']}")
    elif isinstance(old_items, dict) and isinstance(new_items, dict):
        compare_schemas(old_items, new_items, f"{where}[]", old_root, new_root, out, seen)
    elif old_items is not None or new_items is not None:
        out.breaking.append(f"{where}: the items changed shape")


def _compare_headers(old: dict, new: dict, where: str, out: Changes) -> None:
    old_props, new_props = old.get("properties", {}), new.get("properties", {})
    if old_props.keys() != new_props.keys():
        out.breaking.append(f"{where}: header set {sorted(old_props)} became {sorted(new_props)}")
    if set(old.get("required", ())) != set(new.get("required", ())):
        out.breaking.append(f"{where}: required headers {sorted(old.get('required', ()))} became "
                            f"{sorted(new.get('required', ()))}")
    for name in old_props.keys() & new_props.keys():
        a, b = old_props[name], new_props[name]
        if _values(a) != _values(b) or a.get("pattern") != b.get("pattern"):
            out.breaking.append(f"{where} {name}: values {sorted(_values(a) or [a.get('pattern')])} became "
                                f"{sorted(_values(b) or [b.get('pattern')])}")


def compare_documents(old: dict, new: dict) -> Changes:
    """What changed from the ``old`` AsyncAPI document to the ``new`` one, breaking and additive."""
    out = Changes()
    new_by_address = {c["address"]: c for c in new["channels"].values() if c.get("address")}
    for channel in old["channels"].values():
        address = channel.get("address")
        if address and address not in new_by_address:
            out.breaking.append(f"subject {address}: removed")
        elif address and channel.get("x-kvbus") != new_by_address[address].get("x-kvbus"):
            out.breaking.append(f"subject {address}: {channel.get('x-kvbus')} became "
                                f"{new_by_address[address].get('x-kvbus')}")
    old_addresses = {c.get("address") for c in old["channels"].values()}
    out.additive += [f"subject {a}: new" for a in new_by_address.keys() - old_addresses]
    for op_id, op in old["operations"].items():
        new_op = new["operations"].get(op_id)
        if new_op is None:
            out.breaking.append(f"operation {op_id}: removed")
            continue
        for key in ("action", "channel", "messages", "reply"):
            if op.get(key) != new_op.get(key):
                out.breaking.append(f"operation {op_id}: its {key} changed")
    new_messages = new["components"]["messages"]
    for name, message in old["components"]["messages"].items():
        if name not in new_messages:
            out.breaking.append(f"message {name}: removed")
            continue
        new_message = new_messages[name]
        _compare_headers(message.get("headers", {}), new_message.get("headers", {}), f"message {name}", out)
        if ("payload" in message) != ("payload" in new_message):
            out.breaking.append(f"message {name}: a body appeared or went")
        elif "payload" in message:
            compare_schemas(message["payload"], new_message["payload"], message["name"], old, new, out)
    return out


def _without_prose(value):
    if isinstance(value, dict):
        return {k: _without_prose(v) for k, v in value.items() if k not in PROSE}
    if isinstance(value, list):
        return [_without_prose(v) for v in value]
    return value


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wire")
    export_schemas(out)
    return out


@pytest.fixture(scope="module")
def snapshot() -> dict:
    return json.loads((SNAPSHOT / ASYNCAPI_FILE).read_text())


# --- the contract against its snapshot ----------------------------------------------------------------
def test_no_breaking_change_against_the_snapshot(exported, snapshot):
    changes = compare_documents(snapshot, json.loads((exported / ASYNCAPI_FILE).read_text()))
    assert not changes.breaking, (
        "the wire contract changed in a way that breaks clients of kvbus.v1 (docs/architecture.md, "
        "'Versioning the wire': keep v1 as it is and add v2 subjects instead):\n  " + "\n  ".join(changes.breaking))


def test_the_snapshot_is_current(exported):
    """Additive changes are allowed within v1, but on purpose: the snapshot then takes them in."""
    want = {p.name: _without_prose(json.loads(p.read_text())) for p in SNAPSHOT.glob("*.json")}
    got = {p.name: _without_prose(json.loads(p.read_text())) for p in exported.glob("*.json")}
    changes = compare_documents(want[ASYNCAPI_FILE], got[ASYNCAPI_FILE])
    stale = sorted(name for name in want.keys() | got.keys() if want.get(name) != got.get(name))
    assert not stale, (f"the exported contract differs from tests/wire_snapshot in {stale}; additive changes "
                       f"(allowed within v1): {changes.additive or 'none found'}; breaking: "
                       f"{changes.breaking or 'none'}. If that was meant, refresh it: {REFRESH}")


# --- the comparison catches what it must ----------------------------------------------------------------
def _doc() -> dict:
    return copy.deepcopy(asyncapi_document())


def _edit_chunk(doc: dict) -> dict:
    return doc["components"]["schemas"]["GenerateChunk"]


BREAKING_EDITS = {
    "a removed field": lambda d: _edit_chunk(d)["properties"].pop("text"),
    "a retyped field": lambda d: _edit_chunk(d)["properties"]["text"].update(type="integer"),
    "a new required field": lambda d: (_edit_chunk(d)["properties"].update(extra={"type": "string"}),
                                       _edit_chunk(d).setdefault("required", []).append("extra")),
    "a field that became required": lambda d: _edit_chunk(d).setdefault("required", []).append("text"),
    "a removed subject": lambda d: d["channels"].pop("generateOnce"),
    "a new header": lambda d: d["components"]["messages"]["generateChunk"]["headers"]["properties"].update(
        {"Kvbus-New": {"type": "string"}}),
    "a removed header": lambda d: d["components"]["messages"]["error"]["headers"]["properties"].pop(
        "Kvbus-Retry-After"),
    "a new error code": lambda d: d["components"]["messages"]["error"]["headers"]["properties"][
        "Kvbus-Error-Code"]["oneOf"].append({"const": "teapot"}),
    "a new value in a schema's enum": lambda d: d["components"]["schemas"]["GenerateChunk"]["properties"][
        "finish_reason"]["anyOf"][0]["enum"].append("bored"),
    "a stream that became a single reply": lambda d: d["channels"]["generate"]["x-kvbus"].update(streamed=False),
    "a changed reply shape": lambda d: d["operations"]["generate"]["reply"]["messages"].pop(),
    "a changed default": lambda d: d["components"]["schemas"]["GenerateRequest"]["properties"][
        "stream_interval"].update(default=4),
}


@pytest.mark.parametrize("edit", BREAKING_EDITS, ids=list(BREAKING_EDITS))
def test_the_comparison_finds_every_kind_of_breaking_change(edit):
    old, new = _doc(), _doc()
    BREAKING_EDITS[edit](new)
    assert compare_documents(old, new).breaking, edit


def test_additive_changes_are_not_breaking():
    old, new = _doc(), _doc()
    _edit_chunk(new)["properties"]["reasoning_tokens"] = {"type": "integer", "default": 0}
    new["channels"]["fresh"] = {"address": f"{PREFIX}.fresh", "x-kvbus": {}}
    new["components"]["messages"]["error"]["headers"]["properties"]["Kvbus-Error-Code"]["description"] = "reworded"
    changes = compare_documents(old, new)
    assert not changes.breaking, changes.breaking
    assert sorted(changes.additive) == ["GenerateChunk.reasoning_tokens: new optional field",
                                        f"subject {PREFIX}.fresh: new"]
    assert not compare_documents(old, _doc()).additive  # and nothing at all when nothing changed


# --- the document comes from the code --------------------------------------------------------------------
def test_the_document_is_generated_from_the_subjects_table_and_the_error_taxonomy():
    doc = asyncapi_document()
    addresses = {c["address"] for c in doc["channels"].values() if c.get("address")}
    assert addresses == {s.template for s in ALL_SUBJECTS if s.public} | {CANCEL.template}
    assert doc["info"]["version"] == WIRE_VERSION and all(a.startswith(f"kvbus.{WIRE_VERSION}.") for a in addresses)
    error_headers = doc["components"]["messages"]["error"]["headers"]["properties"]
    assert _values(error_headers["Kvbus-Error-Code"]) == {json.dumps(c.value) for c in ErrorCode}
    frames = {json.dumps(v) for v in STREAM.values}
    for subject in contract_subjects():
        op = doc["operations"][next(k for k, c in doc["channels"].items() if c.get("address") == subject.template)]
        request = doc["components"]["messages"][_message_key(doc, op["messages"][0])]
        assert request["payload"]["$ref"].endswith("/" + subject.request.__name__)
        assert ("Kvbus-Probe" in request["headers"]["properties"]) == subject.streamed, subject.template
        if subject.streamed:
            replies = {r["$ref"].rsplit("/", 1)[-1] for r in op["reply"]["messages"]}
            channel = op["channel"]["$ref"].removeprefix("#/channels/")
            assert replies == {"chunk", "end", "error"} and f"{channel}Probe" in doc["operations"]
    seen_frames = {json.dumps(h["properties"]["Kvbus-Stream"]["const"])
                   for h in (m["headers"] for m in doc["components"]["messages"].values())
                   if "Kvbus-Stream" in h["properties"]}
    assert seen_frames == frames  # every frame value has its message, and no other value is sent


def _message_key(doc: dict, ref: dict) -> str:
    """The components/messages key a channel message reference ends at."""
    channel, _, name = ref["$ref"].removeprefix("#/channels/").partition("/messages/")
    return doc["channels"][channel]["messages"][name]["$ref"].rsplit("/", 1)[-1]


def test_the_architecture_doc_lists_every_subject_with_its_constant_and_schema_module():
    """docs/architecture.md's subject table: any subject, its Python constant and its schema module in one step."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    constants = subject_constants()
    for subject in ALL_SUBJECTS:
        row = next((line for line in text.splitlines() if line.startswith(f"| `{subject.template}`")), None)
        assert row is not None, f"{subject.template} has no row in docs/architecture.md's subject table"
        assert f"`{constants[subject.template]}`" in row, (subject.template, row)
        module = subject.request.__module__
        assert f"`{module}`" in row, (subject.template, module, row)
        assert re.search(rf"`{subject.request.__name__}`", row), (subject.template, row)
