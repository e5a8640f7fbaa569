"""The wire contract beyond the payloads: every header a caller sends or receives, its values and their meanings.

``kvbus schemas export`` builds the AsyncAPI document from this, from the subjects table
(:mod:`bus.subjects`) and from the error taxonomy (:mod:`bus.errors`). Every name and value here is
the constant the bus itself reads or writes, so the published contract cannot drift from the code.

Versioning (docs/architecture.md, "Versioning the wire"): within ``kvbus.v1`` a header may gain a
documented meaning, never a new value in a closed set nor a new required header; the snapshot test
(tests/unit/test_wire_contract.py) holds this.
"""

from __future__ import annotations

import dataclasses

from bus.codec import CONTENT_TYPE_HEADER, Encoding
from bus.errors import (
    ERROR_CODE_HEADER,
    ERROR_MESSAGE_HEADER,
    MEANINGS,
    MICRO_ERROR_CODE_HEADER,
    MICRO_ERROR_HEADER,
    RETRY_AFTER_HEADER,
    ErrorCode,
)
from bus.subjects import CANCEL, PREFIX
from bus.transport import (
    CHUNK,
    END,
    PROBE,
    PROBE_ACCEPT,
    PROBE_ALIVE,
    PROBE_GONE,
    PROBE_HEADER,
    REQUEST_ID_HEADER,
    SEQ_HEADER,
    STREAM_HEADER,
    TIMEOUT_HEADER,
)

WIRE_VERSION = PREFIX.rsplit(".", 1)[-1]
"""The version every subject carries in its name (``kvbus.v1.*``): what the versioning rule protects."""
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
SECONDS_PATTERN = r"^[0-9]+(\.[0-9]+)?$"


@dataclasses.dataclass(frozen=True, eq=False)  # one object per header: compared and hashed by identity
class Header:
    name: str
    description: str
    values: dict[str, str] = dataclasses.field(default_factory=dict)
    """A closed set of values, each with its meaning (empty: any text matching ``pattern``)."""
    pattern: str | None = None

    def schema(self, only: str | None = None) -> dict:
        """JSON Schema of the header's value; ``only``: the one value this message carries."""
        out: dict = {"type": "string", "description": self.description}
        if only is not None:
            out["const"] = only
            out["description"] = f"{self.description} Here: {only!r}, {self.values[only]}"
        elif self.values:
            out["oneOf"] = [{"const": v, "description": meaning} for v, meaning in self.values.items()]
        if self.pattern is not None:
            out["pattern"] = self.pattern
        return out


CONTENT_TYPE = Header(CONTENT_TYPE_HEADER, "The body's encoding. Missing on a request: the subject's own (JSON "
                      "on every public subject). A reply is encoded as its request was.",
                      {Encoding.JSON.value: "JSON (every public subject's default)",
                       Encoding.MSGPACK.value: "MessagePack (internal subjects' default; any subject decodes it)"})
REQUEST_ID = Header(REQUEST_ID_HEADER, "The request's id: set it on a request (the server makes one up when "
                    "missing); every reply, chunk and error of the request carries it; a CancelEvent names it.")
TIMEOUT = Header(TIMEOUT_HEADER, "Seconds the caller will wait, counted from when it sent the request "
                 "(relative, so clocks need not agree). Past it the server cancels the work, frees what it "
                 "held and answers timeout. Malformed values are ignored.", pattern=SECONDS_PATTERN)
PROBE_OPT_IN = Header(PROBE_HEADER, "Streamed requests only: the caller asks for interest probes on its inbox "
                      "(it skips or answers them), so a caller that vanishes without a word (process killed, "
                      "connection lost) has its work cancelled within about a second. Without it no probe is "
                      "ever sent; the caller's Kvbus-Timeout, its CancelEvent and the service's own time "
                      "limit (the gateway's generate_timeout) end abandoned work.",
                      {PROBE_ACCEPT: "send me probes: I skip them or answer alive/gone"})
TRACEPARENT = Header(TRACEPARENT_HEADER, "W3C trace context (optional): the request's spans join the caller's "
                     "trace.", pattern=r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
TRACESTATE = Header(TRACESTATE_HEADER, "W3C trace state (optional), carried with traceparent.")
STREAM = Header(STREAM_HEADER, "What a message of a streamed reply is.", {
    CHUNK: "one piece of the reply: the body is a chunk (JSON), numbered by Kvbus-Seq",
    END: "the reply is complete: empty body, Kvbus-Seq one past the last chunk",
    PROBE: "the server asks whether the caller still reads (sent only to a caller that asked with "
           "Kvbus-Probe: accept): empty body, a NATS request; skip it, or answer on its reply subject",
    PROBE_ALIVE: "a caller's answer to a probe: the stream is still read",
    PROBE_GONE: "a caller's answer to a probe: nobody reads this stream any more; the server cancels it",
})
SEQ = Header(SEQ_HEADER, "Position of a chunk in its stream: 0, 1, 2, ... with no gap (a gap means chunks "
             "were lost, e.g. across a reconnect: the stream is broken); the end message carries the count.",
             pattern=r"^[0-9]+$")
ERROR_CODE = Header(ERROR_CODE_HEADER, "Present on every error, and only there: the body is then empty. "
                    "A closed set: a new code would come with new (v2) subjects; still, read a code you do "
                    "not know as internal.",
                    {code.value: MEANINGS[code] for code in ErrorCode})
ERROR_MESSAGE = Header(ERROR_MESSAGE_HEADER, "What went wrong, for people (at most 1,024 characters, one line); "
                       "its wording may change within a version.")
RETRY_AFTER = Header(RETRY_AFTER_HEADER, "On some overloaded or unavailable errors: seconds after which the "
                     "request may succeed if sent again.", pattern=SECONDS_PATTERN)
MICRO_ERROR = Header(MICRO_ERROR_HEADER, "The error message again, for generic NATS micro tooling.")
MICRO_ERROR_CODE = Header(MICRO_ERROR_CODE_HEADER, "An HTTP-like number for the error code, for generic NATS "
                          "micro tooling (400, 404, 429, 499, 504, 503, 500).", pattern=r"^[0-9]{3}$")

REQUEST_HEADERS = (CONTENT_TYPE, REQUEST_ID, TIMEOUT, TRACEPARENT, TRACESTATE)
"""What a caller may put on any request (a streamed one also ``PROBE_OPT_IN``)."""
REPLY_HEADERS = (REQUEST_ID, CONTENT_TYPE)
"""What every reply, chunk and end message carries."""
ERROR_HEADERS = (REQUEST_ID, CONTENT_TYPE, ERROR_CODE, ERROR_MESSAGE, RETRY_AFTER, MICRO_ERROR, MICRO_ERROR_CODE)
REQUIRED_ON_ERROR = (REQUEST_ID, ERROR_CODE, ERROR_MESSAGE, MICRO_ERROR, MICRO_ERROR_CODE)

CALLER_SUBJECTS = (CANCEL,)
"""Not public subjects (no service answers them), yet part of a caller's contract: a CancelEvent
published on ``kvbus.v1.cancel`` stops the request it names."""
