"""The scheduler: queues, admission, prefill budgets, preemption and finishing.

Plain Python over token ids, block ids and counts, like the schedulers of
nano-vllm and vLLM v1. It decides; the model runner moves tensors. It sees
each layer group through ``BlockTables`` (whose storage subclass copies a
block's K/V when copy-on-write re-points a table) and owns the ``PrefixIndex``.

Admission: a request adopts the longest cached prefix of its tokens (no K/V
copied) and prefills only the rest. A long rest, or one that a request behind
it could share, is prefilled alone at once, chunk by chunk; short ones are
grouped by their prefill steps and prefilled together. Full blocks are indexed as soon as
they are written, so concurrent requests share them.

Decode: every running request gets a private block for its next token; when
the pool runs short, the newest running request is preempted: its blocks are
parked, it goes back to the head of the queue, and it resumes later from the
cached prefix (usually all of it).

Recurrent state (hybrid models, ``states``): each running request holds a state
slot. A prefix is adopted only up to an index node holding a snapshot of the
state there, copied into the request's slot (``RecurrentStates`` says where
snapshots are due; prefill forwards end there). A request that shares cached
blocks past its snapshot is prefilled alone, to snapshot their end before the
requests behind it adopt, only where those would otherwise recompute more than a
batched forward's tokens; otherwise it batches with them, stopping there all the same.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator

from ..blocks import (
    BlockPool,
    BlockTable,
    BlockTables,
    Cursor,
    LayerKind,
    PrefixIndex,
    PrefixMatch,
    StateSlots,
    TieredBlockPool,
    ready_run,
)
from .prefills import batched_prefills, blocks_to_write, peak_blocks, prefill_steps
from .recurrent import RecurrentStates
from .request import EngineStats, Event, Prefill, Request

#: The scheduler's counters, reported in ``EngineStats``.
COUNTERS = (
    "prefix_hit_tokens",
    "prompt_tokens",
    "prefilled_tokens",
    "generated_tokens",
    "preemptions",
    "aborted",
    "failed",
    "peak_live_blocks",
    "disk_hit_tokens",
)


#: Most tokens, padding included, in a forward of several requests' prompts by default:
#: a burst's batched suffixes gave no earlier first tokens at 2048, at 1.2x-1.6x the peak
#: memory (BENCHMARKS.md, run 183), with attention over materialized scores.
BATCH_TOKENS = 512
#: The same where a fused prefill kernel serves the forwards (``Prefiller.widen``): no
#: scores to hold, and a burst of 32 x 64 tokens after a cached prefix took 0.46x the time
#: of 512-token forwards at 1.3x-1.5x the peak memory (BENCHMARKS.md, run 321).
KERNEL_BATCH_TOKENS = 2048


class Scheduler:
    """Moves requests between the waiting and running queues; owns their block tables.

    Args:
        groups: Per layer group, its block-table bookkeeping (all with one block size).
        max_batch_size: Most requests running at once.
        prefill_step_size: Most tokens per prefill forward.
        prefill_batch_tokens: Most tokens, padding included, in a forward of several
            requests' prompts (``None``: ``BATCH_TOKENS``; at most the step size). The
            engine widens it to ``KERNEL_BATCH_TOKENS`` where a prefill kernel runs.
        prefill_budget: Most prompt tokens admitted per step (``None``: no limit; at least
            one request a step); the rest wait, and running requests decode between.
        states, snapshot_interval: A hybrid model's recurrent-state slots and snapshots,
            and the tokens between a long prefill's snapshots (a block-size multiple).
        padded_states: Whether the recurrent layers keep a row's state over right padding
            (``ArraysCache.lengths``); without it only equal steps share a forward.
    """

    def __init__(
        self,
        groups: dict[LayerKind, BlockTables],
        max_batch_size: int,
        prefill_step_size: int,
        prefill_budget: int | None = None,
        states: StateSlots | None = None,
        snapshot_interval: int | None = None,
        prefill_batch_tokens: int | None = None,
        padded_states: bool = False,
    ):
        self.groups = groups
        self.kinds = list(groups)
        self.block_size = groups[self.kinds[0]].block_size
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.prefill_batch_tokens = min(prefill_batch_tokens or BATCH_TOKENS, prefill_step_size)
        self.prefill_budget = prefill_budget
        self.index = PrefixIndex(
            [groups[k].blocks for k in self.kinds], [k.window for k in self.kinds], states
        )
        self.recurrent = None
        if states is not None:
            assert states.num_slots >= max_batch_size, "fewer state slots than max_batch_size"
            self.recurrent = RecurrentStates(states, self.index, snapshot_interval)
        self.pads = self.recurrent is None or padded_states
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters, self.disk = dict.fromkeys(COUNTERS, 0), None  # disk: a DiskTier

    # ---- public API -------------------------------------------------------

    def add(self, req: Request) -> None:
        """Queue a request; raise ValueError if it could not fit in the pool even alone."""
        n = len(req.prompt)
        for kind, group in self.groups.items():
            chunk = min(self.prefill_step_size, n)
            need = peak_blocks(group, kind.window, chunk, n + req.max_tokens)
            if not group.blocks.growable and need > group.blocks.capacity:
                raise ValueError(
                    f"a prompt of {n} tokens plus max_tokens={req.max_tokens} needs up to "
                    f"{need} blocks of {self.block_size}, but the pool has "
                    f"{group.blocks.capacity}; use a larger num_blocks or a shorter request."
                )
        self.waiting.append(req)
        self.counters["prompt_tokens"] += n

    def admit(self) -> Iterator[Prefill]:
        """Admit waiting requests in order while blocks and batch slots allow.

        Yields the prefill work of each admission as it happens. The caller runs
        an ``alone`` prefill before asking for the next one, so the requests
        admitted after it can adopt its blocks; the batched ones come last.
        """
        batched: dict[tuple[tuple[int, ...], bool], list[Request]] = {}  # (steps, fresh)
        bs = self.block_size
        heads = Counter(tuple(r.prompt[:bs]) for r in self.waiting)
        spent, budget = 0, self.prefill_budget or float("inf")
        while self.waiting and len(self.running) < self.max_batch_size and spent < budget:
            req = self.waiting[0]
            # Adopting a shared partial tail costs a copy; an idle pool always
            # fits the request computed from scratch (``add`` checked).
            if not self._adopt(req) and (self.running or not self._adopt(req, use_cache=False)):
                break
            self.waiting.popleft()
            self.running.append(req)
            req.admitted = req.admitted or time.perf_counter()
            start = req.written
            n = req.kv_target - start
            spent += n
            self.counters["prefilled_tokens"] += n
            head = tuple(req.prompt[:bs])
            heads[head] -= 1
            shared = _first_alone(req, heads[head], start, n, bs, self.prefill_batch_tokens)
            steps = prefill_steps(start, start + n, self.prefill_step_size, req.cuts)
            if n > self.prefill_batch_tokens or shared:
                yield Prefill([req], steps, alone=True)
            elif n > 0:
                # Take the blocks now, so the next admission sees them gone.
                for kind, group in self.groups.items():
                    group.reserve(req.tables[kind], start, start + n)
                # As many forwards each: any lengths share padded forwards, unless recurrent
                # layers would advance their state over the padding.
                key = len(steps) if self.pads else tuple(steps)
                batched.setdefault((key, not req.generated), []).append((req, steps))
            _note_peak(self.counters, self.groups)
        assert self.running or not self.waiting, "an idle pool cannot take the next request"
        for work in batched.values():
            yield from batched_prefills(work, self.prefill_batch_tokens)

    def index_written(self, req: Request) -> None:
        """Index the full blocks ``req`` has written, so running requests can share them,
        and the recurrent state where a snapshot is due.

        Sliding-window blocks indexed now stay cached after the window passes them.
        """
        _park(self.index, req, self.kinds, partial=False)
        if self.recurrent:
            self.recurrent.wrote(req)

    def schedule_decode(self, preempt: bool = True) -> list[Request] | None:
        """Ready every running request for one decode token; return them in batch order.

        Blocks wholly before a window go back first; then each request gets a private
        block for its next token, the newest being preempted while the pool is short
        (with ``preempt=False``: ``None``, nothing preempted or reserved).
        """
        for kind, group in self.groups.items():
            if kind.window is not None:
                for r in self.running:
                    t = r.tables[kind]
                    group.drop_before(t, max(0, t.lengths[0] - kind.window + 1))
        while (needs := _decode_needs(self.groups, self.running)) is None:
            if not preempt:
                return None
            assert len(self.running) > 1, "one request alone outgrew the pool"
            self._preempt(self.running[-1])
        for i, r in enumerate(self.running):  # most need nothing: their tail block is theirs
            for kind, group in self.groups.items():
                if needs[kind][i]:
                    t = r.tables[kind]
                    group.reserve(t, t.lengths[0], t.lengths[0] + 1)
        # The most blocks a step holds: all running, each with its next slot.
        _note_peak(self.counters, self.groups)
        if self.recurrent:  # in slot order, so that state is read and written in place
            return sorted(self.running, key=lambda r: r.slot)
        return list(self.running)

    def emit(
        self,
        req: Request,
        token: int,
        logprob: float | None = None,
        top_logprobs: tuple[tuple[int, float], ...] | None = None,
    ) -> Event:
        """Record a sampled token; finish the request on a stop token or at ``max_tokens``."""
        req.generated.append(token)
        req.first_token = req.first_token or time.perf_counter()
        self.counters["generated_tokens"] += 1
        reason = None
        if token in req.stop_tokens:
            reason = "stop"
        elif len(req.generated) >= req.max_tokens:
            reason = "length"
        if reason is not None:
            self._detach(req)
        return Event(req.uid, token, reason, logprob, top_logprobs)

    def abort(self, req: Request, error: str | None = None) -> Event | None:
        """Drop a waiting request or end a running one (blocks parked, as at a finish);
        with ``error`` it failed (its sampling raised): return its error event."""
        if req in self.running:
            self._detach(req)
        else:
            self.waiting.remove(req)
        self.counters["failed" if error else "aborted"] += 1
        return None if error is None else Event(req.uid, -1, "error", error=error)

    def stats(self) -> EngineStats:
        """Pool counts summed over layer groups, the recurrent state's, plus the counters."""
        return EngineStats(
            block_size=self.block_size,
            running=len(self.running),
            waiting=len(self.waiting),
            **_pool_totals([g.blocks for g in self.groups.values()]),
            **(self.recurrent.stats() if self.recurrent else {}),
            **self.counters,
        )

    def check_invariants(self) -> None:
        """Assert refcounts equal holders in every group and the index agrees with the pools."""
        for kind, group in self.groups.items():
            group.blocks.check_invariants(tables=[r.tables[kind].blocks for r in self.running])
        self.index.check_invariants()
        if self.recurrent:
            self.recurrent.check_invariants(self.running)
        assert len(self.running) <= self.max_batch_size, "batch over max_batch_size"
        assert all(r.tables is None for r in self.waiting), "a waiting request holds blocks"
        assert all(r.slot is None for r in self.waiting), "a waiting request holds a state slot"

    # ---- internals --------------------------------------------------------

    def _adopt(self, req: Request, use_cache: bool = True) -> bool:
        """Give ``req`` tables holding its cached prefix and room for the rest, or wait."""
        known, target = req.tokens[:-1], req.kv_target  # the last token always runs
        if use_cache and self.disk is not None:  # full blocks past memory's, from disk
            loaded, more = self.disk.load(known, busy=bool(self.running))
            self.counters["disk_hit_tokens"] += loaded
            if more:  # the rest in later steps, while the running requests decode
                return False
        match = self.index.match(known) if use_cache else None
        hit = match.length if match else 0
        tables = adopted_tables(self.groups, match)
        # Leave each running sequence (and this one) a block to decode into.
        headroom = len(self.running) + 1
        need = {
            k: blocks_to_write(self.groups[k], k, tables[k], hit, target, self.prefill_step_size)
            for k in self.kinds
        }
        if not all(self.groups[k].blocks.can_allocate(n + headroom) for k, n in need.items()):
            for kind, table in tables.items():
                self.groups[kind].release(table)
            return False
        for k in self.kinds if hit < self.block_size else ():  # all new: one run of ids
            if k.window is None:
                ready_run(self.groups[k].blocks, need[k])
        req.tables = tables
        req.cursor = match.cursor if match else Cursor()
        if self.recurrent:
            self.recurrent.attach(req, match, target)
        self.counters["prefix_hit_tokens"] += hit
        if not req.generated:
            req.prefix_hit = hit
        return True

    def _preempt(self, req: Request) -> None:
        """Park a running request's blocks and requeue it first; it resumes from the cache."""
        self._detach(req)
        self.waiting.appendleft(req)
        self.counters["preemptions"] += 1

    def _detach(self, req: Request) -> None:
        """Park a sequence's blocks (and its recurrent state) in the prefix index; drop its
        tables and state slot."""
        _park(self.index, req, self.kinds, partial=True)
        if self.recurrent:
            self.recurrent.detach(req)
        for kind, table in req.tables.items():
            self.groups[kind].release(table)
        req.tables, req.cursor = None, Cursor()  # nor a node of the trie
        self.running.remove(req)


