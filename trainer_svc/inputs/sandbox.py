"""Running untrusted Python (a model's code, a candidate solution) in a limited subprocess.

Contract:

- :func:`run_python(code, limits)` runs ``code`` as ``__main__`` in a fresh interpreter and
  returns a :class:`SandboxResult` (stdout, stderr, exit code, and why it ended: ``exit``,
  ``timeout`` or ``cpu``). It never raises for what the code does; an ``OSError`` means the
  sandbox itself could not start.
- Limits (:class:`SandboxLimits`), set by the standard library's ``resource`` module in the
  child before the code runs, hard and soft alike (an unprivileged process cannot raise a hard
  limit back): CPU seconds (``RLIMIT_CPU``: SIGKILL past it), address space (``RLIMIT_AS``:
  a large allocation raises MemoryError), bytes written to any one file (``RLIMIT_FSIZE``),
  open files (``RLIMIT_NOFILE``), no core files. The parent kills the child's process group
  past ``wall_s`` (a ``sleep`` uses no CPU). stdout and stderr go to files capped by
  ``RLIMIT_FSIZE`` at ``max_output_bytes`` + 1, so a print loop cannot fill memory or disk;
  the result holds at most ``max_output_bytes`` of each and says if it was cut.
- The child: ``python -I -S -u`` (isolated: no ``PYTHON*`` variables, no user or site
  packages, so the standard library only), an empty temporary working directory removed
  afterwards, and an environment of ``PATH``, ``LANG``, ``HOME`` and ``TMPDIR`` (the last two
  the working directory) only: nothing of the caller's environment reaches it.

Security (what it stops, what it does not):

- Network: where the kernel lets this process create a user and network namespace
  (``unshare --user --map-root-user --net``, util-linux; works unprivileged on Linux with
  user namespaces enabled, and as root), the child runs in a network namespace with only a
  down loopback device: no packet leaves it, whatever code it runs, native code included.
  :func:`isolation` says whether that is so here; where it is not, the sandbox still runs
  and logs a warning once.
- Always, in addition: a Python audit hook (:pep:`578`) refuses socket creation, name
  look-ups, process creation (fork, exec, spawn, ``subprocess``, ``os.system``) and loading
  native libraries (``ctypes``). Audit hooks are not a security boundary on their own (code
  that gets past them, e.g. through a C extension bug, is unconstrained by them); they stop
  ordinary Python code and make a refusal a clear ``PermissionError``.
- As root, the child runs as ``nobody`` (uid and gid 65534), so it cannot write root's files
  or signal root's processes. It can still read whatever ``nobody`` can read on the host
  (world-readable files): the sandbox is no filesystem jail and holds no secrets apart from
  the environment. Not stopped: reading world-readable files, using up to the limits above,
  and, without the network namespace, native code that opens sockets past the audit hook.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
NOBODY = 65534
_UNSHARE = ("unshare", "--user", "--map-root-user", "--net")
_MAIN = "main.py"
# Runs in the child before the code: limits, then the audit hook, then the code as __main__.
# Its argv: the limits, as integers.
_CHILD = r"""
import resource, sys
cpu, mem, fsize, nofile = map(int, sys.argv[1:5])
for what, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem),
                    (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, nofile),
                    (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
BLOCKED = ("socket.__new__", "socket.bind", "socket.connect", "socket.getaddrinfo",
           "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto", "os.fork",
           "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.kill",
           "os.killpg", "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
           "_posixsubprocess", "pty.spawn", "sys.addaudithook")
def hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
with open("main.py") as f:
    source = f.read()
sys.argv = ["main.py"]
sys.addaudithook(hook)
del hook, resource, f
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


# A fenced code block: ```python (or ```py, or bare ```) ... ```.
CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def code_block(text: str) -> str | None:
    """The last fenced code block of ``text`` (a model's answer), or None."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    wall_s: float = 5.0  # killed past this, whatever it is doing
    cpu_s: int = 5  # RLIMIT_CPU, whole seconds
    memory_bytes: int = 512 << 20  # RLIMIT_AS: the interpreter itself needs ~30 MiB of it
    max_output_bytes: int = 16 << 10  # of stdout and of stderr each
    max_open_files: int = 64

    def __post_init__(self) -> None:
        if self.wall_s <= 0 or self.cpu_s < 1 or self.memory_bytes < (64 << 20) \
                or self.max_output_bytes < 1 or self.max_open_files < 8:
            raise ValueError(f"sandbox limits out of range: {self}")


@dataclass(frozen=True, slots=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int  # the child's; negative: killed by that signal
    ended: str  # "exit", "timeout" (past wall_s) or "cpu" (past cpu_s)
    truncated: bool  # stdout or stderr was cut at max_output_bytes

    @property
    def ok(self) -> bool:
        return self.ended == "exit" and self.exit_code == 0

    def text(self) -> str:
        """stdout, then stderr, and a last line saying how it ended when not by itself."""
        parts = [self.stdout, self.stderr]
        if self.truncated:
            parts.append("[output truncated]\n")
        if self.ended == "timeout":
            parts.append("[killed: wall-time limit]\n")
        elif self.ended == "cpu":
            parts.append("[killed: CPU-time limit]\n")
        return "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)


@dataclass(frozen=True, slots=True)
class Isolation:
    network_namespace: bool  # the child runs in a network namespace of its own
    as_nobody: bool  # the child's uid is nobody's (this process is root)
    interpreter: str  # the Python the child runs


def _candidates() -> list[str]:
    """This interpreter, then the system's: a root-only directory (/root/.pyenv) may hide the
    first from nobody. The child needs the standard library alone (-S)."""
    found = [os.path.realpath(sys.executable)]
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system:
        found.append(os.path.realpath(system))
    return list(dict.fromkeys(found))


def _runs(argv: list[str], user: int | None) -> bool:
    try:
        return subprocess.run(argv, user=user, group=user,
                              extra_groups=[] if user is not None else None,
                              capture_output=True, timeout=10, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def isolation() -> Isolation:
    """The strongest isolation this host allows, probed once: an interpreter nobody can run
    (when this process is root) and a network namespace, each where possible."""
    users = [NOBODY, None] if os.geteuid() == 0 else [None]
    for user in users:
        for python in _candidates():
            for prefix in (_UNSHARE, ()):
                if _runs([*prefix, python, "-I", "-S", "-c", "pass"], user):
                    how = Isolation(bool(prefix), user is not None, python)
                    _warn(how)
                    return how
    raise OSError("sandbox: no Python interpreter runs here, even without isolation")


def _warn(how: Isolation) -> None:
    if not how.network_namespace:
        log.warning("sandbox: no network namespace on this host (unshare --net refused); "
                    "only the audit hook keeps sandboxed code off the network")
    if os.geteuid() == 0 and not how.as_nobody:
        log.warning("sandbox: no interpreter that user nobody can run; sandboxed code runs "
                    "as root (in its own user namespace where there is one)")


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` under ``limits``; see the module doc for what it may and may not do."""
    how = isolation()
    with tempfile.TemporaryDirectory(prefix="rlboost-sandbox-") as tmp:
        work, out_dir = Path(tmp, "work"), Path(tmp, "out")
        work.mkdir()
        out_dir.mkdir(mode=0o700)
        (work / _MAIN).write_text(code)
        if how.as_nobody:
            os.chown(work, NOBODY, NOBODY)
            os.chmod(tmp, 0o711)  # nobody may pass through to work/, not list or read out/
        argv = [*(_UNSHARE if how.network_namespace else ()), how.interpreter, "-I", "-S", "-u",
                "-c", _CHILD, str(limits.cpu_s), str(limits.memory_bytes),
                str(limits.max_output_bytes + 1), str(limits.max_open_files)]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work),
               "TMPDIR": str(work)}
        user = NOBODY if how.as_nobody else None
        with open(out_dir / "stdout", "wb") as out, open(out_dir / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, user=user, group=user,
                                    extra_groups=[] if how.as_nobody else None,
                                    process_group=0)
            ended = _wait(proc, limits.wall_s)
        stdout, cut_out = _read(out_dir / "stdout", limits.max_output_bytes)
        stderr, cut_err = _read(out_dir / "stderr", limits.max_output_bytes)
        result = SandboxResult(stdout, stderr, proc.returncode, ended, cut_out or cut_err)
        # Files the child made are nobody's; the temporary directory removes them as root.
        shutil.rmtree(work, ignore_errors=True)
    return result


def _wait(proc: subprocess.Popen[bytes], wall_s: float) -> str:
    try:
        code = proc.wait(timeout=wall_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return "timeout"
    finally:
        _kill_group(proc)  # anything the code left behind in its group
    # RLIMIT_CPU sends SIGXCPU at the soft limit; soft = hard, so SIGKILL follows at once.
    return "cpu" if code in (-signal.SIGXCPU, -signal.SIGKILL) else "exit"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit
