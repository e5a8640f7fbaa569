"""Every subject kvbus uses, with its request type, reply type and queue group.

This table is the only place a subject string is written. Subjects are
versioned (``kvbus.v1....``); per-worker subjects carry the worker id as a
``{worker_id}`` field that :meth:`Subject.format` fills in.
"""

from __future__ import annotations

import dataclasses
import string

from bus.codec import Encoding
from schemas.common import (
    CancelEvent,
    EchoChunk,
    EchoReply,
    EchoRequest,
    HealthReply,
    HealthRequest,
)
from schemas.draft import DraftCloseEvent, DraftProposeReply, DraftProposeRequest
from schemas.generate import GenerateChunk, GenerateReply, GenerateRequest
from schemas.kv_store import (
    KVDumpReply,
    KVDumpRequest,
    KVEventBatchEvent,
    KVStoreAttachReply,
    KVStoreAttachRequest,
    KVStoreCommitEvent,
    KVStoreFetchReply,
    KVStoreFetchRequest,
    KVStoreLeaseReply,
    KVStoreLeaseRequest,
    KVStoreLookupReply,
    KVStoreLookupRequest,
    KVStoreOfferReply,
    KVStoreOfferRequest,
    KVStorePutReply,
    KVStorePutRequest,
    KVStoreTouchEvent,
)
from schemas.transfer import KVChunkEvent
from schemas.worker import (
    PrefillChunk,
    PrefillRequest,
    RouteReply,
    RouteRequest,
    TokenChunk,
    WorkerGenerateRequest,
    WorkerHeartbeatEvent,
)
from schemas.tokenizer import (
    ChatTemplateReply,
    ChatTemplateRequest,
    DecodeReply,
    DecodeRequest,
    EncodeReply,
    EncodeRequest,
    TokenizerInfoReply,
    TokenizerInfoRequest,
)

PREFIX = "kvbus.v1"


@dataclasses.dataclass(frozen=True)
class Subject:
    """One subject: how it is named, what it carries and who shares its load."""

    template: str
    request: type
    reply: type | None
    """Reply type; for a streamed subject the type of each chunk; None for events."""
    description: str
    queue: str | None = None
    """Queue group: replicas of a service split the load. None: every subscriber gets it."""
    encoding: Encoding = Encoding.JSON
    streamed: bool = False
    public: bool = False
    """Public subjects speak JSON and get an exported JSON Schema."""

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f for _, f, _, _ in string.Formatter().parse(self.template) if f)

    def format(self, **params: str) -> str:
        if not self.fields:
            return self.template
        missing = set(self.fields) - params.keys()
        if missing:
            raise ValueError(f"subject {self.template} needs {sorted(missing)}")
        for name, value in params.items():
            if not value or any(c in value for c in ". *>\t\r\n"):
                raise ValueError(f"bad subject token {name}={value!r}")
        return self.template.format(**params)

    def wildcard(self, **fixed: str) -> str:
        """The subject with every field not in ``fixed`` replaced by ``*``.

        ``KV_CHUNK.wildcard(worker_id="decode-0")`` is every transfer to one worker.
        """
        self.format(**{f: fixed.get(f, "x") for f in self.fields})  # validates the fixed values
        return self.template.format(**{f: fixed.get(f, "*") for f in self.fields})


# --- every service --------------------------------------------------------------------
HEALTH = Subject(
    f"{PREFIX}.health.{{role}}",
    HealthRequest,
    HealthReply,
    "Readiness of any replica of a role (every replica answers; request takes the first).",
    public=True,
)
WORKER_HEALTH = Subject(
    f"{PREFIX}.health.{{role}}.{{worker_id}}",
    HealthRequest,
    HealthReply,
    "Readiness of one worker.",
    public=True,
)
CANCEL = Subject(
    f"{PREFIX}.cancel",
    CancelEvent,
    None,
    "A caller abandoned a streamed request: every server drops its work for it.",
)
DEBUG_ECHO = Subject(
    f"{PREFIX}.debug.echo",
    EchoRequest,
    EchoReply,
    "Echo the payload (tests and bus benchmarks).",
    queue="debug",
)
DEBUG_STREAM = Subject(
    f"{PREFIX}.debug.stream",
    EchoRequest,
    EchoChunk,
    "Stream the payload back `count` times (tests and bus benchmarks).",
    queue="debug",
    streamed=True,
)

# --- tokenizer ------------------------------------------------------------------------
TOKENIZER_ENCODE = Subject(
    f"{PREFIX}.tokenizer.encode",
    EncodeRequest,
    EncodeReply,
    "Text to token ids.",
    queue="tokenizer",
    public=True,
)
TOKENIZER_DECODE = Subject(
    f"{PREFIX}.tokenizer.decode",
    DecodeRequest,
    DecodeReply,
    "Token ids to text.",
    queue="tokenizer",
    public=True,
)
TOKENIZER_CHAT = Subject(
    f"{PREFIX}.tokenizer.chat",
    ChatTemplateRequest,
    ChatTemplateReply,
    "Apply the model's chat template to OpenAI-style messages; returns prompt text and ids.",
    queue="tokenizer",
    public=True,
)
TOKENIZER_INFO = Subject(
    f"{PREFIX}.tokenizer.info",
    TokenizerInfoRequest,
    TokenizerInfoReply,
    "Vocabulary facts: size, bos/eos/pad ids, context length.",
    queue="tokenizer",
    public=True,
)

# --- generation (gateway: the public entry point) ---------------------------------------
GENERATE = Subject(
    f"{PREFIX}.generate",
    GenerateRequest,
    GenerateChunk,
    "Generate from a prompt or chat messages; streams chunks (text delta, token ids, finish reason, usage).",
    queue="gateway",
    streamed=True,
    public=True,
)
GENERATE_ONCE = Subject(
    f"{PREFIX}.generate.once",
    GenerateRequest,
    GenerateReply,
    "Generate and answer once with the whole result.",
    queue="gateway",
    public=True,
)

