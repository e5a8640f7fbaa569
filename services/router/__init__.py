"""The router: which worker decodes a request and which (if any) prefills it.

Split by concern: ``workers`` (the live set, from heartbeats), ``scoring``
(cost functions), ``policy`` (the choice, by name), ``core`` (the decision),
``config`` and ``actor`` (the service on the bus).
"""

from services.router.actor import RouterActor
from services.router.config import RouterConfig

__all__ = ["RouterActor", "RouterConfig"]
