"""Crash points: a test hook that kills the manager inside one multi-key change.

Contract: every change the manager makes to several Redis keys (a step's creation, the seeding
hand-off) must be atomic or complete when re-run from any prefix. The fault tests prove it by
naming points between its writes in ``RLBOOST_CRASH_POINTS``: the manager SIGKILLs itself the
first time it reaches each (no cleanup, as a host loss), and a marker file in the data dir keeps
the restarted process, with the same environment, from dying there again. Unset (production),
:meth:`CrashPoints.reach` is a set lookup and nothing else.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

log = logging.getLogger("manager")

# The points the manager's code names, in the order one step reaches them.
STEP_CREATE_REQUESTS = "step_create.requests"  # a batch of responses written, more to come
STEP_CREATE_COMMIT = "step_create.commit"  # every response written, the step not yet
HANDOFF_FLUSH = "handoff.flush"  # reserved instances asked to flush, nothing revoked
HANDOFF_REVOKE = "handoff.revoke"  # one reserved response revoked, others not yet
HANDOFF_FREE = "handoff.free"  # every reserved response revoked, reserved side not yet free
POINTS = (STEP_CREATE_REQUESTS, STEP_CREATE_COMMIT, HANDOFF_FLUSH, HANDOFF_REVOKE, HANDOFF_FREE)


class CrashPoints:
    def __init__(self, spec: str, data_dir: Path) -> None:
        self.armed = {p.strip() for p in spec.split(",") if p.strip()}
        unknown = self.armed - set(POINTS)
        if unknown:
            raise ValueError(f"RLBOOST_CRASH_POINTS: unknown points {sorted(unknown)}")
        self.data_dir = data_dir

    def marker(self, point: str) -> Path:
        return self.data_dir / f"crashed-at-{point}"

    def reach(self, point: str) -> None:
        if point not in self.armed:
            return
        marker = self.marker(point)
        if marker.exists():
            self.armed.discard(point)
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        log.warning("crash point %s: killing the manager", point)
        os.kill(os.getpid(), signal.SIGKILL)
