"""The weight versions a run keeps for its user: what ``rlboost export`` can take away.

Contract: the trainer publishes every version to the weight service, which collects all but the
newest few. The run spec's ``save_every`` and ``keep_last`` choose the versions that stay:
every ``save_every``-th one (versions count optimizer steps, so version v holds the weights after
step v - 1) and the final one, ``save_every = 0`` meaning the final one only; of those, the newest
``keep_last`` (0: all). A kept version is pinned in the weight service, one that falls out of the
newest ``keep_last`` is unpinned (and collected with the rest).

Which versions are kept is a pure function of the spec and the version just published, so a
trainer that restarts between a pin and an unpin recomputes the same calls: both are idempotent.
This is apart from the trainer's own checkpoint (:mod:`trainer_svc.learn.checkpoint`), written after
every step with the optimizer's state, which a restarted trainer and ``POST /resume`` go on from.
"""

from __future__ import annotations

from shared.spec import RunSpec
from shared.tls import Tls
from shared.weights import pin_version, unpin_version


def kept_versions(spec: RunSpec, version: int) -> list[int]:
    """The versions kept once ``version`` is published, oldest first."""
    every = spec.save_every
    points = list(range(every, version + 1, every)) if every else []
    if version >= spec.steps and spec.steps not in points:
        points.append(spec.steps)  # the final version, whatever save_every
    return points[-spec.keep_last:] if spec.keep_last else points


async def keep_saved(weights_url: str, token: str | None, run_id: str, spec: RunSpec,
                     version: int, tls: Tls | None = None) -> list[int]:
    """Pin ``version`` if it is kept, unpin the one it pushes out; returns the kept versions."""
    kept = kept_versions(spec, version)
    if version in kept:
        await pin_version(weights_url, token, run_id, version, tls=tls)
    for old in sorted(set(kept_versions(spec, version - 1)) - set(kept)):
        await unpin_version(weights_url, token, run_id, old, tls=tls)
    return kept
