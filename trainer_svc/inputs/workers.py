"""Worker processes that run user code (rewards, environments) for the trainer, killably.

Contract:

- :class:`Worker` is one child process running ``<module>.main(argv)`` (``module``: a worker
  module of this package, e.g. :mod:`trainer_svc.inputs.reward_worker`), reached over a
  socket pair wrapped as a ``multiprocessing.connection.Connection`` (length-framed pickles),
  so user code that prints cannot corrupt the channel: stdout and stderr stay the trainer's.
- The first message is ``init`` (whatever the worker module reads: a spec, its search path,
  options); the worker answers ``("ready", "")`` or ``("init_error", cause)``, which
  :meth:`Worker.ensure_started` raises as ``init_error(spec, cause)``. Each later message is
  one call; :meth:`Worker.call` returns the worker's ``(kind, detail)`` reply, or
  ``("timeouts", ...)`` when none came within the timeout (the worker is killed) or
  ``("crashed", ...)`` when the worker died. It never raises for the user code.
- A worker runs in a process group of its own, and :meth:`Worker.kill` kills the group
  (SIGKILL: code stuck in C cannot be interrupted any other way), so what the user code
  started beside it (a sandbox child) ends with it.
- A worker's environment is :func:`worker_env` of the trainer's: only the variables on
  :data:`WORKER_ENV` (and its prefixes) and the ``extra`` names the operator adds
  (RLBOOST_REWARD_ENV). The trainer's tokens and passwords stay out of reach of user code.
- Worker side: :func:`worker_main` wraps a module's ``serve(conn)``: SIGINT ignored (the
  trainer decides when workers end), and the worker exits within a second of its parent's
  death, even mid-call.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# The directory that holds the trainer_svc package (trainer_svc/inputs/workers.py, two up).
_ROOT = str(Path(__file__).resolve().parents[2])
# The worker imports nothing of the trainer's (no torch; trainer_svc/__init__.py and
# trainer_svc/inputs/__init__.py import nothing): starting it takes ~0.1 s plus the user
# code's own imports.
_BOOTSTRAP = (
    "import sys, importlib; sys.path.insert(0, sys.argv.pop(1)); "
    "importlib.import_module(sys.argv.pop(1)).main(sys.argv[1:])"
)
PARENT_CHECK_S = 0.5
# What user code may need of the trainer's environment: finding programs and its home, the
# locale, how Python starts and where it imports from, HF caches in offline mode, and how many
# threads numeric libraries take. Nothing that names a service or carries a credential.
WORKER_ENV = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
    "PYTHONIOENCODING", "PYTHONUTF8", "PYTHONWARNINGS", "PYTHONNOUSERSITE", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "RLBOOST_REWARD_PATH",
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE", "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS", "COVERAGE_PROCESS_START",
})
WORKER_ENV_PREFIXES = ("LC_",)  # the locale's categories


def worker_env(parent: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """A worker's environment from the trainer's ``parent``: the variables named by
    :data:`WORKER_ENV` (or starting with a :data:`WORKER_ENV_PREFIXES` prefix) and the
    ``extra`` names the operator asked for (RLBOOST_REWARD_ENV); HF_TOKEN is not among them."""
    env = {k: v for k, v in parent.items()
           if k in WORKER_ENV or k.startswith(WORKER_ENV_PREFIXES)}
    env.update({k: parent[k] for k in extra if k in parent})
    return env


class WorkerStartError(RuntimeError):
    """A worker that could not be started (not the user code's own failure)."""


class Worker:
    """One worker process and its channel; used by one thread at a time."""

    def __init__(self, module: str, init: tuple[Any, ...], start_timeout_s: float,
                 env: Mapping[str, str], init_error: Callable[[str, str], Exception]) -> None:
        """``init``: the first message, whose second item names the spec for errors."""
        self.module = module
        self.init = init
        self.label = f"{getattr(init_error, 'kind', 'worker')} {init[1]!r}"
        self.start_timeout_s = start_timeout_s
        self.env = dict(env)
        self.init_error = init_error
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and self.conn is not None

    def ensure_started(self) -> None:
        if self.alive:
            return
        self.kill()
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, _ROOT, self.module, str(theirs.fileno()),
                 str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=self.env,
                process_group=0,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(self.init)
        if not self.conn.poll(self.start_timeout_s):
            self.kill()
            raise WorkerStartError(
                f"{self.label}: worker did not start in {self.start_timeout_s:g}s")
        try:
            kind, detail = self.conn.recv()
        except EOFError as exc:
            self.kill()
            raise WorkerStartError(f"{self.label}: worker exited at start") from exc
        if kind == "init_error":
            self.kill()
            raise self.init_error(str(self.init[1]), str(detail))

    def call(self, item: Any, timeout_s: float) -> tuple[str, Any]:
        """The worker's ``(kind, detail)`` reply, or a failure kind; never raises."""
        try:
            self.ensure_started()
        except Exception as exc:  # a start that fails now is this call's failure, not ours
            return "crashed", f"could not restart the worker: {exc}"
        assert self.conn is not None
        try:
            self.conn.send(item)
            if not self.conn.poll(timeout_s):
                self.kill()
                return "timeouts", f"no result within {timeout_s:g}s; worker killed"
            kind, detail = self.conn.recv()
        except (EOFError, OSError) as exc:
            code = self.proc.poll() if self.proc is not None else None
            self.kill()
            return "crashed", f"worker died mid-call (exit code {code}): {exc!r}"
        return str(kind), detail

    def kill(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        """End the worker: a closed channel tells it to exit; a stuck one is killed."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1.0)
        self.kill()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(1)


def worker_main(argv: Sequence[str], serve: Callable[[Connection], None]) -> None:
    """A worker module's ``main``: ``argv`` is ``[fd, parent pid]`` from :class:`Worker`."""
    fd, parent_pid = int(argv[0]), int(argv[1])
    # Ctrl-C reaches the whole process group; the trainer decides when workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    serve(Connection(fd))
