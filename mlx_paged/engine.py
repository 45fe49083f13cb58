"""``PagedEngine``: continuous batching over the block pool.

Each ``step()``:

1. admits waiting requests while blocks allow: a request adopts the longest
   cached prefix of its tokens (no K/V copied) and prefills only the rest, in
   chunks; its full blocks are indexed right away so concurrent requests can
   share them;
2. runs one batched decode forward over every running sequence, each with its
   own offset and length, reading K/V where it lies in the blocks;
3. samples per request, and detaches finished sequences: their blocks are
   parked in the prefix index for the next request with the same prefix.

When the pool runs out of blocks during decode, the newest running sequence is
preempted: its blocks are parked, it goes back to the head of the queue, and
it resumes later from the cached prefix (usually all of it).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from .attention import route_attention
from .batch_cache import BatchPagedKVCache, DecodeBatch
from .block_pool import PagedCacheStats, check_block_size
from .cache import PagedKVCache, PagedLayout
from .kv_pool import BlockTable, KVPool
from .models import LayerKind
from .prefix_index import PrefixIndex

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class Event:
    """One generated token. ``finish_reason`` is ``"stop"``, ``"length"`` or ``None``."""

    uid: int
    token: int
    finish_reason: str | None


@dataclass(frozen=True)
class EngineStats(PagedCacheStats):
    """Pool counts (summed over layer groups) plus the engine's counters."""

    prefix_hit_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_live_blocks: int = 0


@dataclass(eq=False)
class Request:
    """One request's data; only the engine moves it between queues."""

    uid: int
    prompt: list[int]
    max_tokens: int
    sampler: Sampler | None
    logits_processors: list[LogitsProcessor]
    stop_tokens: frozenset[int]
    generated: list[int] = field(default_factory=list)
    tables: dict[LayerKind, BlockTable] | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]


