"""``GET /metrics``: the engine's state in Prometheus text format (``prometheus_client``),
its host time per step phase, and where requests' first tokens spent their time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..attention.kernels import compiled_variants
from ..engine import EngineStats
from ..engine.timing import StepClock

#: From the HTTP handler's start to the first token on the event loop, in order:
#: ``prepare`` (chat template, tokenizing, checks), ``submit`` (until the engine thread
#: takes the job: it does between steps), ``queue`` (waiting for admission), ``prefill``
#: (admission to the first token sampled), ``deliver`` (the engine thread's hand-off
#: to the event loop).
FIRST_TOKEN_PHASES = ("prepare", "submit", "queue", "prefill", "deliver")
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class EngineCollector:
    """Reads the engine thread's latest ``EngineStats`` at each scrape (no MLX call)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        queued: Callable[[], int],
        clock: Callable[[], StepClock | None] = lambda: None,
        disk: Callable[[], Any] = lambda: None,
        compiled: Callable[[], Any] = lambda: None,
        memory: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ):
        self._stats, self._queued, self._clock, self._disk = stats, queued, clock, disk
        self._compiled, self._memory = compiled, memory

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
            "kv_blocks_cold_total": (
                "Quantized KV block slots: --cold-blocks, or what the tier has grown to.",
                s.cold_capacity,
            ),
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
        variants = compiled_variants()
        gauges["kernel_binaries"] = (
            "Fused kernel binaries built (template sets).",
            variants["binaries"],
        )
        gauges["kernel_launch_shapes"] = (
            "Fused kernel launch shapes traced and held.",
            variants["launches"],
        )
        active, cached = self._memory()
        gauges["mlx_active_bytes"] = ("Bytes of the arrays MLX holds (this process).", active)
        gauges["mlx_cache_bytes"] = (
            "Bytes of freed buffers MLX keeps for reuse (--mlx-cache-limit; none at rest).",
            cached,
        )
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
            "kv_disk_hit_tokens": (
                "Prompt tokens whose blocks came back from the disk tier.",
                "disk_hit_tokens",
            ),
        }
        for name, (doc, field) in counters.items():
            yield CounterMetricFamily(f"mlx_paged_{name}", doc, value=getattr(s, field))
        disk = self._disk()
        if disk is not None:
            store, pre = disk.store, disk.preloaded
            yield GaugeMetricFamily(
                "mlx_paged_kv_disk_bytes", "Bytes of the disk tier's files.", value=store.bytes
            )
            for name, doc, value in (
                ("kv_disk_hits", "Blocks loaded from the disk tier.", store.counts["hits"]),
                ("kv_disk_writes", "Blocks written to the disk tier.", store.counts["writes"]),
                ("kv_disk_load_seconds", "Seconds loading from disk.", disk.seconds["load"]),
                ("kv_disk_write_seconds", "Seconds writing to disk.", disk.seconds["write"]),
                ("kv_disk_preload_hits", "Of those, blocks preloaded.", getattr(pre, "taken", 0)),
                ("kv_disk_restored_tokens", "Tokens restored at start.", disk.restored_tokens),
            ):
                yield CounterMetricFamily(f"mlx_paged_{name}", doc, value=value)
            doc = "Bytes of disk-tier entries the preload holds in host memory."
            held = pre.held_bytes if pre is not None else 0
            yield GaugeMetricFamily("mlx_paged_kv_disk_preloaded_bytes", doc, value=held)
        clock = self._clock()
        if clock is not None:
            doc = "Engine thread seconds per step phase (engine/timing.py)."
            phases = CounterMetricFamily("mlx_paged_step_seconds", doc, labels=["phase"])
            for phase, seconds in dict(clock.seconds).items():
                phases.add_metric([phase], seconds)
            yield phases
            doc = "Decode steps run."
            yield CounterMetricFamily("mlx_paged_decode_steps", doc, value=clock.decode_steps)
        compiled = self._compiled()  # the engine's CompiledDecode, None when it is off
        for name, doc, field in (
            ("decode_steps_compiled", "Decode steps run as a compiled graph.", "steps"),
            ("decode_traces", "Decode step shapes traced by mx.compile.", "traces"),
            ("decode_trace_seconds", "Host seconds of the steps that traced.", "trace_seconds"),
        ):
            value = getattr(compiled, field, 0)
            yield CounterMetricFamily(f"mlx_paged_{name}", doc, value=value)


class FirstTokenTimes:
    """Histograms of requests' time to first token, whole and by phase
    (``FIRST_TOKEN_PHASES``), observed on the event loop."""

    def __init__(self, registry: CollectorRegistry):
        self.total = Histogram(
            "mlx_paged_time_to_first_token_seconds",
            "From the HTTP handler's start to the first token on the event loop.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.phases = Histogram(
            "mlx_paged_first_token_phase_seconds",
            "Time to first token by phase: prepare, submit, queue, prefill, deliver.",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, received: float, submitted: float, request: Any, seen: float) -> None:
        """Record one job's first token, seen at ``seen`` (``time.perf_counter()``), from
        the engine ``Request``'s ``arrived``, ``admitted`` and ``first_token`` marks."""
        if request is None or request.admitted is None or request.first_token is None:
            return
        marks = (received, submitted, request.arrived, request.admitted, request.first_token)
        for phase, a, b in zip(FIRST_TOKEN_PHASES, marks, (*marks[1:], seen), strict=True):
            self.phases.labels(phase).observe(max(0.0, b - a))
        self.total.observe(max(0.0, seen - received))


def metrics_registry(
    stats: Callable[[], EngineStats],
    queued: Callable[[], int],
    clock: Callable[[], StepClock | None] = lambda: None,
    disk: Callable[[], Any] = lambda: None,
    compiled: Callable[[], Any] = lambda: None,
    memory: Callable[[], tuple[int, int]] = lambda: (0, 0),
) -> tuple[CollectorRegistry, FirstTokenTimes]:
    """A registry holding only the server's metrics, and its first-token histograms."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(stats, queued, clock, disk, compiled, memory))
    return registry, FirstTokenTimes(registry)


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format."""
    return generate_latest(registry)
