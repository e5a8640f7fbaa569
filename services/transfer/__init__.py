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
    AUTO,
    BACKENDS,
    TransferCorrupted,
    TransferOptions,
    TransferTimeout,
    available_backends,
    backend_names,
    check_request,
    choose_backend,
    register_backend,
    transfer_choices,
)


def __getattr__(name: str):
    # The two ends import torch; the names and the registry above do not (worker configuration reads them).
    if name == "KVReceiver":
        from services.transfer.receiver import KVReceiver

        return KVReceiver
    if name == "KVSender":
        from services.transfer.sender import KVSender

        return KVSender
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AUTO",
    "BACKENDS",
    "KVReceiver",
    "KVSender",
    "TransferCorrupted",
    "TransferOptions",
    "TransferTimeout",
    "available_backends",
    "backend_names",
    "check_request",
    "choose_backend",
    "register_backend",
    "transfer_choices",
]