class PagedEngine:
    """Runs many requests at once over one paged KV cache.

    Args:
        model: An mlx-lm model whose caches are all pageable (full attention
            and/or sliding window; not SSM/recurrent layers).
        block_size: Token slots per block.
        num_blocks: Blocks per layer group, or ``None`` to grow on demand.
        max_batch_size: Most sequences decoding at once.
        prefill_step_size: Most tokens per prefill forward.
        kv_dtype: Storage dtype for K/V; ``None`` keeps the model's.
    """

    def __init__(
        self,
        model: nn.Module,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_batch_size: int = 64,
        prefill_step_size: int = 512,
        kv_dtype: mx.Dtype | None = None,
    ):
        check_block_size(block_size)
        sizes = {"max_batch_size": max_batch_size, "prefill_step_size": prefill_step_size}
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}.")
        self.layout = PagedLayout.of(model)
        if self.layout.native:
            raise ValueError(
                f"{self.layout.family}: PagedEngine needs every cache to be paged, but this model "
                f"has {self.layout.native} recurrent/SSM caches; use make_paged_cache per request."
            )
        self.model = model
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.prefill_step_size = prefill_step_size
        self.kinds = list(self.layout.counts)
        self.pools = {
            kind: KVPool(n, block_size, num_blocks, kv_dtype)
            for kind, n in self.layout.counts.items()
        }
        self.index = PrefixIndex(
            [self.pools[k].blocks for k in self.kinds], [k.window for k in self.kinds]
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_uid = 0
        self._counters = dict(
            prefix_hit_tokens=0,
            prefilled_tokens=0,
            generated_tokens=0,
            preemptions=0,
            peak_live_blocks=0,
        )
        route_attention()

    # ---- public API -------------------------------------------------------

    def add_request(
        self,
        tokens: Sequence[int] | mx.array,
        max_tokens: int,
        sampler: Sampler | None = None,
        logits_processors: Iterable[LogitsProcessor] | None = None,
        stop_tokens: Iterable[int] | None = None,
    ) -> int:
        """Queue a prompt; return its uid.

        ``sampler`` maps log-probs ``(1, V)`` to a token (greedy if ``None``);
        ``logits_processors`` see ``(tokens, logits)`` first, as in mlx-lm.
        """
        prompt = tokens.tolist() if isinstance(tokens, mx.array) else list(tokens)
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token.")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}.")
        for kind, pool in self.pools.items():
            need = self._peak_blocks(kind, len(prompt), len(prompt) + max_tokens)
            if not pool.blocks.growable and need > pool.blocks.capacity:
                raise ValueError(
                    f"a prompt of {len(prompt)} tokens plus max_tokens={max_tokens} needs up to "
                    f"{need} blocks of {self.block_size}, but the pool has "
                    f"{pool.blocks.capacity}; use a larger num_blocks or a shorter request."
                )
        uid = self._next_uid
        self._next_uid += 1
        self.waiting.append(
            Request(
                uid=uid,
                prompt=prompt,
                max_tokens=max_tokens,
                sampler=sampler,
                logits_processors=list(logits_processors or []),
                stop_tokens=frozenset(stop_tokens or ()),
            )
        )
        return uid

    def step(self) -> list[Event]:
        """Admit and prefill what fits, then decode one token for every running request."""
        events = self._admit()
        if self.running:
            events += self._decode()
        return events

    def stream(self) -> Iterator[Event]:
        """Step until every request has finished, yielding events as they come."""
        while self.waiting or self.running:
            yield from self.step()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int = 256, **kwargs
    ) -> list[list[int]]:
        """Generate for every prompt (greedy unless ``sampler`` is given); return token ids."""
        uids = [self.add_request(p, max_tokens, **kwargs) for p in prompts]
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        for event in self.stream():
            if event.uid in out:
                out[event.uid].append(event.token)
        return [out[uid] for uid in uids]

    def stats(self) -> EngineStats:
        """Pool counts summed over layer groups, plus prefix hits, prefill and preemptions."""
        groups = [p.blocks.stats() for p in self.pools.values()]
        return EngineStats(
            total_blocks=sum(s.total_blocks for s in groups),
            live_blocks=sum(s.live_blocks for s in groups),
            cached_blocks=sum(s.cached_blocks for s in groups),
            free_blocks=sum(s.free_blocks for s in groups),
            block_size=self.block_size,
            bytes=sum(s.bytes for s in groups),
            **self._counters,
        )

    def check_invariants(self) -> None:
        """Assert refcounts equal holders in every group and the index agrees with the pools."""
        for kind, pool in self.pools.items():
            pool.blocks.check_invariants(tables=[r.tables[kind].blocks for r in self.running])
        self.index.check_invariants()
        assert len(self.running) <= self.max_batch_size, "batch over max_batch_size"

    # ---- admission and prefill --------------------------------------------

    def _admit(self) -> list[Event]:
        """Admit waiting requests in order while blocks and batch slots allow.

        A request is prefilled at once, chunk by chunk, when its suffix is
        long or when a request behind it starts with the same block: those can
        then adopt its blocks. The others (one chunk or less) are grouped by
        length and prefilled together in batched forwards.
        """
        events: list[Event] = []
        short: dict[tuple[int, bool], list[Request]] = {}  # (tokens, fresh) -> requests
        bs = self.block_size
        heads = Counter(tuple(r.prompt[:bs]) for r in self.waiting) if self.waiting else Counter()
        while self.waiting and len(self.running) < self.max_batch_size:
            req = self.waiting[0]
            # Adopting a shared partial tail costs a copy; an idle pool always
            # fits the request computed from scratch (add_request checked).
            if not self._adopt(req) and (self.running or not self._adopt(req, use_cache=False)):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = self._kv_target(req) - self._kv_length(req)
            head = tuple(req.prompt[:bs])
            heads[head] -= 1
            shared = self._kv_length(req) < bs <= n and heads[head] > 0
            if n > self.prefill_step_size or shared:
                events += self._prefill(req)
            elif n > 0:
                # Take the blocks now, so the next admission sees them gone.
                for kind in self.kinds:
                    t = req.tables[kind]
                    self.pools[kind].reserve(t, t.lengths[0], t.lengths[0] + n)
                short.setdefault((n, not req.generated), []).append(req)
            self._note_peak()
        assert self.running or not self.waiting, "an idle pool cannot take the next request"
        for (n, _), reqs in short.items():
            per_forward = max(1, self.prefill_step_size // n)
            for i in range(0, len(reqs), per_forward):
                events += self._prefill_batch(reqs[i : i + per_forward], n)
        return events

    def _adopt(self, req: Request, use_cache: bool = True) -> bool:
        """Give ``req`` tables holding its cached prefix and room for the rest, or wait."""
        tokens = req.tokens
        target = self._kv_target(req)
        match = self.index.match(tokens[: len(tokens) - 1]) if use_cache else None
        hit = match.length if match else 0
        tables = {}
        for g, kind in enumerate(self.kinds):
            pool = self.pools[kind]
            table = pool.new_table()
            if match:
                for b in match.blocks[g]:
                    pool.blocks.retain(b)
                table.blocks.extend(match.blocks[g])
                table.first = match.firsts[g]
            table.lengths[:] = [hit] * pool.num_layers
            tables[kind] = table
        # Leave each running sequence (and this one) a block to decode into.
        headroom = len(self.running) + 1
        need = {k: self._blocks_to_write(k, tables[k], hit, target) for k in self.kinds}
        if not all(self.pools[k].blocks.can_allocate(n + headroom) for k, n in need.items()):
            for kind, table in tables.items():
                self.pools[kind].release(table)
            return False
        req.tables = tables
        self._counters["prefix_hit_tokens"] += hit
        return True

    def _blocks_to_write(self, kind: LayerKind, table: BlockTable, start: int, end: int) -> int:
        """Blocks a prefill of ``[start, end)`` takes; a window keeps only its last blocks."""
        need = self.pools[kind].blocks_needed(table, start, end)
        return min(need, self._peak_blocks(kind, end - start, end))

    def _peak_blocks(self, kind: LayerKind, prefill: int, total: int) -> int:
        """Most blocks one sequence holds at once, prefilling ``prefill`` of ``total`` tokens."""
        span = -(-total // self.block_size) + 1
        if kind.window is None:
            return span
        chunk = min(self.prefill_step_size, prefill)
        return min(span, -(-(kind.window + chunk) // self.block_size) + 1)

    def _prefill(self, req: Request) -> list[Event]:
        """Write K/V for one request's uncomputed tokens, chunk by chunk.

        A new request's last token runs on its own: only its logits are needed,
        and the head over every prompt position would cost more than the model.
        """
        tokens, fresh = req.tokens, not req.generated
        start, end = self._kv_length(req), self._kv_target(req)
        body = end - 1 if fresh else end
        caches = self.layout.bind(self.pools, req.tables, PagedKVCache)
        for lo in range(start, body, self.prefill_step_size):
            hi = min(body, lo + self.prefill_step_size)
            self.model(mx.array(tokens[lo:hi])[None], cache=caches)
            mx.eval([c.state for c in caches])
            # Index full blocks at once: requests running alongside can share
            # them, and sliding-window blocks stay cached after the window passes.
            self.index.insert(tokens, self._table_spans(req), length=hi, partial=False)
        self._counters["prefilled_tokens"] += end - start
        if not fresh:
            return []
        logits = self.model(mx.array(tokens[end - 1 : end])[None], cache=caches)[:, -1, :]
        mx.eval(logits, [c.state for c in caches])
        self.index.insert(tokens, self._table_spans(req), length=end, partial=False)
        return self._first_tokens([req], logits)

    def _prefill_batch(self, reqs: list[Request], n: int) -> list[Event]:
        """Prefill ``n`` uncomputed tokens of each request (all new, or all resumed) together."""
        fresh = not reqs[0].generated
        body = n - 1 if fresh else n
        if body:
            self._forward_batch(reqs, body)
        self._counters["prefilled_tokens"] += n * len(reqs)
        if not fresh:
            return []
        return self._first_tokens(reqs, self._forward_batch(reqs, 1))

    def _forward_batch(self, reqs: list[Request], n: int) -> mx.array:
        """Run the next ``n`` tokens of each request (blocks reserved); return last logits."""
        starts = [self._kv_length(r) for r in reqs]
        batches = {
            kind: DecodeBatch(self.pools[kind], [r.tables[kind] for r in reqs], kind.window, n)
            for kind in self.kinds
        }
        caches = self.layout.bind(self.pools, batches, BatchPagedKVCache)
        inputs = mx.array([r.tokens[s : s + n] for r, s in zip(reqs, starts, strict=True)])
        logits = self.model(inputs, cache=caches)[:, -1, :]  # (B, V)
        mx.eval(logits if n == 1 else [], [c.state for c in caches])
        for batch in batches.values():
            batch.finish()
        for r, s in zip(reqs, starts, strict=True):
            self.index.insert(r.tokens, self._table_spans(r), length=s + n, partial=False)
        return logits

    def _first_tokens(self, reqs: list[Request], logits: mx.array) -> list[Event]:
        """Sample the first token of new requests (resumed ones already have theirs)."""
        fresh = [i for i, r in enumerate(reqs) if not r.generated]
        if not fresh:
            return []
        chosen = [reqs[i] for i in fresh]
        rows = logits if len(fresh) == len(reqs) else logits[mx.array(fresh)]
        tokens = self._sample(chosen, rows)
        return [self._emit(r, t) for r, t in zip(chosen, tokens, strict=True)]

    def _kv_length(self, req: Request) -> int:
        """Tokens of ``req`` whose K/V is written."""
        return req.tables[self.kinds[0]].lengths[0]

    def _kv_target(self, req: Request) -> int:
        """Tokens that need K/V before decoding: all of a new prompt, all but the
        last token of a resumed request (the decode step feeds that one)."""
        return len(req.tokens) - 1 if req.generated else len(req.tokens)

    # ---- decode -----------------------------------------------------------

    def _decode(self) -> list[Event]:
        for kind in self.kinds:
            if kind.window is not None:  # blocks wholly before the window go back first
                for r in self.running:
                    t = r.tables[kind]
                    self.pools[kind].drop_before(t, max(0, t.lengths[0] - kind.window + 1))
        self._reserve_decode_blocks()
        batches = {
            kind: DecodeBatch(self.pools[kind], [r.tables[kind] for r in self.running], kind.window)
            for kind in self.kinds
        }

        caches = self.layout.bind(self.pools, batches, BatchPagedKVCache)
        inputs = mx.array([[r.last_token] for r in self.running])  # (B, 1)
        logits = self.model(inputs, cache=caches)[:, -1, :]  # (B, V)
        tokens = self._sample(self.running, logits)
        for b in batches.values():
            b.finish()
        running = list(self.running)
        return [self._emit(r, t) for r, t in zip(running, tokens, strict=True)]

    def _reserve_decode_blocks(self) -> None:
        """Give every running sequence a private block for its next token, preempting if short."""
        while True:
            short = False
            for kind in self.kinds:
                pool = self.pools[kind]
                need = 0
                for r in self.running:
                    t = r.tables[kind]
                    need += pool.blocks_needed(t, t.lengths[0], t.lengths[0] + 1)
                short |= not pool.blocks.can_allocate(need)
            if not short:
                break
            assert len(self.running) > 1, "one request alone outgrew the pool"
            self._preempt(self.running[-1])
        for r in self.running:
            for kind in self.kinds:
                t = r.tables[kind]
                self.pools[kind].reserve(t, t.lengths[0], t.lengths[0] + 1)
        self._note_peak()  # the most blocks a step holds: all running, each with its next slot

    def _preempt(self, req: Request) -> None:
        """Park a running request's blocks and requeue it first; it resumes from the cache."""
        self._detach(req)
        self.waiting.appendleft(req)
        self._counters["preemptions"] += 1

    # ---- sampling and bookkeeping -----------------------------------------

    def _sample(self, reqs: list[Request], logits: mx.array) -> list[int]:
        """One token per request from ``(B, V)`` logits, each with its own settings."""
        greedy = [i for i, r in enumerate(reqs) if r.sampler is None and not r.logits_processors]
        if len(greedy) == len(reqs):  # the common case: one argmax, one transfer
            return mx.argmax(logits, axis=-1).tolist()
        out: list[mx.array | None] = [None] * len(reqs)
        if greedy:
            picked = mx.argmax(logits[mx.array(greedy)], axis=-1)
            for j, i in enumerate(greedy):
                out[i] = picked[j]
        for i, r in enumerate(reqs):
            if out[i] is not None:
                continue
            x = logits[i : i + 1]
            for proc in r.logits_processors:
                x = proc(mx.array(r.tokens), x)
            logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
            out[i] = (r.sampler or (lambda lp: mx.argmax(lp, -1)))(logprobs).reshape(())
        return mx.stack(out).tolist()

    def _emit(self, req: Request, token: int) -> Event:
        req.generated.append(token)
        self._counters["generated_tokens"] += 1
        reason = None
        if token in req.stop_tokens:
            reason = "stop"
        elif len(req.generated) >= req.max_tokens:
            reason = "length"
        if reason is not None:
            self._detach(req)
        return Event(req.uid, token, reason)

    def _detach(self, req: Request) -> None:
        """Park a sequence's blocks in the prefix index and drop its tables."""
        self.index.insert(req.tokens, self._table_spans(req), length=self._kv_length(req))
        for kind, table in req.tables.items():
            self.pools[kind].release(table)
        req.tables = None
        self.running.remove(req)

    def _table_spans(self, req: Request) -> list[tuple[int, list[int]]]:
        return [(req.tables[k].first, req.tables[k].blocks) for k in self.kinds]

    def _note_peak(self) -> None:
        live = sum(p.blocks.stats().live_blocks for p in self.pools.values())
        self._counters["peak_live_blocks"] = max(self._counters["peak_live_blocks"], live)
