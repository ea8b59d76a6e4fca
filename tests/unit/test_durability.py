"""Every Redis the project starts syncs each write before it answers (appendfsync always).

The manager acks a chunk to the stream only after its commit script returned: with
``everysec`` a host crash could lose a second of commits the stream no longer holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlboost.stack import Server

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def redis_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted(COMPOSE.glob("*.yml")):
        services = (yaml.safe_load(path.read_text()) or {}).get("services", {})
        for name, service in services.items():
            command = service.get("command") or []
            if command and command[0] == "redis-server":
                found.append((f"{path.name}:{name}", [str(c) for c in command]))
    return found


def fsync_policy(argv: list[str]) -> str | None:
    return argv[argv.index("--appendfsync") + 1] if "--appendfsync" in argv else None


@pytest.mark.parametrize(("where", "argv"), redis_commands())
def test_compose_redis_syncs_every_write(where: str, argv: list[str]) -> None:
    assert "--appendonly" in argv and argv[argv.index("--appendonly") + 1] == "yes", where
    assert fsync_policy(argv) == "always", where


def test_compose_files_start_a_redis() -> None:
    assert len(redis_commands()) >= 2  # local dev and the reserved side: the walk works


def test_embedded_redis_syncs_every_write(tmp_path: Path) -> None:
    server = Server("redis", 0, tmp_path, tmp_path / "redis.log")
    assert fsync_policy(server.argv()) == "always"
