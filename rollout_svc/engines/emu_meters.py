"""What an emulated engine measures of the host it runs on: EMULATION diagnostics.

The emu engine sleeps modelled GPU time; everything else its process does takes real time on
shared cores, which a time-compressed emulation magnifies (at 40x, 25 ms of Python is a
modelled second). Two meters log what that costs, in emulated milliseconds, for ``make
bench-sim-check`` to charge in the simulator beside the hardware model:

* :class:`HostMeter`: a busy engine's wall time between two steps beyond the modelled sleep,
  per modelled decode step;
* :class:`RefillMeter`: how long a slot that freed with no work waiting stays empty until a
  request arrives: the control plane's round trip (the response's last chunk committed, the
  dispatcher's pass, the next lease delivered), as the simulator's ``Costs.control_s``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger("rollout.emu")

HOST_LOG_STEPS = 200
REFILL_LOG = 50
# A slot that waits longer than this (emulated) waited for work that did not exist yet (the
# step's tail, a training phase), not for the control plane: not a refill.
REFILL_BOUND_S = 10.0


@dataclass(slots=True)
class HostMeter:
    """Wall time between the starts of two steps of one busy stretch, less the first one's
    modelled sleep, summed. A stretch ends when a step leaves no batch (the service stops
    stepping until work comes: that wait, a whole training phase, is not host time); each
    stretch is logged as it ends, and a long one every ``HOST_LOG_STEPS`` steps."""

    time_scale: float
    host_s: float = 0.0  # wall seconds since the last log line
    steps: int = 0  # modelled decode steps (a step() of a token-scaled engine runs several)
    calls: int = 0  # step() calls, which pay the host time: a log line every HOST_LOG_STEPS
    _last: float | None = None  # start of the previous busy step
    _slept: float = 0.0  # its modelled sleep, wall seconds
    _decodes: int = 0  # its modelled decode steps

    def begin(self, now: float) -> None:
        if self._last is not None and self._slept > 0:
            self.host_s += max(0.0, now - self._last - self._slept)
            self.steps += self._decodes
            self.calls += 1
            if self.calls >= HOST_LOG_STEPS:
                self._log()
        self._last, self._slept, self._decodes = now, 0.0, 0

    def slept(self, seconds: float, decodes: int = 1) -> None:
        self._slept += seconds
        self._decodes += decodes

    def idle(self) -> None:
        """The batch ran empty: the busy stretch is over."""
        self._last, self._slept, self._decodes = None, 0.0, 0
        self._log()

    def _log(self) -> None:
        if self.steps and self.time_scale > 0:
            log.info("emu host time %.3f ms per decode step over %d steps",
                     1e3 * self.host_s / self.steps / self.time_scale, self.steps)
        self.host_s, self.steps, self.calls = 0.0, 0, 0


@dataclass(slots=True)
class RefillMeter:
    """When slots free with nothing waiting for them, and how long until requests come:
    first freed, first filled. Logged every ``REFILL_LOG`` refills."""

    time_scale: float
    wait_s: float = 0.0  # wall seconds since the last log line
    refills: int = 0
    _freed: deque[float] = field(default_factory=deque)  # wall times of empty slots
    _lock: threading.Lock = field(default_factory=threading.Lock)  # step thread vs add()

    def freed(self, now: float, slots: int) -> None:
        with self._lock:
            self._freed.extend([now] * slots)

    def filled(self, now: float) -> None:
        """A request arrived: it takes the slot that has been empty longest, if any."""
        with self._lock:
            if not self._freed:
                return
            wait = now - self._freed.popleft()
            if wait <= REFILL_BOUND_S * self.time_scale:
                self.wait_s += wait
                self.refills += 1
            if self.refills >= REFILL_LOG:
                self._log()

    def reset(self) -> None:
        """No slot waits any more (the engine dropped its work); what was measured is
        logged."""
        with self._lock:
            self._freed.clear()
            self._log()

    def _log(self) -> None:
        if self.refills and self.time_scale > 0:
            log.info("emu refill wait %.3f ms over %d refills",
                     1e3 * self.wait_s / self.refills / self.time_scale, self.refills)
        self.wait_s, self.refills = 0.0, 0
