"""``python -m trainer_svc.torchrun RANKS [RESTARTS]``: the trainer as an elastic torchrun group.

Contract: runs ``torchrun --standalone --nproc-per-node RANKS --max-restarts RESTARTS -m
trainer_svc`` in this process (torchrun's agent is this process, so a launcher that signals
it signals the whole group). When any rank dies (killed, out of memory, a lost collective)
torchrun stops the others and starts the group again, up to RESTARTS times; the new rank 0
takes the run back from its last checkpoint like any restarted trainer, and the rest of the
step is redone (:mod:`trainer_svc.learn.policies.distributed`). A group that fails more often than
that ends this process with torchrun's error, so a supervisor above sees one failed trainer.

Like every service started by ``rlboost up`` the agent exits when its launcher is gone
(:func:`shared.process.die_with_parent`); torchrun then stops its ranks. The ranks inherit a
clean environment: torchrun's own variables from an enclosing job would confuse this one.
"""

from __future__ import annotations

import argparse
import os

from shared.process import die_with_parent

# What torchrun sets per rank; inherited copies (a launcher inside a job) would confuse ours.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                 "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
DEFAULT_RESTARTS = 3


def torchrun_args(ranks: int, restarts: int = DEFAULT_RESTARTS) -> list[str]:
    """torchrun's command line for a trainer group of ``ranks`` processes on this node."""
    if ranks < 1 or restarts < 0:
        raise ValueError(f"ranks must be >= 1 and restarts >= 0 (got {ranks}, {restarts})")
    # The agent checks its ranks twice a second (torchrun's default: every 5 s), so a dead
    # rank's group is torn down and restarted before the run's lease notices a gap.
    return ["--standalone", "--nproc-per-node", str(ranks), "--max-restarts", str(restarts),
            "--monitor-interval", "0.5", "-m", "trainer_svc"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer_svc.torchrun",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("ranks", type=int, help="trainer processes (one per GPU)")
    parser.add_argument("restarts", type=int, nargs="?", default=DEFAULT_RESTARTS,
                        help="how often the group is started again after a rank dies")
    args = parser.parse_args(argv)
    for name in TORCHRUN_VARS:
        os.environ.pop(name, None)
    die_with_parent()
    # Imported late: torch takes seconds to import, and a bad command line should not wait.
    from torch.distributed.run import main as torchrun

    torchrun(torchrun_args(args.ranks, args.restarts))


if __name__ == "__main__":
    main()
