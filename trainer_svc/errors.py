"""The trainer's errors, beneath :class:`shared.errors.RlboostError`.

    RlboostError
    └── RunAborted   the run was cancelled or failed elsewhere, or its checkpoint does not fit
                     the step the manager asks for: drop the run and poll again (not retryable)

Any other :class:`~shared.errors.RlboostError` that is retryable (the bus or Redis restarting)
makes the trainer redo the step; one that is not fails the run.
"""

from __future__ import annotations

from shared.errors import RlboostError


class RunAborted(RlboostError):
    """The run was cancelled or failed elsewhere; drop it and poll again."""
