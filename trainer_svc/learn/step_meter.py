"""What one training step cost: its peak memory and its training throughput.

Contract: :class:`StepMeter` is reset with the step, times each training call of the step
(``add_group`` and ``step``: the compute, not the wait for rollout) and adds to the step's
statistics ``peak_memory_bytes`` (:class:`PeakMemory` over the step) and
``tokens_per_s_train`` (the step's response tokens over the timed seconds).

:meth:`PeakMemory.reset` starts a stretch, :meth:`PeakMemory.peak_bytes` reads the most
memory the process held since. On CUDA that is torch's allocator high-water mark
(``max_memory_allocated``): exactly the tensors, without the allocator's cache. On the CPU torch
has no allocator statistics of its own (tensors come from malloc), and ``tracemalloc`` only sees
Python objects, never tensor storage; what the kernel charges the process is its resident set,
whose high-water mark (``VmHWM``) Linux resets on writing ``5`` to ``/proc/self/clear_refs``.
That counts the interpreter and libraries too (a few hundred MB, the same for every trainer
kind), and memory malloc keeps after a free: a benchmark that compares trainers sets
``MALLOC_MMAP_THRESHOLD_`` low so every tensor is its own mapping, returned on free.
Without ``/proc`` (not Linux) the CPU peak is ``ru_maxrss``, never reset: a lifetime peak.
"""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """The process's peak memory since :meth:`reset` (module doc)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.cuda = device is not None and device.type == "cuda"
        self.device = device

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):  # else the lifetime peak (module doc)
            _CLEAR_REFS.write_text("5")

    def peak_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        kib = _status_kib("VmHWM")
        if kib is None:
            kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kib * 1024

    def current_bytes(self) -> int:
        if self.cuda:
            return int(torch.cuda.memory_allocated(self.device))
        kib = _status_kib("VmRSS")
        return (kib or 0) * 1024


class StepMeter:
    """Peak memory and training seconds of the current step (module doc)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.memory = PeakMemory(device)
        self.busy_s = 0.0

    def reset(self) -> None:
        self.memory.reset()
        self.busy_s = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - started

    def finish(self, stats: dict[str, Any]) -> dict[str, Any]:
        """``stats`` with this step's ``peak_memory_bytes`` and ``tokens_per_s_train``."""
        stats["peak_memory_bytes"] = float(self.memory.peak_bytes())
        tokens = float(stats.get("tokens", 0))
        stats["tokens_per_s_train"] = tokens / self.busy_s if self.busy_s > 0 else 0.0
        return stats
