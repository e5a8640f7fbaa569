"""Service discovery through NATS micro's ``$SRV`` subjects (PING, INFO, STATS).

``nats micro ls`` and any NATS micro client then see kvbus services. On a
transport other than NATS this is a no-op.
"""

from __future__ import annotations

import logging

from bus.core import Bus

log = logging.getLogger(__name__)


class Announcement:
    def __init__(self, service=None):
        self._service = service

    async def withdraw(self) -> None:
        if self._service is not None:
            try:
                await self._service.stop()
            except Exception:
                log.debug("micro service stop failed", exc_info=True)


async def announce(bus: Bus, name: str, version: str, metadata: dict[str, str]) -> Announcement:
    from bus.nats_transport import NatsTransport

    if not isinstance(bus.transport, NatsTransport):
        return Announcement()
    from nats.micro import ServiceConfig, add_service

    service = await add_service(bus.transport.nc, ServiceConfig(
        name=name, version=version, description=f"kvbus {name}", metadata=metadata))
    return Announcement(service)
