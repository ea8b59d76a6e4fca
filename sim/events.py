"""The event queue: simulated time, and a deterministic order for simultaneous events.

Events at the same instant run in the order they were scheduled (a serial breaks ties), so a
run is a pure function of its configuration: no wall clock, no hash order, no threads.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

Action = Callable[[], None]


@dataclass
class EventQueue:
    now: float = 0.0
    processed: int = 0
    _heap: list[tuple[float, int, Action]] = field(default_factory=list)
    _serial: int = 0

    def at(self, time: float, action: Action) -> None:
        """Run ``action`` at ``time`` (never before now)."""
        self._serial += 1
        heapq.heappush(self._heap, (max(time, self.now), self._serial, action))

    def after(self, delay: float, action: Action) -> None:
        self.at(self.now + delay, action)

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        while self._heap and self._heap[0][0] <= end and not stop():
            time, _, action = heapq.heappop(self._heap)
            self.now = time
            self.processed += 1
            action()
        if not stop():
            self.now = max(self.now, end)

    def __len__(self) -> int:
        return len(self._heap)
