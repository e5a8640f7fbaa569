"""The NATS transport: connection options, reconnects, auth and TLS from config."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import ssl

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from bus.core import Bus, RawHandler, RawMsg, RawSubscription, Transport
from bus.errors import NoResponders, Timeout, Unavailable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BusConfig:
    """How to reach NATS. Every field may come from ``KVBUS_*`` environment variables."""

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL(s), comma separated (env NATS_URL is honoured too)."""
    nats_user: str | None = None
    """User name for user/password auth."""
    nats_password: str | None = None
    """Password for user/password auth."""
    nats_token: str | None = None
    """Token auth."""
    nats_creds: str | None = None
    """Path of a NATS .creds file (JWT + nkey)."""
    nats_nkey_seed: str | None = None
    """Path of an NKey seed file (nkey auth: the server lists the user's public key)."""
    nats_tls_ca: str | None = None
    """CA bundle to verify the server's TLS certificate; enables TLS."""
    nats_tls_cert: str | None = None
    """Client certificate for mutual TLS."""
    nats_tls_key: str | None = None
    """Client key for mutual TLS."""
    connect_timeout: float = 5.0
    """Seconds to wait for the first connection."""
    request_timeout: float = 30.0
    """Default seconds to wait for a reply (or the next chunk of a stream)."""
    max_reconnect_attempts: int = -1
    """Reconnect attempts after a lost connection (-1: forever)."""
    reconnect_time_wait: float = 0.5
    """Seconds between reconnect attempts to one server (nats-py adds jitter); subscriptions are restored."""
    probe_interval: float = 1.0
    """Seconds between interest probes of each streamed reply's caller; a caller that is gone has its
    stream cancelled (docs/reliability.md, Deadlines). 0: never probe."""

    def __post_init__(self) -> None:
        if self.connect_timeout <= 0 or self.request_timeout <= 0 or self.reconnect_time_wait <= 0:
            raise ValueError("connect_timeout, request_timeout and reconnect_time_wait must be positive")
        if not self.probe_interval >= 0:
            raise ValueError("probe_interval must be >= 0 (0: never probe)")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError("nats_tls_cert and nats_tls_key go together")


class _NatsSubscription(RawSubscription):
    def __init__(self, sub):
        self._sub = sub

    async def unsubscribe(self) -> None:
        try:
            await self._sub.unsubscribe()
        except Exception:  # connection already closed
            pass


class NatsTransport(Transport):
    def __init__(self, nc: Client):
        self.nc = nc

    async def publish(self, subject, data, headers=None, reply=None) -> None:
        await self.nc.publish(subject, data, reply=reply or "", headers=headers)

    async def subscribe(self, subject, handler: RawHandler, queue=None) -> RawSubscription:
        async def cb(msg: Msg) -> None:
            await handler(RawMsg(msg.subject, msg.data, msg.headers, msg.reply or None))

        # NOTE: large pending limits: a burst of requests must queue, not be dropped as a slow consumer.
        sub = await self.nc.subscribe(subject, queue=queue or "", cb=cb,
                                      pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30)
        return _NatsSubscription(sub)

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

    async def request(self, subject, data, headers, timeout) -> RawMsg:
        # nats-py's one shared response inbox: no subscription per request
        try:
            msg = await self.nc.request(subject, data, timeout=timeout, headers=headers)
        except NoRespondersError:
            raise NoResponders(f"nobody is listening on {subject}") from None
        except NatsTimeoutError:
            raise Timeout(f"no reply on {subject} within {timeout:g}s") from None
        return RawMsg(msg.subject, msg.data, msg.headers, msg.reply or None)

    async def flush(self) -> None:
        await self.nc.flush()

    @property
    def max_payload(self) -> int | None:
        return self.nc.max_payload

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            try:
                await self.nc.drain()
                return
            except Exception as exc:
                log.debug("nats: drain failed (%s); closing", exc)
        try:  # NATS gone (or going): close without a goodbye, and without a traceback
            await self.nc.close()
        except Exception as exc:
            log.info("nats: connection closed without a clean goodbye: %s", exc or type(exc).__name__)


def _tls_context(config: BusConfig) -> ssl.SSLContext | None:
    if not (config.nats_tls_ca or config.nats_tls_cert):
        return None
    ctx = ssl.create_default_context(cafile=config.nats_tls_ca)
    if config.nats_tls_cert:
        ctx.load_cert_chain(config.nats_tls_cert, config.nats_tls_key)
    return ctx


async def connect(config: BusConfig | None = None, *, name: str = "kvbus") -> Bus:
    """Connect to NATS and return a Bus; raises Unavailable with the URL on failure."""
    config = config or BusConfig(nats_url=os.environ.get("NATS_URL", BusConfig.nats_url))
    servers = [s.strip() for s in config.nats_url.split(",") if s.strip()]

    async def on_error(exc: Exception) -> None:
        log.warning("nats: %s", exc)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("nats: disconnected, reconnecting")

    async def on_reconnect() -> None:
        log.info("nats: reconnected")

    nc = Client()
    kwargs = dict(
        servers=servers, name=name, connect_timeout=config.connect_timeout,
        max_reconnect_attempts=config.max_reconnect_attempts, allow_reconnect=True,
        reconnect_time_wait=config.reconnect_time_wait, error_cb=on_error, disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect, tls=_tls_context(config),
    )
    if config.nats_user:
        kwargs.update(user=config.nats_user, password=config.nats_password)
    if config.nats_token:
        kwargs["token"] = config.nats_token
    if config.nats_creds:
        kwargs["user_credentials"] = config.nats_creds
    if config.nats_nkey_seed:
        kwargs["nkeys_seed"] = config.nats_nkey_seed
    try:
        # NOTE: nats-py retries the first connect forever when reconnects are unbounded;
        # a wrong URL must fail within the connect timeout instead.
        async with asyncio.timeout(config.connect_timeout * 2):
            await nc.connect(**kwargs)
    except Exception as exc:
        try:
            await nc.close()
        except Exception:
            pass
        reason = "timed out" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
        raise Unavailable(f"cannot connect to NATS at {config.nats_url}: {reason}") from None
    return Bus(NatsTransport(nc), default_timeout=config.request_timeout, probe_interval=config.probe_interval)
