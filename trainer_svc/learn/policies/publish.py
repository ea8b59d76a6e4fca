"""Publishing a sharded trainer's version: every rank uploads the files it wrote, one commit.

Contract:

- A sharded version's HF directory is written by all ranks, each its own safetensors files
  (:func:`~trainer_svc.learn.sharded_checkpoint.write_hf`), so each rank also sends its own files
  to the weight service, in parallel, from its own process: no rank reads another's files and
  the upload takes the time of the largest share, not of the whole model.
- Rank 0 (:func:`publish_from_ranks`) first asks the service whether the version is already
  published with this content (a step retried after a crash publishes again): then nothing is
  sent and the other ranks are not involved. Otherwise it has every other rank start
  (``start``: the ``Upload`` command of :mod:`~trainer_svc.learn.policies.distributed`), sends its
  own files (index, config, tokenizer and its shards), and every rank then joins one
  all-reduce of a failure flag (:func:`_all_uploaded`). Only if no rank failed does rank 0
  commit, once: a version with a missing part is never published, and the staged parts are
  simply overwritten by the retry (the trainer retries a step whose publish failed).
- Ranks > 0 (:func:`upload_share`) never raise over a failed upload: they log it and report it
  in the flag, so rank 0 fails the publish and the job stays up for the retry.
- Every rank reaches the all-reduce whatever happened before it, rank 0 included when its
  own upload raised, so a failure can never leave a rank waiting in a collective.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shared.errors import WeightsError
from shared.tls import Tls
from shared.weights import (
    Manifest,
    commit_version,
    model_files,
    published,
    upload_files,
    upload_version,
)
from trainer_svc.learn.sharded_checkpoint import file_rank

log = logging.getLogger("trainer.publish")


@dataclass(frozen=True, slots=True)
class WeightsAccess:
    """Where versions are published, and the trainer's credential for it."""

    url: str
    token: str | None = field(default=None, repr=False)  # repr() never shows it in a log
    tls: Tls = field(default_factory=Tls)  # the CA the service is verified with


async def publish_whole(access: WeightsAccess, run_id: str, version: int,
                        hf_dir: Path) -> Manifest:
    """One process holds the whole directory: upload and commit it."""
    return await upload_version(access.url, access.token, run_id, version, hf_dir,
                                tls=access.tls)


def own_files(hf_dir: Path, rank: int) -> list[Path]:
    """The files of ``hf_dir`` that ``rank`` wrote, hence uploads."""
    return [p for p in model_files(hf_dir) if file_rank(p.name) == rank]


def _all_uploaded(ok: bool, device: torch.device) -> bool:
    """Collective: True when every rank's upload succeeded."""
    failed = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(failed)
    return int(failed[0]) == 0


async def publish_from_ranks(access: WeightsAccess, run_id: str, version: int, hf_dir: Path,
                             device: torch.device, start: Callable[[], None]) -> Manifest:
    """Rank 0's part (module doc); ``start`` tells the other ranks to upload theirs."""
    files = model_files(hf_dir)
    existing = await published(access.url, access.token, run_id, version, files,
                               tls=access.tls)
    if existing is not None:
        return existing
    start()
    error: BaseException | None = None
    try:
        await upload_files(access.url, access.token, run_id, version,
                           [p for p in files if file_rank(p.name) == 0], tls=access.tls)
    except BaseException as exc:  # the others wait in the all-reduce below whatever happened
        error = exc
    everyone = await asyncio.to_thread(_all_uploaded, error is None, device)
    if error is not None:
        raise error
    if not everyone:
        raise WeightsError(f"{run_id}/{version}: a rank could not upload its shards; nothing "
                           "was committed")
    manifest = await commit_version(access.url, access.token, run_id, version,
                                    tls=access.tls)
    log.info("%s/%d published from %d ranks: %d files, %d bytes", run_id, version,
             dist.get_world_size(), len(manifest["files"]),
             sum(f["size"] for f in manifest["files"]))
    return manifest


def upload_share(access: WeightsAccess | None, run_id: str, version: int, hf_dir: Path,
                 rank: int, device: torch.device) -> None:
    """A rank > 0's part (module doc): its own files, then the all-reduce."""
    ok = False
    try:
        if access is None:
            raise WeightsError("this rank was started without the weight service's address")
        files = own_files(hf_dir, rank)
        asyncio.run(upload_files(access.url, access.token, run_id, version, files,
                                 tls=access.tls))
        log.info("rank %d uploaded %d files of %s/%d (%d bytes)", rank, len(files), run_id,
                 version, sum(p.stat().st_size for p in files))
        ok = True
    except Exception as exc:
        log.error("rank %d could not upload its shards of %s/%d: %r", rank, run_id, version, exc)
    _all_uploaded(ok, device)
