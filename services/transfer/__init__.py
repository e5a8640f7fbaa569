"""KV transfer: moving one request's KV pages from a prefill worker to a decode worker.

Tensors in, tensors out; nothing here knows the engine. See
``docs/disaggregation.md`` (Transfer backends) for the protocol.

    receiver = await KVReceiver.open(bus, "decode-0", host_id, "auto")
    target = receiver.expect(transfer_id, sender_host_id=..., sender_backends=...)
    # ... PrefillRequest(transfer=target) -> prefill worker:
    descriptor = await sender.send(target, kv)          # sender = KVSender(bus, "prefill-0", host_id)
    # ... PrefillChunk(kv=descriptor) -> decode worker:
    kv = await receiver.receive(descriptor, timeout=30)
"""

from services.transfer.base import (
    REQUESTS,
    TransferCorrupted,
    TransferOptions,
    TransferTimeout,
    available_backends,
    choose_backend,
    register_backend,
)
from services.transfer.receiver import KVReceiver
from services.transfer.sender import KVSender

__all__ = [
    "KVReceiver",
    "KVSender",
    "REQUESTS",
    "TransferCorrupted",
    "TransferOptions",
    "TransferTimeout",
    "available_backends",
    "choose_backend",
    "register_backend",
]