def _park(index: PrefixIndex, req: Request, kinds: list[LayerKind], partial: bool) -> None:
    """Index ``req``'s written blocks (with ``partial``, its partly filled last one), from
    its cursor on."""
    tokens = req.tokens
    # Not a token an overlapped step ran and the host then refused (``engine/decode.py``).
    length = min(req.written, len(tokens))
    spans = [(req.tables[k].first, req.tables[k].blocks) for k in kinds]
    index.insert(tokens, spans, length, partial, req.cursor)


def _first_alone(req: Request, behind: int, start: int, n: int, bs: int, budget: int) -> bool:
    """Whether ``req`` (prefilling ``n`` tokens from ``start``) goes alone, first, for the
    ``behind`` waiting requests that start with its first block: where they would adopt its
    blocks, or recompute more than ``budget`` tokens (a batched forward's) past their
    snapshot where it snapshots the end of the blocks they share."""
    return behind > 0 and (start < bs <= n or behind * req.shared_past_snapshot > budget)


def _note_peak(counters: dict[str, int], groups: dict[LayerKind, BlockTables]) -> None:
    live = sum(g.blocks.stats().live_blocks for g in groups.values())
    counters["peak_live_blocks"] = max(counters["peak_live_blocks"], live)


def adopted_tables(
    groups: dict[LayerKind, BlockTables], match: PrefixMatch | None
) -> dict[LayerKind, BlockTable]:
    """Per group, a new table holding references to ``match``'s blocks (empty without one)."""
    hit = match.length if match else 0
    tables = {}
    for g, (kind, group) in enumerate(groups.items()):
        table = group.new_table()
        if match:
            group.blocks.retain_all(match.blocks[g])
            table.blocks.extend(match.blocks[g])
            table.first = match.firsts[g]
        table.lengths[:] = [hit] * group.num_layers
        tables[kind] = table
    return tables