# --- router and workers (internal, MessagePack) ------------------------------------------
ROUTE = Subject(
    f"{PREFIX}.router.route",
    RouteRequest,
    RouteReply,
    "Pick the decode (and prefill) worker for a request.",
    queue="router",
    encoding=Encoding.MSGPACK,
)
WORKER_HEARTBEAT = Subject(
    f"{PREFIX}.workers.heartbeat",
    WorkerHeartbeatEvent,
    None,
    "Every engine worker's liveness and load, every heartbeat interval.",
    encoding=Encoding.MSGPACK,
)
WORKER_GENERATE = Subject(
    f"{PREFIX}.worker.{{worker_id}}.generate",
    WorkerGenerateRequest,
    TokenChunk,
    "Generate on this decode or aggregated worker; streams token chunks.",
    encoding=Encoding.MSGPACK,
    streamed=True,
)
PREFILL = Subject(
    f"{PREFIX}.prefill.{{worker_id}}.prefill",
    PrefillRequest,
    PrefillChunk,
    "Compute a prompt's KV pages and first token on this prefill worker and push the pages to the decoder; "
    "streams the first token, then the pages' transfer descriptor.",
    encoding=Encoding.MSGPACK,
    streamed=True,
)
KV_CHUNK = Subject(
    f"{PREFIX}.kv.{{worker_id}}.{{transfer_id}}",
    KVChunkEvent,
    None,
    "KV pages in chunks to a receiving worker (nats transfer backend).",
    encoding=Encoding.MSGPACK,
)

# --- draft service (speculative decoding) -----------------------------------------------
DRAFT_PROPOSE = Subject(
    f"{PREFIX}.draft.propose",
    DraftProposeRequest,
    DraftProposeReply,
    "Draft tokens for a decode worker's sequences (their new tokens in, proposals out); batched by the service.",
    queue="draft",
    encoding=Encoding.MSGPACK,
)
DRAFT_CLOSE = Subject(
    f"{PREFIX}.draft.close",
    DraftCloseEvent,
    None,
    "Requests that finished: every draft replica drops their streams.",
    encoding=Encoding.MSGPACK,
)

# --- kv_store (HiCache host and disk tiers, one per host; internal, MessagePack) --------------
KV_STORE_ATTACH = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.attach",
    KVStoreAttachRequest,
    KVStoreAttachReply,
    "Map an engine into this host's L2 arena (the first engine's layout creates it).",
    encoding=Encoding.MSGPACK,
)
KV_STORE_LEASE = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.lease",
    KVStoreLeaseRequest,
    KVStoreLeaseReply,
    "Empty arena slots an engine fills by write-back (taken ahead of need).",
    encoding=Encoding.MSGPACK,
)
KV_STORE_COMMIT = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.commit",
    KVStoreCommitEvent,
    None,
    "Leased slots an engine filled: slot -> page hash.",
    encoding=Encoding.MSGPACK,
)
KV_STORE_TOUCH = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.touch",
    KVStoreTouchEvent,
    None,
    "Pages an engine loaded back from L2 (LRU and hit counts).",
    encoding=Encoding.MSGPACK,
)
KV_STORE_LOOKUP = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.lookup",
    KVStoreLookupRequest,
    KVStoreLookupReply,
    "The leading pages of a chain this host's L2 holds (L3 hits promoted first), with their slots.",
    encoding=Encoding.MSGPACK,
)

# Engines on another host (no access to the arena) move page bytes through the transfer layer.
KV_STORE_OFFER = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.offer",
    KVStoreOfferRequest,
    KVStoreOfferReply,
    "A remote engine offers pages to write back; the reply names those the store lacks and where to send them.",
    encoding=Encoding.MSGPACK,
)
KV_STORE_PUT = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.put",
    KVStorePutRequest,
    KVStorePutReply,
    "The offered pages were sent (transfer descriptor): the store checks and stores them.",
    encoding=Encoding.MSGPACK,
)
KV_STORE_FETCH = Subject(
    f"{PREFIX}.kv_store.{{host_id}}.fetch",
    KVStoreFetchRequest,
    KVStoreFetchReply,
    "A remote engine's load-back: the leading pages the store holds are pushed to its receiver.",
    encoding=Encoding.MSGPACK,
)

# --- KV events (for the KV-aware router and any other consumer) ---------------------------
KV_EVENTS = Subject(
    f"{PREFIX}.kv_events.{{worker_id}}",
    KVEventBatchEvent,
    None,
    "Pages stored in or removed from a tier (device, host, disk) of one publisher; event ids are "
    "monotonic per publisher, so a gap means events were lost (ask for a dump).",
    public=True,
)
KV_EVENTS_DUMP = Subject(
    f"{PREFIX}.kv_events.{{worker_id}}.dump",
    KVDumpRequest,
    KVDumpReply,
    "Every page a publisher holds now, for a consumer to resync after a gap.",
    public=True,
)

ALL_SUBJECTS: tuple[Subject, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Subject))


def subject_for_name(name: str) -> tuple[Subject, dict[str, str]]:
    """The table entry a concrete subject name belongs to, with its field values."""
    tokens = name.split(".")
    for subject in ALL_SUBJECTS:
        parts = subject.template.split(".")
        if len(parts) != len(tokens):
            continue
        params: dict[str, str] = {}
        for part, token in zip(parts, tokens):
            if part.startswith("{") and part.endswith("}"):
                params[part[1:-1]] = token
            elif part != token:
                break
        else:
            return subject, params
    raise ValueError(f"no subject named {name!r}")
