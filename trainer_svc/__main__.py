"""``python -m trainer_svc``: read config, set up logging, train runs until SIGTERM."""

from __future__ import annotations

import asyncio
import signal

import torch

from shared.config import TrainerConfig
from shared.logs import setup_logging
from shared.process import die_with_parent
from trainer_svc.service import TrainerService


async def _serve(cfg: TrainerConfig) -> None:
    service = TrainerService(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    await service.run()


def main() -> None:
    die_with_parent()
    cfg = TrainerConfig.from_env()
    setup_logging(cfg.common.log_level, "trainer")
    if cfg.common.torch_threads:
        torch.set_num_threads(cfg.common.torch_threads)
    asyncio.run(_serve(cfg))


if __name__ == "__main__":
    main()
