"""A plain progress bar on stderr, for the one-time model conversion and long prefills.

On a terminal it redraws one line in place; elsewhere (CI logs, pipes) it prints
a single line when it closes, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """``ProgressBar("prefill", total=4096)``; call ``update(n)`` then ``close()``.

    Args:
        label: What is being counted, printed before the bar.
        total: The count at which the work is done.
        unit: Unit name shown after the counts.
        stream: Where to draw; stderr by default so stdout stays the answer.
    """

    WIDTH = 30

    def __init__(self, label: str, total: int, unit: str = "", stream: TextIO | None = None):
        self.label = label
        self.total = max(int(total), 1)
        self.unit = unit
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self.live = self.stream.isatty()
        self.closed = False
        if self.live:
            self._draw()

    def update(self, done: int) -> None:
        """Set the count reached so far (absolute, not an increment)."""
        self.done = min(int(done), self.total)
        if self.live:
            self._draw()

    def close(self) -> None:
        """Finish the line (on a terminal) or print the one summary line (elsewhere)."""
        if self.closed:
            return
        self.closed = True
        if self.live:
            self._draw()
            self.stream.write("\n")
        else:
            self.stream.write(self._line() + "\n")
        self.stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _line(self) -> str:
        filled = self.WIDTH * self.done // self.total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        secs = time.perf_counter() - self.start
        unit = f" {self.unit}" if self.unit else ""
        return f"{self.label} [{bar}] {self.done}/{self.total}{unit} {secs:.1f}s"

    def _draw(self) -> None:
        self.stream.write("\r" + self._line())
        self.stream.flush()