def _decode_needs(
    groups: dict[LayerKind, BlockTables], running: list[Request]
) -> dict[LayerKind, list[int]] | None:
    """Per group, the blocks each running request's next token takes; ``None`` if a group
    cannot give them all."""
    needs = {
        kind: [group.next_token_blocks(r.tables[kind]) for r in running]
        for kind, group in groups.items()
    }
    if all(groups[kind].blocks.can_allocate(sum(n)) for kind, n in needs.items()):
        return needs
    return None


def _pool_totals(pools: list[BlockPool]) -> dict[str, int]:
    """Block counts and bytes, and the cold tier's blocks, bytes and migrations, summed
    over the pools."""
    groups = [p.stats() for p in pools]
    tiers = [p.tier_stats() for p in pools if isinstance(p, TieredBlockPool)]
    return {
        "total_blocks": sum(s.total_blocks for s in groups),
        "live_blocks": sum(s.live_blocks for s in groups),
        "cached_blocks": sum(s.cached_blocks for s in groups),
        "free_blocks": sum(s.free_blocks for s in groups),
        "bytes": sum(s.bytes for s in groups),
        "cold_blocks": sum(t.cold_blocks for t in tiers),
        "cold_bytes": sum(t.cold_bytes for t in tiers),
        "cold_capacity": sum(t.cold_capacity for t in tiers),
        "migrations": sum(t.migrations for t in tiers),
    }
