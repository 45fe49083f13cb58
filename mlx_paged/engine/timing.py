"""Where an engine's steps spend their time: host seconds per phase, summed over steps.

``PagedEngine.step`` marks each phase's end with ``StepClock.lap``, one
``perf_counter`` call per boundary. The phases:

- ``admit``: the scheduler choosing, adopting prefixes and reserving blocks;
- ``prefill``: prefill forwards, built, run and waited for, and first tokens sampled;
- ``build``: the decode forward's graph (the model's Python over the paged caches);
- ``dispatch``: handing that graph to the device (``mx.async_eval``);
- ``wait``: waiting for the decode's tokens and sampling them;
- ``emit``: recording tokens, finishing requests, parking their blocks;
- ``deliver``: the caller's ``on_event`` (a server's detokenizing and hand-off).
"""

from __future__ import annotations

import time

PHASES = ("admit", "prefill", "build", "dispatch", "wait", "emit", "deliver")


class StepClock:
    """Seconds spent in each of ``PHASES`` and the number of decode steps, since creation."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.decode_steps = 0
        self._last = time.perf_counter()

    def start(self) -> None:
        """Begin a step: time until the next ``lap`` counts for that lap's phase."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Add the time since the last mark to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def reset(self) -> None:
        """Zero every phase and the step count."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.decode_steps = 0
