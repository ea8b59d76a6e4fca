"""``python -m rollout_svc``: read config, set up logging, run one instance until told to leave."""

from __future__ import annotations

import asyncio

from rollout_svc.engine import create_engine
from rollout_svc.service import RolloutService
from shared.config import RolloutConfig
from shared.logs import setup_logging
from shared.process import die_with_parent


def main() -> None:
    die_with_parent()
    cfg = RolloutConfig.from_env()
    setup_logging(cfg.common.log_level, f"rollout[{cfg.instance_id}]")
    options: dict[str, object] = {"max_batch": cfg.max_batch}
    if cfg.engine == "torch":
        options["threads"] = cfg.common.torch_threads
    if cfg.engine == "emu":
        options["time_scale"] = cfg.common.emu_time_scale
    engine = create_engine(cfg.engine, **options)
    asyncio.run(RolloutService(cfg, engine).run())


if __name__ == "__main__":
    main()
