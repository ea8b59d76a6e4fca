"""Building an embedded model's directory once, atomically, and sharing it by key.

Contract: :func:`build_once` returns ``final`` when it is a directory; otherwise it runs
``build_into`` on a temporary sibling (a dot-name beside ``final``) and renames that into place
with ``os.replace``, so a reader sees either no directory or a complete one, and of two racing
builders one wins and the other discards its (identical) copy. ``final``'s name carries the
key of everything the build depends on (:func:`trainer_svc.embedded.tiny.tiny_key`,
:func:`trainer_svc.embedded.tiny_chat.tiny_chat_key`), so a directory is never reused for a
different model. The temporary copy is removed whatever happens.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(final: Path, build_into: Callable[[Path], None]) -> Path:
    """``final``, built by ``build_into(tmp)`` and renamed into place unless it exists."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_into(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another builder renamed its (identical) copy first; the directory is complete.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
