"""Generation engines behind one interface, and the factory that picks one by name.

Contract: callers import the interface and :func:`create_engine` from this package and nothing
else; which engine runs is ``RLBOOST_ENGINE``, decided once at start.

* ``base`` -- the interface (:class:`Engine`, :class:`GenRequest`, :class:`TokenEvent`, the
  :class:`Inbox` shared by an engine's threads, :class:`EngineError`) and the checks every
  engine makes the same way.
* ``torch_engine`` -- ``torch``: any HF causal LM run by torch with a KV cache (the CPU default).
* ``emu`` -- ``emu``: EMULATION, a latency model with tokens that are a pure function of the
  request; ``emu_models`` holds the serving cost of each model class it can stand for.
* ``sglang`` -- ``sglang``: an SGLang server driven over HTTP (GPU).

Imports point one way only: each engine imports ``base``, this package imports ``base`` at once
and the engines inside :func:`create_engine`, so the emulator never pulls in torch/transformers
and nothing here imports ``sglang`` at all. The torch engine's module is ``torch_engine``, not
``torch``, so that no reader (or tool run inside this folder) mistakes it for the library.
"""

from __future__ import annotations

from typing import Any

from rollout_svc.engines.base import (
    Engine,
    EngineError,
    EngineUnavailable,
    GenRequest,
    Inbox,
    TokenEvent,
    check_request,
    finish_reason,
    finished_on_arrival,
    generation_eos_ids,
    with_stops,
)

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineError",
    "EngineUnavailable",
    "GenRequest",
    "Inbox",
    "TokenEvent",
    "check_request",
    "create_engine",
    "finish_reason",
    "finished_on_arrival",
    "generation_eos_ids",
    "with_stops",
]

ENGINE_NAMES = ("torch", "emu", "sglang")


def create_engine(name: str, **options: Any) -> Engine:
    """Build the engine ``RLBOOST_ENGINE`` names; ``options`` go to its constructor."""
    # Imported here, not above: loading one engine's module must not load another's
    # dependencies (torch and transformers stay out of an emu process).
    if name == "torch":
        from rollout_svc.engines.torch_engine import TorchEngine

        return TorchEngine(**options)
    if name == "emu":
        from rollout_svc.engines.emu import EmuEngine

        return EmuEngine(**options)
    if name == "sglang":
        # The GPU engine drives an SGLang server over HTTP; sglang itself is never imported.
        from rollout_svc.engines.sglang import SGLangEngine

        return SGLangEngine(**options)
    raise EngineError(f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}")
