"""``make bench-weights``, adapter part: what an adapter version weighs and takes to pull.

One run, all real and on this machine: the delta part's Qwen2-shaped model
(:func:`benchmarks.weights_delta.qwen2`, the same initial weights) wrapped by the trainer's own
LoRA code (:func:`trainer_svc.learn.lora.wrap` with the default :class:`~shared.spec.LoraSpec`:
rank 8, alpha 16, every projection of :data:`~shared.spec.LORA_TARGETS`) trains ``steps`` steps
(the delta part's step: forward, backward, AdamW at ``lr``, which only the adapters see). Each
version is the adapter alone, written by :func:`trainer_svc.learn.lora.save_adapter` (PEFT's
two files, in the dtype PEFT trains them in: fp32, also over a half-precision base) and
published to a ``python -m weight_svc`` process as a version of its own run: an adapter-only
version as issue 40 describes it, over a base that the puller already holds. Its bytes are the
adapter files' bytes; its pull time a fresh puller's, through the same service, measured with
:func:`benchmarks.weights_delta.measure` like the full and delta versions.

What is not measured here: the base itself (a joiner pulls it once as a full version, or finds
it in its image), and an engine applying the adapter.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from benchmarks.weights_delta import Row, qwen2, step
from shared.spec import LoraSpec
from trainer_svc.learn.lora import save_adapter, wrap


def train(root: Path, steps: int, layers: int, hidden: int, lr: float
          ) -> tuple[list[Path], str]:
    """``steps`` + 1 adapter-only version directories (v0: the adapters as initialised), and a
    line that describes the adapter."""
    spec = LoraSpec()
    model = wrap(qwen2(layers, hidden), spec)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=lr)
    out = []
    for v in range(steps + 1):
        if v:
            step(model, opt)
        version = root / f"v{v}"
        version.mkdir(parents=True)
        save_adapter(model, version)
        out.append(version)
    adapter = sum(p.numel() for p in trained)
    base = sum(p.numel() for p in model.parameters()) - adapter
    return out, (f"rank {spec.rank}, alpha {spec.alpha:g} on {', '.join(spec.target_modules)}: "
                 f"{adapter / 1e6:.2f} M adapter parameters on a {base / 1e6:.1f} M base "
                 f"({100 * adapter / base:.2f} %)")


def report(rows: list[Row], full: list[Row], delta_dtype: str) -> None:
    """Per version, the adapter's bytes and pull time; then the three kinds side by side, with
    ``full`` the model's own rows (published in ``delta_dtype``) from the delta part."""
    print("\nadapter versions (PEFT's files, fp32, as the trainer writes them): a fresh puller")
    print(f"{'version':>7} {'adapter MB':>10} {'adapter/full':>12} {'pull s':>7} {'commit s':>8}")
    model_bytes = statistics.fmean(r.full_bytes for r in full)
    for r in rows:
        print(f"{r.version:7d} {r.full_bytes / 1e6:10.3f} {r.full_bytes / model_bytes:12.4f} "
              f"{r.full_s:7.3f} {r.commit_s:8.2f}")
    kinds = [
        ("full", [r.full_bytes for r in full], [r.full_s for r in full]),
        ("delta", [r.delta_bytes if r.kind == "delta" else r.full_bytes for r in full],
         [r.delta_s for r in full]),
        ("adapter", [r.full_bytes for r in rows], [r.full_s for r in rows]),
    ]
    print(f"\nper version over {len(full)} training steps, model published in {delta_dtype} "
          "(means; the puller of a delta holds the version before, of an adapter the base)")
    print(f"{'kind':>8} {'MB/version':>10} {'x full':>8} {'pull s':>7} {'x full s':>8}")
    full_s = statistics.fmean(r.full_s for r in full)
    for kind, sizes, secs in kinds:
        mb, s = statistics.fmean(sizes), statistics.fmean(secs)
        print(f"{kind:>8} {mb / 1e6:10.3f} {mb / model_bytes:8.4f} {s:7.3f} {s / full_s:8.2f}")
