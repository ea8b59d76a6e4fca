"""One logging setup for every service: one line per record, the service name in each."""

from __future__ import annotations

import logging
import sys


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
