"""``GET /metrics``: the engine's state in Prometheus text format (``prometheus_client``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine import EngineStats


class EngineCollector:
    """Reads the engine thread's latest ``EngineStats`` at each scrape (no MLX call)."""

    def __init__(self, stats: Callable[[], EngineStats], queued: Callable[[], int]):
        self._stats, self._queued = stats, queued

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = {
            "requests_running": ("Requests decoding or prefilling.", s.running),
            "requests_waiting": ("Requests queued for admission.", self._queued()),
            "kv_blocks_active": ("KV blocks held by running requests.", s.live_blocks),
            "kv_blocks_cached": ("KV blocks held only by the prefix index.", s.cached_blocks),
            "kv_blocks_free": ("KV blocks holding nothing.", s.free_blocks),
            "kv_blocks_total": ("KV blocks in the pool.", s.total_blocks),
            "kv_cache_bytes": ("Bytes of the pool's K/V arrays, both tiers.", s.bytes),
            "kv_blocks_cold": ("Quantized KV blocks held (--kv-bits).", s.cold_blocks),
            "kv_cold_bytes": ("Bytes of the quantized KV blocks held.", s.cold_bytes),
            "state_snapshots": (
                "Recurrent-state snapshots the prefix index holds (hybrid models).",
                s.state_snapshots,
            ),
            "state_snapshot_bytes": (
                "Bytes of the recurrent-state snapshots held.",
                s.state_snapshot_bytes,
            ),
            "state_slots_active": (
                "Recurrent-state slots held by running requests.",
                s.state_slots_used,
            ),
            "state_bytes": ("Bytes of the running requests' recurrent-state slots.", s.state_bytes),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"mlx_paged_{name}", doc, value=value)
        counters = {
            "prefix_cache_hit_tokens": (
                "Prompt tokens served from the prefix index.",
                "prefix_hit_tokens",
            ),
            "prompt_tokens": ("Prompt tokens received.", "prompt_tokens"),
            "generation_tokens": ("Tokens generated.", "generated_tokens"),
            "prefill_tokens": ("Tokens run through prefill.", "prefilled_tokens"),
            "preemptions": ("Requests preempted to free blocks.", "preemptions"),
            "requests_aborted": ("Requests aborted.", "aborted"),
            "requests_failed": ("Requests ended by an error.", "failed"),
            "kv_migrations": ("KV blocks quantized into the cold tier.", "migrations"),
        }
        for name, (doc, field) in counters.items():
            yield CounterMetricFamily(f"mlx_paged_{name}", doc, value=getattr(s, field))


def metrics_registry(
    stats: Callable[[], EngineStats], queued: Callable[[], int]
) -> CollectorRegistry:
    """A registry holding only the engine's metrics."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(stats, queued))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
