"""Real ``torchrun`` jobs for tests: a clean environment and the one command line.

A test process may itself sit inside a torchrun job (or have its variables set), so the job's
environment drops torchrun's own variables before torchrun sets them again; the repository goes
on ``PYTHONPATH`` so a rank can import the services and the test modules, and each rank gets one
intra-op thread (two ranks on a small machine would otherwise thrash, and a CPU matmul's
summation order may depend on the thread count).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from trainer_svc.torchrun import TORCHRUN_VARS  # what torchrun sets per rank

REPO = Path(__file__).resolve().parents[2]


def torchrun_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) made fit to start a torchrun job."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in TORCHRUN_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_job(script: Path | str, *args: str, ranks: int = 2,
            timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node <ranks> script args...`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), str(script), *args],
        cwd=REPO, env=torchrun_env(), capture_output=True, text=True, timeout=timeout_s,
    )

