"""One logging setup for every service: one line per record, the service name in each."""

from __future__ import annotations

import logging
import sys
import time


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    # nats-py logs every reconnect attempt at ERROR; our own code reports outages once.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    # One line per HTTP request of the weight client would drown the service's own story.
    logging.getLogger("httpx").setLevel(logging.WARNING)


class Throttled:
    """One warning line per ``every_s`` at most, however often it recurs: for what a hostile
    peer can repeat at will (forged frames, refused claims), whose counters say how many."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._next = 0.0
        self._held = 0  # lines not written since the last one

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            msg, args = msg + " (and %d more not logged)", (*args, self._held)
        self._held, self._next = 0, now + self.every_s
        self.logger.warning(msg, *args)
