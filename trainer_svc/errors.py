"""The trainer's errors, beneath :class:`shared.errors.RlboostError`.

    RlboostError
    └── RunAborted   the run was cancelled or failed elsewhere, or its checkpoint does not fit
                     the step the manager asks for: drop the run and poll again (not retryable)
    └── RunSpecError what the spec names cannot be used (a dataset file, a column, a reward
                     function): the run fails with this message (not retryable)
    └── GroupLost    a rank of the torchrun group died: the trainer process exits and torchrun
                     restarts the group; the run is not failed

Any other :class:`~shared.errors.RlboostError` that is retryable (the bus or Redis restarting)
makes the trainer redo the step; one that is not fails the run.
"""

from __future__ import annotations

import re

from shared.errors import RlboostError

# What a collective raises on a rank whose peer is gone. gloo raises a plain RuntimeError
# ("[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer ... typically caused by a
# remote worker crashing"), measured with torch 2.13 by SIGKILLing one of two ranks mid
# all-reduce; nccl raises torch.distributed.DistBackendError (a DistError).
_PEER_GONE = re.compile(r"gloo/transport|Connection (closed|reset) by peer|Broken pipe|"
                        r"remote worker crashing|NCCL communicator was aborted|"
                        r"ProcessGroupNCCL's watchdog")


class RunAborted(RlboostError):
    """The run was cancelled or failed elsewhere; drop it and poll again."""


class RunSpecError(RlboostError):
    """The run's spec names data or a reward that cannot be used; the message says which
    (path, key or function) and why. The run fails; the trainer goes on with the next."""


class GroupLost(RlboostError):
    """A rank of the trainer's torchrun group is gone (killed, out of memory, its host lost):
    the group's collectives can never complete again. Rank 0 exits instead of failing the run,
    torchrun starts the group again and the new rank 0 takes the run back from its last
    checkpoint (:mod:`trainer_svc.torchrun`)."""


def group_lost(exc: BaseException) -> GroupLost | None:
    """``exc`` as a :class:`GroupLost` when it (or what caused it) is a collective that lost a
    peer; None for anything else, which keeps its usual meaning (a bad model fails the run)."""
    seen: BaseException | None = exc
    visited: set[int] = set()  # a context chain can loop back on itself
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, GroupLost):
            return seen
        if any(k.__name__ == "DistError" for k in type(seen).__mro__) or \
                _PEER_GONE.search(str(seen)):
            return GroupLost(f"a trainer rank is gone: {seen}")
        seen = seen.__cause__ or seen.__context__
    return None
