"""``python -m trainer_svc``: read config, set up logging, train runs until SIGTERM.

Under ``torchrun --nproc-per-node N -m trainer_svc`` rank 0 is this same service (its policy
spreads the work, see :mod:`trainer_svc.learn.policies.distributed`) and ranks > 0 serve rank 0's
commands. When rank 0 stops (SIGTERM, SIGINT) it sends the workers Stop before leaving the
group; when torchrun itself is signalled it signals every rank, and a worker simply exits.
A rank that finds the group broken (a peer died) exits with status 1, so torchrun restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import torch

from shared.config import TrainerConfig
from shared.logs import setup_logging
from shared.process import die_with_parent
from shared.settings import reveal
from trainer_svc.errors import group_lost
from trainer_svc.learn.policies import WeightsAccess, distributed
from trainer_svc.learn.policies.fsdp import sharding_of
from trainer_svc.service import TrainerService

log = logging.getLogger("trainer")


async def _serve(cfg: TrainerConfig) -> None:
    service = TrainerService(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    await service.run()


def main() -> None:
    launch = distributed.Launch.from_env()
    if launch is None:
        # Under torchrun the ranks' parent is torchrun, not the launcher named in the
        # environment, and torchrun tears its ranks down itself.
        die_with_parent()
    cfg = TrainerConfig.from_env()
    rank = launch.rank if launch is not None else 0
    setup_logging(cfg.common.log_level, "trainer" if rank == 0 else f"trainer-rank{rank}")
    if cfg.common.torch_threads:
        torch.set_num_threads(cfg.common.torch_threads)
    if launch is None or launch.world_size < 2:
        asyncio.run(_serve(cfg))
        return
    # Every rank gets the weight service's address: a sharded version is uploaded by all.
    distributed.init(launch, sharding_of(cfg),
                     WeightsAccess(str(cfg.common.weights_url), reveal(cfg.common.weights_token),
                                   cfg.common.tls))
    try:
        if rank == 0:
            asyncio.run(_serve(cfg))
        else:
            distributed.worker_loop()
    except Exception as exc:
        lost = group_lost(exc)
        if lost is None:
            raise
        # One line, not a traceback: torchrun (trainer_svc.torchrun) restarts the group.
        log.error("rank %d leaves the group: %s", rank, lost)
        raise SystemExit(1) from None
    finally:
        distributed.shutdown()


if __name__ == "__main__":
    main()
