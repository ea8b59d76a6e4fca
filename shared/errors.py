"""Errors shared by every service.

    RlboostError(retryable)
    ├── ConfigError        a missing or invalid environment variable (not retryable)
    ├── ProtocolError      a bus message that does not parse as its type (dropped, counted)
    ├── PeerTimeout        a request to another service got no reply in time (retryable)
    ├── PeerError          the other service answered with an error (retryable if it says so)
    └── WeightsError       a weight download or upload failed (retryable unless corrupt at source)

Each service package adds its own subclasses; REST layers turn them into 4xx with a ``detail``.
"""

from __future__ import annotations


class RlboostError(Exception):
    retryable: bool = False


class ConfigError(RlboostError):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


class ProtocolError(RlboostError):
    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(f"malformed {kind}: {problem}")
        self.kind = kind
        self.problem = problem


class PeerTimeout(RlboostError):
    retryable = True

    def __init__(self, peer: str, timeout_s: float) -> None:
        super().__init__(f"no reply from {peer} within {timeout_s:.1f}s")
        self.peer = peer
        self.timeout_s = timeout_s


class PeerError(RlboostError):
    def __init__(self, peer: str, detail: str, retryable: bool) -> None:
        super().__init__(f"{peer}: {detail}")
        self.peer = peer
        self.detail = detail
        self.retryable = retryable


class WeightsError(RlboostError):
    def __init__(self, problem: str, retryable: bool = True) -> None:
        super().__init__(problem)
        self.retryable = retryable
