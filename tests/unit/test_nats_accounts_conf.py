"""deploy/nats/accounts.conf against bus/subjects.py: every public subject exported and imported, nothing else.

The conf is read with small regexes (no server needed); tests/integration/test_nats_accounts.py runs it
on a real nats-server.
"""

from __future__ import annotations

import re
from pathlib import Path

from bus.subjects import ALL_SUBJECTS, CANCEL, GENERATE, Subject
from schemas.generate import GenerateReply, GenerateRequest
from tests.nats_conf import allowed, block, subject_matches

ACCOUNTS_CONF = Path(__file__).resolve().parents[2] / "deploy/nats/accounts.conf"
EXPORT = re.compile(r'\{\s*(service|stream):\s*"([^"]+)"([^{}]*)\}')
IMPORT = re.compile(r'\{\s*(service|stream):\s*\{\s*account:\s*(\w+),\s*subject:\s*"([^"]+)"\s*\}\s*\}')


def _concrete(subject: Subject) -> str:
    return subject.template.format(**{f: "x" for f in subject.fields})


def expected_exports(subjects: tuple[Subject, ...]) -> dict[str, tuple[str, str | None]]:
    """Subject pattern -> (export kind, response type) that KVBUS must export.

    Public events flow out (a stream export); public request-reply subjects are services, with
    ``stream`` responses where the reply is streamed; the cancel event goes in (a service, no reply).
    """
    out: dict[str, tuple[str, str | None]] = {}
    for s in subjects:
        if s.public and s.reply is None:
            out[s.wildcard()] = ("stream", None)
        elif s.public:
            out[s.wildcard()] = ("service", "stream" if s.streamed else "singleton")
        elif s is CANCEL:
            out[s.wildcard()] = ("service", "singleton")
    return out


def account_problems(text: str, subjects: tuple[Subject, ...] = ALL_SUBJECTS) -> list[str]:
    """Everything in ``text`` (an accounts.conf) that disagrees with ``subjects``; empty when all is right."""
    text = re.sub(r"#[^\n]*", "", text)
    kvbus, clients = block(text, "KVBUS {"), block(text, "CLIENTS {")
    want = expected_exports(subjects)
    problems: list[str] = []

    exports: dict[str, tuple[str, str | None]] = {}
    for kind, pattern, rest in EXPORT.findall(kvbus):
        response = re.search(r"response:\s*(\w+)", rest)
        exports[pattern] = (kind, (response.group(1) if response else "singleton") if kind == "service" else None)
    for pattern, spec in want.items():
        if exports.get(pattern) != spec:
            problems.append(f"KVBUS must export {pattern} as {spec}, has {exports.get(pattern)}")
    problems += [f"KVBUS exports {p}, which bus/subjects.py does not make public" for p in exports.keys() - want]

    imports = {(kind, pattern) for kind, account, pattern in IMPORT.findall(clients) if account == "KVBUS"}
    wanted_imports = {(kind, pattern) for pattern, (kind, _) in want.items()}
    problems += [f"CLIENTS must import {kind} {p} from KVBUS" for kind, p in wanted_imports - imports]
    problems += [f"CLIENTS imports {kind} {p}, which KVBUS should not export" for kind, p in imports - wanted_imports]

    # Within CLIENTS, a user may publish only what goes into kvbus and listen only to what comes out.
    publish, subscribe = allowed(clients, "publish"), allowed(clients, "subscribe")
    listens = [p for p in subscribe if not p.startswith("_INBOX")]
    for s in subjects:
        name, goes_in = _concrete(s), want.get(s.wildcard(), ("", None))[0] == "service"
        if any(subject_matches(p, name) for p in publish) != goes_in:
            problems.append(f"CLIENTS users {'must' if goes_in else 'must not'} publish {s.template}")
        comes_out = want.get(s.wildcard(), ("", None))[0] == "stream"
        if any(subject_matches(p, name) for p in listens) != comes_out:
            problems.append(f"CLIENTS users {'must' if comes_out else 'must not'} subscribe to {s.template}")

    # Services use every subject, and answer requests from other accounts on their _R_ reply subjects.
    svc_publish, svc_subscribe = allowed(kvbus, "publish"), allowed(kvbus, "subscribe")
    for s in subjects:
        name = _concrete(s)
        if not (any(subject_matches(p, name) for p in svc_publish)
                and any(subject_matches(p, name) for p in svc_subscribe)):
            problems.append(f"KVBUS service users must publish and subscribe to {s.template}")
    if not any(subject_matches(p, "_R_.abc.def") for p in svc_publish):
        problems.append("KVBUS service users must publish to _R_.> (replies to imported requests)")
    if not re.search(r"^\s*system_account:\s*SYS\s*$", text, re.M) or "SYS {" not in text:
        problems.append("no system account SYS")
    return problems


def test_accounts_conf_exports_and_imports_every_public_subject_and_nothing_else():
    assert account_problems(ACCOUNTS_CONF.read_text()) == []


def test_a_new_public_subject_without_an_export_is_caught():
    embed = Subject("kvbus.v1.embed", GenerateRequest, GenerateReply, "a public subject added later", public=True)
    problems = account_problems(ACCOUNTS_CONF.read_text(), ALL_SUBJECTS + (embed,))
    assert any("export kvbus.v1.embed as ('service', 'singleton')" in p for p in problems), problems
    assert any("CLIENTS must import service kvbus.v1.embed" in p for p in problems), problems


def test_a_streamed_subject_exported_as_singleton_is_caught():
    text = ACCOUNTS_CONF.read_text()
    line = re.search(r'\{ service: "kvbus\.v1\.generate",\s*response: stream', text).group(0)
    problems = account_problems(text.replace(line, line.replace("stream", "singleton")))
    assert problems == [f"KVBUS must export {GENERATE.template} as ('service', 'stream'), "
                        f"has ('service', 'singleton')"]


def test_an_internal_subject_exported_or_granted_to_clients_is_caught():
    text = ACCOUNTS_CONF.read_text()
    leaky = text.replace('{ stream: "kvbus.v1.kv_events.*" }', '{ stream: "kvbus.v1.kv_events.*" }\n'
                         '      { stream: "kvbus.v1.workers.heartbeat" }', 1)
    leaky = leaky.replace('subscribe: { allow: ["_INBOX.>", ', 'subscribe: { allow: ["_INBOX.>", "kvbus.v1.>", ', 1)
    problems = account_problems(leaky)
    assert "KVBUS exports kvbus.v1.workers.heartbeat, which bus/subjects.py does not make public" in problems
    assert "CLIENTS users must not subscribe to kvbus.v1.router.route" in problems
