"""Engine workers on the bus: aggregated (``worker``), ``decode`` and ``prefill``."""

from services.workers.actor import EngineWorker, WorkerActor, coalesce
from services.workers.config import WorkerConfig

__all__ = ["EngineWorker", "WorkerActor", "WorkerConfig", "coalesce"]
