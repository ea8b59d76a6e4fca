"""Refusing instances of another protocol version at their heartbeat, before strict decoding.

Contract: every heartbeat's ``protocol`` is read leniently first (:func:`shared.protocol.
peek_version`; a beat without it is version 0, from before versions), since a beat of another
version may not decode strictly at all and would otherwise be dropped beat by beat as malformed,
the instance never told why. One of another version is answered with a
:class:`~shared.protocol.Refused` naming both versions (tiny and tagged, so any version reads
it), counted, and logged once per instance id; its instance exits. Nothing else is done for it:
it never registered, so it holds nothing.
"""

from __future__ import annotations

import logging

from manager_svc.metrics import ManagerMetrics
from shared.protocol import PROTOCOL_VERSION, Refused, peek_version

log = logging.getLogger("manager")
LOGGED_MAX = 4096  # instance ids whose refusal was logged (then forgotten, and logged again)


class VersionGate:
    def __init__(self, metrics: ManagerMetrics) -> None:
        self.metrics = metrics
        self._logged: set[str] = set()

    def refuse(self, data: bytes, sender: str) -> Refused | None:
        """The refusal of a heartbeat ``data`` from instance ``sender``; None to decode it.
        What is not even a JSON object is left to the strict decode (counted as malformed)."""
        version = peek_version(data)
        if version is None or version == PROTOCOL_VERSION:
            return None
        self.metrics.protocol_refused.inc()
        detail = (f"instance {sender[:64]} speaks protocol version {version}; this manager "
                  f"speaks {PROTOCOL_VERSION}: run an image of the manager's release")
        if sender not in self._logged:
            if len(self._logged) >= LOGGED_MAX:
                self._logged.clear()
            self._logged.add(sender)
            log.warning("refused at join: %s", detail)
        return Refused(detail=detail)
