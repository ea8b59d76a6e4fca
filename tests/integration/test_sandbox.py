"""The sandbox: untrusted Python in a subprocess, held to its limits (real subprocesses)."""

from __future__ import annotations

import os
import time

import pytest

from trainer_svc.inputs.code_reward import passes_tests
from trainer_svc.inputs.sandbox import SandboxLimits, code_block, isolation, run_python

FAST = SandboxLimits(wall_s=3.0, cpu_s=1)


def test_code_runs_and_its_output_comes_back() -> None:
    result = run_python("import sys\nprint(6*7)\nprint('warn', file=sys.stderr)", FAST)
    assert result.ok and result.stdout == "42\n" and result.stderr == "warn\n"
    failed = run_python("raise SystemExit(3)", FAST)
    assert (failed.ok, failed.exit_code, failed.ended) == (False, 3, "exit")


def test_an_infinite_loop_is_killed_by_the_cpu_limit() -> None:
    started = time.monotonic()
    result = run_python("while True: pass", FAST)
    assert result.ended == "cpu" and not result.ok
    assert time.monotonic() - started < FAST.wall_s  # CPU limit first, not the wall clock


def test_a_sleeping_child_is_killed_at_the_wall_limit() -> None:
    started = time.monotonic()
    result = run_python("import time\nprint('before', flush=True)\ntime.sleep(60)",
                        SandboxLimits(wall_s=1.0, cpu_s=1))
    assert result.ended == "timeout" and result.stdout == "before\n"
    assert time.monotonic() - started < 3.0
    assert "[killed: wall-time limit]" in result.text()


def test_a_memory_bomb_is_refused() -> None:
    result = run_python("x = bytearray(2 * 1024**3)\nprint('allocated')", FAST)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_socket_creation_fails_and_the_network_is_not_there() -> None:
    result = run_python("import socket\nsocket.socket()", FAST)
    assert not result.ok and "PermissionError: sandbox: socket.__new__" in result.stderr
    for code in ("import socket\nsocket.create_connection(('127.0.0.1', 80))",
                 "import socket\nsocket.getaddrinfo('localhost', 80)",
                 "import subprocess\nsubprocess.run(['true'])", "import os\nos.fork()",
                 "import ctypes"):
        out = run_python(code, FAST)
        assert not out.ok and "PermissionError: sandbox:" in out.stderr, code
    # The namespace (here, as in CI: root, util-linux): only a loopback device is there.
    assert isolation().network_namespace
    devices = run_python("for line in open('/proc/net/dev').readlines()[2:]:\n"
                         "    print(line.split(':')[0].strip())", FAST)
    assert devices.ok and devices.stdout.split() == ["lo"]


def test_output_is_truncated_at_the_limit() -> None:
    limits = SandboxLimits(wall_s=3.0, cpu_s=1, max_output_bytes=1000)
    result = run_python("import sys\nfor _ in range(10**6): sys.stdout.write('x' * 100)",
                        limits)
    assert result.truncated and result.stdout == "x" * 1000
    assert "[output truncated]" in result.text()


def test_the_environment_is_scrubbed_and_the_directory_empty(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLBOOST_SANDBOX_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.listdir('.'))\n"
                        "print(os.getuid())", FAST)
    assert result.ok, result.stderr
    names, files, _ = result.stdout.splitlines()
    assert "RLBOOST_SANDBOX_TEST_SECRET" not in names and "hunter2" not in result.stdout
    assert names == "['HOME', 'LANG', 'PATH', 'TMPDIR']" and files == "['main.py']"
    if os.geteuid() == 0:
        assert isolation().as_nobody  # root's files are not the code's to write
        leak = run_python("open('/root/.rlboost-sandbox-probe', 'w')", FAST)
        assert not leak.ok and "PermissionError" in leak.stderr


def test_code_block_takes_the_last_fenced_block() -> None:
    text = "first\n```python\nx = 1\n```\nthen\n```\nprint(2)\n```\n"
    assert code_block(text) == "print(2)\n"
    assert code_block("no code") is None


def test_the_code_reward_runs_a_candidate_against_its_tests() -> None:
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert passes_tests("write add", good, tests) == 1.0
    assert passes_tests("write add", "```python\ndef add(a, b):\n    return a - b\n```",
                      tests) == 0.0
    assert passes_tests("write add", "```python\nimport socket\nsocket.socket()\n"
                      "def add(a, b):\n    return a + b\n```", tests) == 0.0
    with pytest.raises(ValueError, match="needs tests"):
        passes_tests("write add", good, None)
