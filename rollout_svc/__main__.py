"""``python -m rollout_svc``: read config, set up logging, run instances until told to leave.

One process is one instance, except with the ``emu`` engine, where RLBOOST_EMU_INSTANCES=N runs
N emulated instances (ids ``<id>-0`` .. ``<id>-N-1``) in one event loop, so scale experiments
need not pay a Python process per instance. SIGTERM is a preemption notice for all of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rollout_svc.engines import create_engine
from rollout_svc.engines.emu_models import serving_model
from rollout_svc.service import RolloutService
from shared.config import RolloutConfig
from shared.errors import ConfigError
from shared.logs import setup_logging
from shared.process import die_with_parent


def build(cfg: RolloutConfig) -> list[RolloutService]:
    if cfg.instances > 1 and cfg.engine != "emu":
        raise ConfigError("RLBOOST_EMU_INSTANCES", "several instances per process need emu")
    configs = [cfg] if cfg.instances == 1 else [
        cfg.model_copy(update={"instance_id": f"{cfg.instance_id}-{k}"})
        for k in range(cfg.instances)]
    try:
        model = serving_model(cfg.emu_model)
    except ValueError as exc:
        raise ConfigError("RLBOOST_EMU_MODEL", str(exc)) from None
    services = []
    for c in configs:
        options: dict[str, object] = {"max_batch": c.max_batch}
        if c.engine == "torch":
            options["threads"] = c.common.torch_threads
        if c.engine == "emu":
            options["time_scale"] = c.common.emu_time_scale
            options.update(stall_after_s=c.emu_stall_after_s, slow_after_s=c.emu_slow_after_s,
                           slow_factor=c.emu_slow_factor)
            options.update(model.engine_options(), true_context=c.emu_true_context,
                           token_scale=c.common.emu_token_scale)
            if c.kind == "reserved":
                # A reserved instance shares GPUs with the trainer that just produced the
                # version: it swaps weights in device memory instead of pulling and loading a
                # checkpoint like a spot instance.
                options["load_s"] = model.swap_s
            elif c.emu_link:
                # The pull went over the weight service's (rate-limited) link for real.
                options["load_s"] = model.pcie_load_s
        if c.engine == "sglang":
            options["url"], options["launch_args"] = c.sglang_url, c.sglang_args
        services.append(RolloutService(c, create_engine(c.engine, **options)))
    return services


async def serve(services: list[RolloutService]) -> None:
    def notice(reason: str) -> None:
        for service in services:
            service.notice(reason)

    loop = asyncio.get_running_loop()
    # Every instance steps its engine in a worker thread (and may load weights in another): the
    # default pool (cores + 4 threads) would leave instances of a packed emu process waiting
    # for a thread, i.e. fewer emulated GPUs than configured.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=2 * len(services) + 4,
                                                 thread_name_prefix="engine"))
    loop.add_signal_handler(signal.SIGTERM, notice, "preempt")
    loop.add_signal_handler(signal.SIGINT, notice, "shutdown")
    await asyncio.gather(*(s.run() for s in services))


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc; 0 where that cannot be read)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def main() -> None:
    die_with_parent()
    cfg = RolloutConfig.from_env()
    setup_logging(cfg.common.log_level, f"rollout[{cfg.instance_id}]")
    logging.getLogger("rollout").info("rollout config: %s", cfg.describe())
    if cfg.engine == "emu" and cfg.kind == "spot":
        # EMULATION of a spot VM's boot and engine start: it registers only after them,
        # counted from the process's start, so the interpreter's own start-up on busy cores
        # is part of them rather than added to them.
        boot = cfg.common.emu_time_scale * cfg.common.emu_start_s
        time.sleep(max(0.0, boot - process_age_s()))
    services = build(cfg)
    asyncio.run(serve(services))
    refused = next((s.refused for s in services if s.refused), None)
    if refused:  # e.g. an image of another protocol version: restarting it cannot help
        raise SystemExit(f"refused by the manager: {refused}")


if __name__ == "__main__":
    main()
