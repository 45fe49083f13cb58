"""The engine: ``PagedEngine`` wires a pure-Python ``Scheduler`` to a ``ModelRunner``."""

from .engine import PagedEngine
from .fusion import fuse_projections
from .linears import few_row_matmuls
from .request import EngineStats, Event, Request
from .rope import rope_in_kernel
from .row_buckets import bucket_matmul_rows
from .runner import ModelRunner
from .scheduler import Scheduler

__all__ = [
    "EngineStats",
    "Event",
    "ModelRunner",
    "PagedEngine",
    "Request",
    "Scheduler",
    "bucket_matmul_rows",
    "few_row_matmuls",
    "fuse_projections",
    "rope_in_kernel",
]
