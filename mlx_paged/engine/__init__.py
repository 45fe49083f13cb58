"""The engine: ``PagedEngine`` wires a pure-Python ``Scheduler`` to a ``ModelRunner``."""

from .engine import PagedEngine
from .request import EngineStats, Event, Request
from .runner import ModelRunner
from .scheduler import Scheduler

__all__ = ["EngineStats", "Event", "ModelRunner", "PagedEngine", "Request", "Scheduler"]
