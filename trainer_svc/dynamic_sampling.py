"""Dynamic sampling (DAPO §3.2, eq. 11) on the trainer's side: which groups a step keeps.

Contract: :class:`GroupFilter` follows one step's groups by prompt index as they are scored,
in any order, and says what to do next; it does no I/O. A group is *informative* when its
rewards are not all equal (:func:`~trainer_svc.learn.algorithms.advantages.is_informative`); an
all-equal group has zero advantage under every group estimator and is never trained on.

The step keeps the ``target`` (``prompts_per_step``) informative groups of lowest prompt index.
That rule, not "the first to complete", makes the training data a function of the run seed
alone: prompts are drawn by index from it and responses are seeded per (step, prompt, sample),
so a run with migrations, restarts or another instance count keeps the same groups as a
fault-free one (design invariant 5). Consequences:

* :meth:`GroupFilter.release` gives each informative group as soon as it is surely kept: even
  if every unscored group below it were informative, fewer than ``target`` lie below. Those of
  the first ``target`` prompts are released on arrival, so they still stream.
* :meth:`GroupFilter.action` asks for more prompts only when the step cannot reach ``target``
  even if every group still in flight is informative; it asks for the shortfall divided by the
  informative share seen so far (so usually one extension suffices), within ``max_prompts``
  (veRL's ``max_num_gen_batches``). Asking early or late changes cost, never which groups are
  kept. It closes the step once the lowest ``target`` informative groups are all scored, or,
  at ``max_prompts`` with every group scored, on those it has (``capped``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer_svc.learn.algorithms.advantages import is_informative

MIN_SHARE = 0.125  # an extension is at most 8x the shortfall, however few groups were informative


@dataclass(frozen=True, slots=True)
class Extend:
    first: int  # the first new prompt index (the step's prompt count now)
    count: int  # how many prompts to add


@dataclass(frozen=True, slots=True)
class Close:
    keep: list[int]  # prompt indices trained on
    filtered: list[int]  # scored, all-equal rewards, at or below the last kept index
    capped: bool  # max_prompts reached with fewer than target informative groups


@dataclass(slots=True)
class GroupFilter:
    target: int  # informative groups the step trains on (prompts_per_step)
    max_prompts: int  # the most prompts the step may have
    prompts: int  # prompts in the step now (the manager's count; only grows)
    informative: dict[int, bool] = field(default_factory=dict)  # scored groups
    released: set[int] = field(default_factory=set)
    closed: bool = False

    def add(self, prompt_index: int, rewards: Sequence[float]) -> bool:
        """Record a scored group; returns whether it is informative."""
        self.informative[prompt_index] = is_informative(rewards)
        self.prompts = max(self.prompts, prompt_index + 1)
        return self.informative[prompt_index]

    def sync(self, prompts: int) -> None:
        """The manager's prompt count (a restarted trainer learns extensions from it)."""
        self.prompts = max(self.prompts, prompts)

    def release(self) -> list[int]:
        """Informative groups now surely kept and not given before, in prompt order."""
        out, below = [], 0  # informative or unscored groups below p: an upper bound
        for p in range(self.prompts):
            if below >= self.target:
                break
            flag = self.informative.get(p)
            if flag and p not in self.released:
                self.released.add(p)
                out.append(p)
            if flag is None or flag:
                below += 1
        return out

    def action(self) -> Extend | Close | None:
        """What the step needs now: more prompts, closing, or nothing (wait for groups)."""
        if self.closed:
            return None
        keep: list[int] = []
        filtered: list[int] = []
        for p in range(self.prompts):
            flag = self.informative.get(p)
            if flag is None:
                break
            (keep if flag else filtered).append(p)
            if len(keep) == self.target:
                return self._close(keep, filtered, capped=False)
        else:  # every group scored, fewer than target informative
            if self.prompts >= self.max_prompts:
                return self._close(keep, filtered, capped=True)
        scored = len(self.informative)
        found = sum(self.informative.values())
        unscored = self.prompts - scored
        short = self.target - found - unscored
        if short <= 0 or self.prompts >= self.max_prompts:
            return None
        share = max(MIN_SHARE, found / scored if scored else 1.0)
        count = min(math.ceil(short / share), self.max_prompts - self.prompts)
        return Extend(first=self.prompts, count=count)

    def _close(self, keep: list[int], filtered: list[int], capped: bool) -> Close:
        self.closed = True
        return Close(keep=keep, filtered=filtered, capped=capped)
