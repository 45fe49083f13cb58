"""The scheduler's side of a hybrid model's recurrent state: slots and due snapshots.

Pure Python over ids, like the scheduler: ``StateSlots`` (whose storage subclass
copies the arrays) hands out slots and snapshot ids; the ``PrefixIndex`` holds
each snapshot on the node ending where it was taken.
"""

from __future__ import annotations

from ..blocks import PrefixIndex, PrefixMatch, StateSlots
from .request import Request

#: On CUDA, a cut ends a prefill forward only ``interval // SPAN_FRACTION`` tokens or more
#: past the last: there a hybrid's forward costs about as much for 8 tokens as for 512
#: (BENCHMARKS.md, run 639), so a few tokens recomputed by a later request cost less
#: than a forward more for every request of a burst (runs 647-649). Elsewhere every cut
#: is kept: on Metal and the CPU a forward's cost is mostly its tokens (not measured on
#: Metal).
SPAN_FRACTION = 4


class RecurrentStates:
    """Gives running requests state slots and keeps snapshots where the state exists.

    Snapshots are due after a prefill forward ending at a multiple of ``interval``,
    at the end of the last full block before decoding, or where the prompt stops
    sharing cached blocks with earlier ones (a shared prefix, say a system prompt,
    whose end no snapshot marks yet); the scheduler ends prefill forwards at these
    ``Request.cuts``. On CUDA, each is at least ``interval // SPAN_FRACTION`` tokens past
    the one before (or the adopted snapshot): a closer cut would cost a forward of its own
    now to save recomputing fewer tokens later. Snapshots are also taken where a sequence
    stops (``detach``).

    Args:
        slots: Slot and snapshot ids (the engine's ``StatePool``).
        index: The prefix index that holds the snapshots.
        interval: Tokens between snapshots of a long prefill (a multiple of the
            block size).
    """

    def __init__(self, slots: StateSlots, index: PrefixIndex, interval: int):
        if interval <= 0 or interval % index.block_size:
            raise ValueError(f"interval {interval} is not a multiple of {index.block_size}.")
        self.slots, self.index, self.interval = slots, index, interval
        #: Fewest tokens between a prefill's cuts: on CUDA ``interval // SPAN_FRACTION``
        #: (set by the engine's ``Prefiller``, which knows the device), else 1.
        self.min_span = 1

    def attach(self, req: Request, match: PrefixMatch | None, target: int) -> None:
        """Give an admitted request a slot holding the state at its adopted prefix, and the
        positions up to ``target`` where its prefill stops to take snapshots."""
        req.slot = self.slots.take_slot(match.snapshot if match else None)
        assert req.slot is not None, "no state slot free under max_batch_size"
        bs, hit = self.index.block_size, match.length if match else 0
        shared = self.index.full_blocks_matched(req.tokens[:target])
        due = {*range(self.interval, target + 1, self.interval), target // bs * bs, shared}
        cuts, last = [], hit
        for cut in sorted(c for c in due if hit < c <= target):
            if cut - last >= self.min_span:
                cuts.append(cut)
                last = cut
        req.cuts = frozenset(cuts)
        req.shared_past_snapshot = shared - hit if shared in req.cuts else 0

    def wrote(self, req: Request) -> None:
        """After a prefill forward: snapshot the state if ``req`` stopped at a cut."""
        if req.written in req.cuts:
            self._snapshot(req)

    def detach(self, req: Request) -> None:
        """A sequence stops: keep its state at ``written`` and free its slot (no state past
        its tokens: an overlapped step may have run a token the host then refused)."""
        if 0 < req.written <= len(req.tokens):
            self._snapshot(req)
        self.slots.free_slot(req.slot)
        req.slot, req.cuts, req.shared_past_snapshot = None, frozenset(), 0

    def stats(self) -> dict[str, int]:
        """The state counters of ``EngineStats``."""
        s = self.slots.stats()
        return {
            "state_slots_used": s.slots_used,
            "state_bytes": s.slot_bytes,
            "state_snapshots": s.snapshots,
            "state_snapshot_bytes": s.snapshot_bytes,
        }

    def check_invariants(self, running: list[Request]) -> None:
        """Assert that running requests hold exactly the taken slots, the index every snapshot."""
        self.slots.check_invariants([r.slot for r in running], self.index.snapshots)

    def _snapshot(self, req: Request) -> None:
        self.index.add_snapshot(req.tokens, req.written, lambda: self.slots.snapshot(req.slot))
