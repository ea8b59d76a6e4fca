"""Process hygiene for services started by a launcher (``rlboost up``, tests).

A launcher that dies must not leave its services running. The kernel's parent-death signal is
no good here: it fires when the *thread* that forked the child exits, and launchers (fault
injectors in particular) spawn from threads. So the launcher passes its pid in
RLBOOST_PARENT_PID, and :func:`die_with_parent` watches it from a daemon thread: once the
launcher is gone the service gets SIGTERM, its ordinary graceful-shutdown path.
"""

from __future__ import annotations

import os
import signal
import threading
import time

CHECK_S = 1.0


def exit_on_sigterm() -> None:
    """For launchers: SIGTERM raises SystemExit, so ``finally`` blocks stop the children (and
    the brokers, which are not Python and cannot watch their parent) instead of orphaning them."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def die_with_parent() -> None:
    parent = os.environ.get("RLBOOST_PARENT_PID")
    if not parent or not parent.isdigit():
        return
    pid = int(parent)

    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # a service that ignores SIGTERM too long is not left behind
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
