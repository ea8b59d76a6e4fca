"""Soft state the manager's parts share: a nudge for the dispatcher and the stopping flag.

Contract: nothing here is state in the design's sense; a restarted manager starts with a fresh
one and loses nothing. ``wake`` makes the dispatcher look again at once rather than at its next
interval (set by whatever changed what dispatch would decide: new work, work handed back, a
finished step); ``stopping`` ends every background loop at its next turn. The service makes
one and hands it to each part that needs it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class SoftState:
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # dispatch: look again now
    stopping: bool = False  # set by ManagerService.stop(): background loops end
