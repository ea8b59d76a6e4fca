"""Position-keyed sampling: the determinism oracle of the design (invariant 5).

A token's random draw depends only on (run seed, step, prompt index, sample index, position),
never on which instance generates it, how it was batched, or how often the response migrated.
So a response continued elsewhere from its committed tokens draws exactly what it would have
drawn had it never moved. Engines turn the uniform draw into a token by inverse CDF.
"""

from __future__ import annotations

import hashlib
import struct

_PACK = struct.Struct("<qqqqq")
_SCALE = float(1 << 53)


def uniform(seed: int, step: int, prompt_index: int, sample_index: int, position: int) -> float:
    """A uniform draw in [0, 1) keyed by the five coordinates (53 bits of blake2b)."""
    digest = hashlib.blake2b(
        _PACK.pack(seed, step, prompt_index, sample_index, position), digest_size=8
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) / _SCALE


def pick(cumulative: list[float], u: float) -> int:
    """Index of the first cumulative probability above ``u * total`` (inverse CDF)."""
    target = u * cumulative[-1]
    lo, hi = 0, len(cumulative) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if cumulative[mid] > target:
            hi = mid
        else:
            lo = mid + 1
    return lo
