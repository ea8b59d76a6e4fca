"""What a step has produced, in the order the trainer may train it: groups, then the barrier.

Contract: :class:`StepEvents` takes the bus's announcements for every step: a group complete
(with its samples when they fit in one message), and a barrier or a seeding hand-off, which
only mean "ask the manager now". :class:`StepFeed` follows one step: :meth:`StepFeed.groups`
yields each group of the step exactly once and ends at the step's barrier, leaving the
barrier's digest in :attr:`StepFeed.digest`. Groups come

* as they are announced, but held back while the reserved side is still generating (the
  manager's ``train_now``: during the seeding window both share the reserved GPUs), then in
  the order they came;
* at the barrier, every group not given yet, in prompt order, from the manager's committed
  samples paged in: groups too large for one message, and groups that completed while this
  trainer was not listening (how a restarted trainer redoes a step).

With dynamic sampling (``dynamic=True``) no barrier comes until the trainer has decided, from
the groups' rewards, which it keeps (:mod:`trainer_svc.dynamic_sampling`), so groups are given
as announced whatever ``train_now`` says (the trainer defers their training itself, reading
:attr:`StepFeed.train_now`), and a group the manager reports complete at two polls in a row
without its announcement having come (a restarted trainer) is paged in then.
:attr:`StepFeed.prompts` is the step's prompt count as the manager last said.

The manager is asked for the step's state every poll period, or at once when a barrier or a
hand-off is announced; announcements are awaited a quarter period at a time, so a held group
is released within that of ``train_now``. Every wait is bounded, and a cancel (the trainer
stopping) ends any of them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from nats.aio.msg import Msg as NatsMsg

from shared.errors import ProtocolError
from shared.protocol import Digest, GroupDone, Sample, decode
from trainer_svc.manager_client import ManagerClient

log = logging.getLogger("trainer")
# Put on the queue to wake a waiting step loop; it belongs to no step.
_WAKE = GroupDone(run_id="", step=-1, prompt_index=-1)


class StepEvents:
    """The bus's announcements about steps in progress, for the step loop to wait on."""

    def __init__(self) -> None:
        self._groups: asyncio.Queue[GroupDone] = asyncio.Queue()
        self.poll_now = asyncio.Event()  # a barrier or hand-off was announced: ask at once

    async def on_group(self, msg: NatsMsg) -> None:
        try:
            await self._groups.put(decode(msg.data, GroupDone))
        except ProtocolError as exc:
            log.warning("dropped %s", exc)

    async def on_barrier(self, _: NatsMsg) -> None:
        """A barrier or a seeding hand-off: ask the manager for the step's state right away."""
        self.poll_now.set()
        await self._groups.put(_WAKE)  # the step loop waits on the group queue

    async def next_group(self, timeout_s: float) -> GroupDone | None:
        """The next announcement, or None if none comes within ``timeout_s``."""
        # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel (see
        # shared.process.wait_event) and a stopping trainer would go on polling.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                return await self._groups.get()
        return None


class StepFeed:
    def __init__(self, manager: ManagerClient, events: StepEvents, run_id: str, step: int,
                 poll_s: float, dynamic: bool = False) -> None:
        self.manager = manager
        self.events = events
        self.run_id = run_id
        self.step = step
        self.poll_s = poll_s
        self.digest: Digest | None = None  # the barrier's, once groups() has reached it
        self.dynamic = dynamic
        self.prompts = 0  # the step's prompt count at the last poll
        self.train_now = False  # the manager's, at the last poll
        self._given: set[int] = set()  # prompt indices already yielded

    async def groups(self) -> AsyncIterator[tuple[int, list[Sample]]]:
        """Each group of the step once, as (prompt index, samples), up to the barrier."""
        held: list[GroupDone] = []  # announced, waiting for train_now
        train_now, last_poll = False, 0.0
        missed: set[int] = set()  # complete at the last poll, never announced here
        while True:
            event = await self.events.next_group(self.poll_s / 4)
            # A group too large for one message comes without samples: it is given from the
            # paged samples at the barrier.
            if event is not None and (event.run_id, event.step) == (self.run_id, self.step) \
                    and event.samples:
                held.append(event)
            if train_now or self.dynamic:
                for done in held:
                    if self._first(done.prompt_index):
                        yield done.prompt_index, done.samples
                held.clear()
            if time.monotonic() - last_poll < self.poll_s and not self.events.poll_now.is_set():
                continue
            last_poll = time.monotonic()
            self.events.poll_now.clear()
            state = await self.manager.step_state(self.run_id, self.step)
            train_now = self.train_now = state.train_now
            self.prompts = max(self.prompts, state.prompts)
            if state.complete:
                break
            late = {p for p in state.groups_done if p not in self._given}
            if late & missed:
                for prompt_index, group in await self._paged(state.done, late & missed):
                    yield prompt_index, group
            missed = late
        self.digest = state.digest
        self.train_now = True
        for prompt_index, group in await self._paged(state.done, None):
            yield prompt_index, group

    async def _paged(self, done: int, wanted: set[int] | None) -> list[tuple[int, list[Sample]]]:
        """The step's committed groups in ``wanted`` (None: all) not given yet, paged in."""
        by_prompt: dict[int, list[Sample]] = {}
        for s in await self.manager.samples(self.run_id, self.step, done):
            if wanted is None or s.prompt_index in wanted:
                by_prompt.setdefault(s.prompt_index, []).append(s)
        return [(p, group) for p, group in sorted(by_prompt.items()) if self._first(p)]

    def _first(self, prompt_index: int) -> bool:
        """True the first time a group is given, never again: a group trains once per step."""
        if prompt_index in self._given:
            return False
        self._given.add(prompt_index)
        return True
