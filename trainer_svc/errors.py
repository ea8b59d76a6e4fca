"""The trainer's errors, beneath :class:`shared.errors.RlboostError`.

    RlboostError
    └── RunAborted   the run was cancelled or failed elsewhere, or its checkpoint does not fit
                     the step the manager asks for: drop the run and poll again (not retryable)
    └── RunSpecError what the spec names cannot be used (a dataset file, a column, a reward
                     function): the run fails with this message (not retryable)

Any other :class:`~shared.errors.RlboostError` that is retryable (the bus or Redis restarting)
makes the trainer redo the step; one that is not fails the run.
"""

from __future__ import annotations

from shared.errors import RlboostError


class RunAborted(RlboostError):
    """The run was cancelled or failed elsewhere; drop it and poll again."""


class RunSpecError(RlboostError):
    """The run's spec names data or a reward that cannot be used; the message says which
    (path, key or function) and why. The run fails; the trainer goes on with the next."""
