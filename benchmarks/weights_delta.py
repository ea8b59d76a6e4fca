"""``make bench-weights``, delta part: bytes and pull time per version, delta against full.

One run, all real and on this machine: a Qwen2-shaped model, randomly initialised (``--layers``
x ``--hidden``, 32k vocabulary, untied embeddings), trains ``--steps`` steps (forward, backward
and an AdamW step at ``--lr``, RL's regime, on fp32 master weights; causal-LM loss on random
tokens: the bytes of an update are what is measured, not what it learns). Each version is
published as the trainer's checkpoint would be in each of ``--dtypes`` (bf16: what an engine
loads and what delta sync in the field ships; fp32: what this trainer publishes today) to a
``python -m weight_svc`` process, which builds each version's delta at commit. For every version
after the first, in the same run: a puller holding the version before pulls it (the delta, then
the rebuild checked against the manifest's sha256), and a fresh puller pulls it in full (the
baseline); printed per version: the version's bytes, the delta's, their ratio, both pull times
and the commit's time (the service hashes the version and builds its delta). Every rebuilt
version is compared with the trainer's files byte for byte; at the end one stored delta is
corrupted and the pull that holds its base must detect it and pull in full.

Pulls write to /dev/shm when it exists, over loopback: the bytes are the figure that carries to
a real link; loopback pull times show what the rebuild costs when the link is free.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from shared.weights import PullStats, pull_version, upload_version

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(slots=True)
class Row:
    version: int
    full_bytes: int
    delta_bytes: int  # 0: the service kept no delta
    full_s: float
    delta_s: float
    commit_s: float
    kind: str  # what the holder's pull did


def qwen2(layers: int, hidden: int) -> Qwen2ForCausalLM:
    """The benchmark's model (module doc), initialised from seed 0: every caller gets the same."""
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=32_000, hidden_size=hidden, intermediate_size=hidden * 3,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=512,
                      tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, vocab: int = 32_000) -> None:
    """One training step: causal-LM loss on random tokens, backward, the optimizer's step."""
    ids = torch.randint(0, vocab, (4, 128))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def train(root: Path, steps: int, layers: int, hidden: int, lr: float, dtypes: list[str]
          ) -> dict[str, list[Path]]:
    """The versions, per published dtype: ``steps`` + 1 HF directories."""
    model = qwen2(layers, hidden)
    cfg = model.config
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out: dict[str, list[Path]] = {d: [] for d in dtypes}
    for v in range(steps + 1):
        if v:
            step(model, opt)
        for d in dtypes:
            hf = root / d / f"v{v}"
            hf.mkdir(parents=True)
            (hf / "config.json").write_text(json.dumps(cfg.to_dict(), sort_keys=True))
            save_file({k: t.detach().to(DTYPES[d]).contiguous()
                       for k, t in model.state_dict().items()}, str(hf / "model.safetensors"))
            out[d].append(hf)
    return out


def same(model: Path, pulled: Path) -> bool:
    return all((pulled / p.name).read_bytes() == p.read_bytes() for p in model.iterdir())


def pull(url: str, token: str, run: str, version: int, dest: Path) -> tuple[float, PullStats]:
    stats = PullStats()
    started = time.perf_counter()
    asyncio.run(pull_version(url, token, run, version, dest, parallel=2, timeout_s=120,
                             stats=stats))
    return time.perf_counter() - started, stats


def measure(url: str, token: str, run: str, versions: list[Path], pulls: Path) -> list[Row]:
    rows = []
    holder = pulls / f"{run}-holder"
    for v, hf in enumerate(versions, start=1):
        started = time.perf_counter()
        manifest = asyncio.run(upload_version(url, token, run, v, hf, timeout_s=120))
        commit_s = time.perf_counter() - started
        full_bytes = sum(f["size"] for f in manifest["files"])
        if v == 1:
            pull(url, token, run, 1, holder)
            continue
        full_s, _ = pull(url, token, run, v, pulls / f"{run}-fresh")
        shutil.rmtree(pulls / f"{run}-fresh")
        delta_s, stats = pull(url, token, run, v, holder)
        if not same(hf, holder / run / str(v)):
            raise AssertionError(f"{run}/{v}: rebuilt version differs from the trainer's")
        shutil.rmtree(holder / run / str(v - 1))  # as a rollout instance drops the old one
        delta = manifest.get("delta")
        rows.append(Row(v, full_bytes, delta["file"]["size"] if delta else 0, full_s, delta_s,
                        commit_s, stats.kind))
    return rows


def corrupt_one(url: str, token: str, data: Path, run: str, versions: list[Path], pulls: Path
                ) -> str:
    """Rot one byte of the last version's stored delta; the holder's pull must fall back."""
    v = len(versions)
    blobs = sorted((data / "weights" / run / str(v)).glob("rlboost-delta-*"))
    if not blobs:
        return "no delta stored for the last version: nothing to corrupt"
    raw = bytearray(blobs[0].read_bytes())
    raw[len(raw) // 2] ^= 0x40
    blobs[0].write_bytes(bytes(raw))
    holder = pulls / f"{run}-corrupt"
    pull(url, token, run, v - 1, holder)
    _, stats = pull(url, token, run, v, holder)
    ok = stats.fallback == "corrupt" and stats.kind == "full" and \
        same(versions[-1], holder / run / str(v))
    return (f"corrupted delta of v{v}: fallback={stats.fallback}, pulled {stats.kind} "
            f"({stats.bytes_from_service} bytes), equal to the trainer's: "
            f"{same(versions[-1], holder / run / str(v))} -> {'PASS' if ok else 'FAIL'}")


def report(dtype: str, rows: list[Row]) -> None:
    print(f"\ndelta versions, published in {dtype}: a puller holding v-1 against a fresh one")
    print(f"{'version':>7} {'full MB':>8} {'delta MB':>9} {'delta/full':>10} {'full pull s':>11} "
          f"{'delta pull s':>12} {'full/delta s':>12} {'commit s':>8} {'pulled':>7}")
    for r in rows:
        ratio = r.delta_bytes / r.full_bytes if r.delta_bytes else float("nan")
        print(f"{r.version:7d} {r.full_bytes / 1e6:8.2f} {r.delta_bytes / 1e6:9.2f} "
              f"{ratio:10.3f} {r.full_s:11.3f} {r.delta_s:12.3f} {r.full_s / r.delta_s:12.2f} "
              f"{r.commit_s:8.2f} {r.kind:>7}")
    full = sum(r.full_bytes for r in rows)
    pulled = sum(r.delta_bytes if r.kind == "delta" else r.full_bytes for r in rows)
    print(f"{'all':>7} {full / 1e6:8.2f} {pulled / 1e6:9.2f} {pulled / full:10.3f} "
          f"{sum(r.full_s for r in rows):11.3f} {sum(r.delta_s for r in rows):12.3f}")
