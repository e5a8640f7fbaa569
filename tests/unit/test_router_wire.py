"""Golden bytes of the router's messages (heartbeats in, routes out): a change here breaks every peer already
deployed. New fields go last, with defaults; bytes from a peer that predates them still decode."""

from __future__ import annotations

import msgspec

from bus.codec import Encoding, decode, encode
from schemas.worker import PrefixReport, RouteReply, WorkerHeartbeatEvent, WorkerLoad

HEARTBEAT = WorkerHeartbeatEvent(
    worker_id="w", role="worker", host_id="h", load=WorkerLoad(num_running=1), model="m", page_size=16,
    transfer_backends=["shm"], interval_s=1.0, hash_scheme="kvbus-page-hash-v1", hash_root=2**63 + 5,
    prefix_reports=[PrefixReport(request_id="r-0", num_prompt_tokens=40, num_cached_tokens=32)])
HEARTBEAT_HEX = (
    "8ca9776f726b65725f6964a177a4726f6c65a6776f726b6572a7686f73745f6964a168a46c6f616485ab6e756d5f72756e6e696e6701ab"
    "6e756d5f77616974696e6700ae6e756d5f667265655f706167657300af6e756d5f746f74616c5f706167657300b96e756d5f7175657565"
    "645f70726566696c6c5f746f6b656e7300a56d6f64656ca16da9706167655f73697a6510b17472616e736665725f6261636b656e647391"
    "a373686daa696e74657276616c5f73cb3ff0000000000000ab69735f647261696e696e67c2"
    # the fields KV-aware routing added: scheme, root (a uint64), reports (array-like: id, prompt, cached)
    "ab686173685f736368656d65b26b766275732d706167652d686173682d7631a9686173685f726f6f74cf8000000000000005"
    "ae7072656669785f7265706f7274739193a3722d302820")
REPLY = RouteReply(decode_worker_id="d", num_cached_tokens=32, reason="session")
REPLY_HEX = ("86b06465636f64655f776f726b65725f6964a164b170726566696c6c5f776f726b65725f6964c0a6706f6c696379a0af70726566"
             "696c6c5f686f73745f6964c0b16e756d5f6361636865645f746f6b656e7320a6726561736f6ea773657373696f6e")


def test_golden_heartbeat_and_route_reply():
    for message, golden in ((HEARTBEAT, HEARTBEAT_HEX), (REPLY, REPLY_HEX)):
        assert encode(message, Encoding.MSGPACK).hex() == golden
        assert decode(bytes.fromhex(golden), type(message), Encoding.MSGPACK) == message


def test_older_peers_bytes_decode_with_the_defaults():
    old = msgspec.msgpack.encode({"worker_id": "w", "role": "worker", "host_id": "h", "load": {}})
    beat = decode(old, WorkerHeartbeatEvent, Encoding.MSGPACK)
    assert (beat.hash_scheme, beat.hash_root, beat.prefix_reports) == ("", 0, [])
    reply = decode(msgspec.msgpack.encode({"decode_worker_id": "d"}), RouteReply, Encoding.MSGPACK)
    assert (reply.num_cached_tokens, reply.reason) == (0, "")
