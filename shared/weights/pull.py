"""Pulling one version: which chunk comes from where, and the worker threads that fetch them.

Contract of :func:`pull_version` (exported by :mod:`shared.weights`):
- ``dest_root/<run_id>/<version>/`` ends up holding exactly the version's files, every chunk
  verified by sha256 against the service's manifest, whoever served it; it appears by one rename
  (see :mod:`shared.weights.partial`), so a crash leaves at most ``.partial-<version>/``, which the
  next pull resumes. An existing final directory is returned without asking the service. One pull
  of a given version into a given ``dest_root`` at a time.
- Chunks come from the service's sendfile data plane (or its REST API if it advertises none) and,
  with ``peers=True``, from peers the service lists. Peer chunks are preferred; the service gets a
  chunk no live peer has or is fetching, chosen at random (alone: in an order that starts at a
  random chunk), so joiners that start together fetch different chunks from the service and then
  exchange them (chunk-level availability: a peer advertises the chunks it has verified so far and
  those it is fetching from the service; see :mod:`shared.weights.plan`). A peer that fails is
  dropped and its chunk fetched elsewhere; a chunk a peer served with bad bytes is refetched from
  the service only.
- With ``serve`` (a running :class:`PeerServer`), this pull's verified chunks are offered to others
  while it runs, and the version is advertised to the service as long as it stays on disk.
- Delta: when the manifest offers a delta (:mod:`shared.weights.delta`) and ``dest_root`` holds
  its base complete, the blob is pulled instead (from the service only: it is small, and peers
  serve whole versions), chunked, verified and resumable like a file, in
  ``.delta-<version>/``; the version is rebuilt from it into the partial directory and every
  chunk and file is checked against the manifest's sha256 before anything is recorded. Whatever
  falls short, a missing base (``no_base``), a blob that fails its hashes at the service
  (``corrupt``) or cannot be fetched (``error``), a rebuild that does not match (``mismatch``),
  leaves the unverified chunks to the ordinary pull: the version is never worse than a full
  pull's. ``stats`` (a :class:`PullStats`) tells the caller which way it went and why.
- Adapter: when the manifest has an ``adapter`` entry (an adapter-only version of a LoRA run),
  the pull first makes sure ``dest_root/<run_id>/<base>/`` holds the base it names, whole, with
  that content hash and every file's bytes matching its sha256 (hashed once per process): held
  already (``disk``), found in ``seeded`` (a directory of bases in the instance's image,
  ``<seeded>/<base_sha256>/``, its files hashed once per process: ``seeded``), or pulled like
  any version, with peers (``pulled``: none held; ``replaced``: the one held was not it). A
  base the service cannot deliver with that hash is a non-retryable WeightsError. Then only
  the adapter's files are pulled (``kind`` ``adapter``); ``stats.base_dir`` names the base,
  and ``stats.base`` what its pull did.
- A service outage is ridden out (retries with backoff) until ``timeout_s`` pass without a
  verified chunk. Every failure is a :class:`WeightsError`; ``retryable`` is False where retrying
  cannot help (a bad name, a chunk corrupt at the service, a rejected token).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import shutil
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.errors import WeightsError
from shared.process import wait_event
from shared.tls import Tls
from shared.weights.delta import apply_delta, check_delta
from shared.weights.fetch import BLOCK, RangeConn, SourceError, Stopped
from shared.weights.manifest import (
    MANIFEST_NAME,
    AdapterEntry,
    Chunk,
    Manifest,
    check_ids,
    check_manifest,
    content_sha256,
    file_sha256,
    files_sha256,
)
from shared.weights.partial import Partial, local_manifest
from shared.weights.peer import PEER_PREFIX, PeerServer
from shared.weights.plan import Plan
from shared.weights.session import Session

log = logging.getLogger(__name__)

CHUNK_TRIES = 4  # one download and three refetches before a chunk is declared corrupt
POLL_S = 0.5  # how often a puller asks its peers which chunks they hold
PEERS_LIST_S = 1.0  # how often it asks the service who the peers are
PEER_TIMEOUT_S = 10.0
FIRST_POLL_S = 2.0  # the longest a pull waits to hear which chunks existing peers hold


class CorruptAtSource(WeightsError):
    """A chunk failed its sha256 on every download from the service: its copy is bad."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem, retryable=False)


@dataclass(slots=True)
class PullStats:
    """What one pull did, for its caller's metrics (``stats`` of :func:`pull_version`)."""

    kind: str = ""  # "local" (on disk already), "delta" (rebuilt from the base), "adapter"
    # (the adapter's files only, over a base held or pulled first) or "full"
    delta_bytes: int = 0  # bytes of a delta blob fetched (0 when none was tried)
    bytes_from_service: int = 0  # chunks of the version's files (what a fallback fetched)
    bytes_from_peers: int = 0
    fallback: str | None = None  # why an offered delta was not used (module doc)
    base_dir: Path | None = None  # an adapter version's base, whole and verified
    base_source: str | None = None  # where it came from: disk, seeded, pulled or replaced
    base: PullStats | None = None  # what pulling the base did, when it was pulled


# Base directories whose files were hashed against their manifest by this process, with the
# content hash they had: a restarted instance re-checks a base once, not at every version.
_verified_bases: dict[Path, str] = {}


def _files_match(final: Path, manifest: Manifest) -> bool:
    try:
        return all(file_sha256(final / f["name"]) == f["sha256"] for f in manifest["files"])
    except OSError:
        return False


def _seeded_base(where: Path, digest: str) -> bool:
    """True when ``where`` (a pre-seeded base) holds flat files whose content hash is
    ``digest``; its files are hashed, once per process."""
    if _verified_bases.get(where) == digest:
        return True
    files = []
    try:
        for path in sorted(where.iterdir()):
            if path.is_file() and not path.name.startswith(".") and path.name != MANIFEST_NAME:
                files.append((path.name, path.stat().st_size, file_sha256(path)))
    except OSError:
        return False
    if not files or files_sha256(files) != digest:
        return False
    _verified_bases[where] = digest
    return True


def _held_base(base_dir: Path, run_id: str, entry: AdapterEntry) -> bool | None:
    """True: ``base_dir`` holds the base whole and verified; False: it holds another version's
    bytes (or damaged ones); None: nothing whole."""
    held = local_manifest(base_dir, run_id, entry["base"])
    if held is None:
        return None
    if content_sha256(held) != entry["base_sha256"]:
        return False
    if _verified_bases.get(base_dir) != entry["base_sha256"]:
        if not _files_match(base_dir, held):
            return False
        _verified_bases[base_dir] = entry["base_sha256"]
    return True


async def _ensure_base(manifest: Manifest, dest_root: Path, stats: PullStats,
                       pull: Callable[..., Awaitable[Path]], seeded: Path | None) -> None:
    """Make ``dest_root`` hold the base of ``manifest`` when it is an adapter version, unless
    ``seeded`` has it (module doc); ``pull(version, stats=...)`` pulls one."""
    if "adapter" not in manifest:
        return
    run_id, entry = manifest["run_id"], manifest["adapter"]
    base_dir = dest_root / run_id / str(entry["base"])
    held = await asyncio.to_thread(_held_base, base_dir, run_id, entry)
    image = seeded / entry["base_sha256"] if seeded is not None else None
    if held:
        stats.base_source = "disk"
    elif image is not None and await asyncio.to_thread(_seeded_base, image, entry["base_sha256"]):
        stats.base_source, base_dir = "seeded", image
    else:
        stats.base_source = "pulled" if held is None else "replaced"
        log.info("%s/%d: %s base v%d", run_id, manifest["version"],
                 "pulling its" if held is None else "the held one is not it; pulling the",
                 entry["base"])
        await asyncio.to_thread(shutil.rmtree, base_dir, True)
        stats.base = PullStats()
        await pull(entry["base"], stats=stats.base)
        if not await asyncio.to_thread(_held_base, base_dir, run_id, entry):
            raise WeightsError(f"{run_id}/{entry['base']} at the service is not the base that "
                               f"v{manifest['version']} names", retryable=False)
    stats.base_dir = base_dir


async def _held(final: Path, dest_root: Path, run_id: str, version: int, stats: PullStats,
                pull: Callable[..., Awaitable[Path]], seeded: Path | None) -> bool:
    """True when ``final`` holds the version whole already (and, for an adapter version, its
    base is in place too): nothing to pull."""
    held = await asyncio.to_thread(local_manifest, final, run_id, version)
    if held is None:
        return False
    await _ensure_base(held, dest_root, stats, pull, seeded)
    stats.kind = "local"
    return True


class _Service:
    """Where the service's chunks come from: its data plane, rediscovered after a restart."""

    def __init__(self, base_url: str, data_url: str | None, token: str | None, path: str,
                 tls: Tls) -> None:
        self.base_url = base_url
        self.url = data_url or base_url
        self.token = token
        self.manifest_path = path
        self._lock = threading.Lock()
        self.tls = tls.client()  # the service: its certificate must name its host
        self.peer_tls = tls.peer_client()  # peers: signed by the CA, known by address only
        self.verify = tls.verify()

    def conn(self, url: str, timeout_s: float, peer: bool = False) -> RangeConn:
        return RangeConn(url, self.token, timeout_s, self.peer_tls if peer else self.tls)

    def rediscover(self) -> None:
        # A restarted service may listen on another data port: ask the REST API again.
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            resp = httpx.get(self.base_url + self.manifest_path, headers=headers, timeout=2.0,
                             verify=self.verify)
        except httpx.HTTPError:
            return
        port = resp.headers.get("x-rlboost-data-port", "")
        if resp.status_code == 200 and port.isdigit():
            with self._lock:
                self.url = f"{resp.url.scheme}://{resp.url.host}:{port}"


def _fetch_service(
    plan: Plan, svc: _Service, conns: dict[str, RangeConn], buf: bytearray, chunk: Chunk,
    path: str, timeout_s: float,
) -> bool:
    """True once the chunk is verified; raises WeightsError when the service cannot deliver."""
    corrupt, attempt = 0, 0
    while True:
        url = svc.url
        conn = conns.get(url) or conns.setdefault(url, svc.conn(url, timeout_s))
        try:
            if conn.fetch(path, chunk, plan.fds[chunk.name], buf, plan.stop):
                return True
        except SourceError as exc:
            if exc.status == 401:
                raise WeightsError(f"{path}: unauthorized (check RLBOOST_WEIGHTS_TOKEN /"
                                   " RLBOOST_API_TOKEN)", retryable=False) from None
            if exc.status is not None and exc.status < 500:
                raise WeightsError(exc.detail, retryable=exc.status == 404) from None
            attempt += 1
            if time.monotonic() - plan.progress_at > timeout_s:
                raise WeightsError(f"{svc.base_url}{path}: gave up after {attempt} attempts:"
                                   f" {exc.detail}") from None
            log.info("chunk %d from the service failed (%s); retrying", chunk.number, exc.detail)
            if plan.stop.wait(min(0.1 * 2 ** (attempt - 1), 2.0)):
                raise Stopped() from None
            svc.rediscover()
            continue
        corrupt += 1
        log.warning("%s chunk at %d failed its sha256 (try %d/%d)", path, chunk.offset, corrupt,
                    CHUNK_TRIES)
        if corrupt >= CHUNK_TRIES:
            raise CorruptAtSource(f"{path} chunk at offset {chunk.offset}: sha256 mismatch on"
                                  f" {CHUNK_TRIES} downloads; the service's copy is corrupt")


def _work(plan: Plan, partial: Partial, svc: _Service, run_id: str, version: int,
          timeout_s: float) -> None:
    buf = bytearray(BLOCK)
    conns: dict[str, RangeConn] = {}
    try:
        while (job := plan.take()) is not None:
            index, peer = job
            chunk = plan.chunks[index]
            if peer is None:
                path = f"/v1/weights/{run_id}/{version}/files/{chunk.name}"
                _fetch_service(plan, svc, conns, buf, chunk, path, timeout_s)
            else:
                conn = conns.get(peer) or conns.setdefault(
                    peer, svc.conn(peer, min(timeout_s, PEER_TIMEOUT_S), peer=True))
                path = f"{PEER_PREFIX}/{run_id}/{version}/files/{chunk.name}"
                try:
                    ok = conn.fetch(path, chunk, plan.fds[chunk.name], buf, plan.stop)
                except SourceError as exc:
                    plan.peer_failed(peer, index, missing=exc.status == 404, why=exc.detail)
                    continue
                if not ok:
                    plan.peer_failed(peer, index, corrupt=True, why="served bad bytes")
                    continue
            partial.record(chunk)  # before finish: a chunk is offered only once recorded
            plan.finish(index, peer)
    finally:
        for conn in conns.values():
            conn.close()


async def _poll_peers(plan: Plan, session: Session, run_id: str, version: int,
                      own_url: str | None, svc: _Service, first: asyncio.Event) -> None:
    """Keep the plan's view of who holds which chunk fresh; errors only make a peer look empty.

    Each peer is polled by its own task: in one shared round a peer that has vanished (its entry
    outlives it at the service for up to a minute) would hold every answer back until its
    connection timed out, and the healthy peers' claims would lapse meanwhile."""
    headers = {"Authorization": f"Bearer {svc.token}"} if svc.token else {}
    watchers: dict[str, asyncio.Task[None]] = {}
    # With TLS on, a peer serving plain HTTP would get the read token in clear: not asked.
    scheme = "https://" if svc.peer_tls is not None else "http://"

    async with httpx.AsyncClient(headers=headers, timeout=2.0,
                                 verify=svc.peer_tls or True) as client:

        async def ask(url: str) -> None:
            try:
                r = await client.get(f"{url}{PEER_PREFIX}/{run_id}/{version}/have")
                r.raise_for_status()
                have = r.json()
                plan.update_peer(url, bool(have["complete"]), {int(i) for i in have["chunks"]},
                                 {int(i) for i in have.get("fetching", [])})
            except httpx.HTTPStatusError:
                plan.update_peer(url, False, set())  # it answered: it holds nothing (now)
            except (httpx.HTTPError, ValueError, KeyError, TypeError, OverflowError):
                pass  # slow, gone or talking nonsense: its claims lapse; a failed fetch drops it

        async def watch(url: str) -> None:
            while plan.worth_asking(url):
                await asyncio.sleep(POLL_S)
                await ask(url)

        try:
            while True:
                try:
                    reply = await session.json("GET", f"/v1/weights/{run_id}/{version}/peers")
                    listed = [u for u in reply["peers"] if isinstance(u, str) and u != own_url
                              and u.startswith(scheme)]
                except (WeightsError, KeyError, TypeError):
                    listed = []
                new = [u for u in listed if u not in watchers and plan.worth_asking(u)]
                await asyncio.gather(*(ask(u) for u in new))
                for url in new:
                    watchers[url] = asyncio.create_task(watch(url))
                first.set()
                await asyncio.sleep(PEERS_LIST_S)
        finally:
            for task in watchers.values():
                task.cancel()
            await asyncio.gather(*watchers.values(), return_exceptions=True)


def _join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join()


async def _download(plan: Plan, partial: Partial, svc: _Service, run_id: str, version: int,
                    parallel: int, timeout_s: float, poller: asyncio.Task[None] | None) -> None:
    """Run the workers; on cancellation stop them and wait until none touches the files."""
    loop = asyncio.get_running_loop()
    all_exited = asyncio.Event()
    alive = [min(parallel, plan.remaining())]

    def exited() -> None:
        alive[0] -= 1
        if alive[0] == 0:
            all_exited.set()

    def worker() -> None:
        try:
            _work(plan, partial, svc, run_id, version, timeout_s)
        except Stopped:
            pass
        except BaseException as exc:  # handed to the caller below; the rest stop at once
            plan.fail(exc)
        finally:
            loop.call_soon_threadsafe(exited)

    threads = [threading.Thread(target=worker, name=f"weights-pull-{i}", daemon=True)
               for i in range(alive[0])]
    for t in threads:
        t.start()
    try:
        if threads:
            await all_exited.wait()
    except BaseException:
        plan.fail(None)
        await asyncio.shield(asyncio.to_thread(_join_all, threads))
        raise
    finally:
        if poller is not None:
            poller.cancel()
    if plan.error is not None:
        raise plan.error
    if plan.remaining():
        raise WeightsError(f"{run_id}/{version}: pull stopped with chunks missing")


async def _pull_delta(manifest: Manifest, partial: Partial, dest_root: Path, svc: _Service,
                      parallel: int, timeout_s: float, stats: PullStats) -> str | None:
    """Rebuild the version into ``partial`` from its delta (module doc); why it fell short."""
    run_id, version = manifest["run_id"], manifest["version"]
    try:
        delta = check_delta(manifest)
    except WeightsError as exc:
        log.warning("%s/%d: unusable delta: %s", run_id, version, exc)
        return "error"
    base_dir = dest_root / run_id / str(delta["base"])
    if await asyncio.to_thread(local_manifest, base_dir, run_id, delta["base"]) is None:
        return "no_base"
    where = dest_root / run_id / f".delta-{version}"
    blob_manifest: Manifest = {"run_id": run_id, "version": version,
                               "chunk_bytes": manifest["chunk_bytes"], "files": [delta["file"]]}
    blob = await asyncio.to_thread(Partial, where, blob_manifest)
    plan = Plan(blob.chunks, set(blob.done), blob.fds, parallel, 0)
    try:
        await _download(plan, blob, svc, run_id, version, parallel, timeout_s, None)
        bad = await asyncio.to_thread(apply_delta, manifest, where / delta["file"]["name"],
                                      base_dir, partial.fds, partial.record, set(partial.done))
    except WeightsError as exc:
        log.warning("%s/%d: delta not fetched (%s); pulling in full", run_id, version, exc)
        bad, failure = None, "corrupt" if isinstance(exc, CorruptAtSource) else "error"
    finally:  # cancelled mid-way, the blob's verified chunks stay in ``where``, to resume
        blob.close()
        stats.delta_bytes = plan.bytes_from_service
    await asyncio.to_thread(shutil.rmtree, where, True)
    if bad is None:
        return failure
    if bad:
        log.warning("%s/%d: rebuilt from v%d, %s did not match the manifest; fetching their"
                    " unverified chunks", run_id, version, delta["base"], ", ".join(bad))
        return "mismatch"
    return None


async def _try_delta(manifest: Manifest, partial: Partial, dest_root: Path, svc: _Service,
                     parallel: int, timeout_s: float, stats: PullStats) -> None:
    """Fill ``partial`` from the version's delta when one is offered and chunks are missing;
    ``stats`` says whether it did, or why not. ``partial`` is closed if this raises."""
    if "delta" not in manifest or len(partial.done) == len(partial.chunks):
        return
    try:
        stats.fallback = await _pull_delta(manifest, partial, dest_root, svc, parallel,
                                           timeout_s, stats)
    except OSError as exc:
        partial.close()
        raise WeightsError(f"writing {partial.path}: {exc}", retryable=False) from exc
    except BaseException:
        partial.close()
        raise
    if stats.fallback is None:
        stats.kind = "delta"


async def pull_version(
    base_url: str,
    token: str | None,
    run_id: str,
    version: int,
    dest_root: Path,
    parallel: int = 4,
    timeout_s: float = 60,
    *,
    peers: bool = False,
    serve: PeerServer | None = None,
    tls: Tls | None = None,
    stats: PullStats | None = None,
    seeded: Path | None = None,
) -> Path:
    """Download and verify (run_id, version) into ``dest_root/<run_id>/<version>/``; returns it.
    ``tls``: the CA the service (and peers) are verified with (shared.tls); ``stats``, if
    given, is filled in with what the pull did; ``seeded``: pre-seeded bases (module doc)."""
    tls = tls or Tls()
    stats = stats if stats is not None else PullStats()
    check_ids(run_id, version)
    if parallel < 1:
        raise WeightsError(f"parallel must be >= 1, got {parallel}", retryable=False)
    final = dest_root / run_id / str(version)
    pull_base = functools.partial(pull_version, base_url, token, run_id, dest_root=dest_root,
                                  parallel=parallel, timeout_s=timeout_s, peers=peers,
                                  serve=serve, tls=tls, seeded=seeded)
    if await _held(final, dest_root, run_id, version, stats, pull_base, seeded):
        if serve is not None:
            serve.advertise(base_url, run_id, version)
        return final
    if final.exists():  # damaged by hand or by something outside this module: pull it afresh
        await asyncio.to_thread(shutil.rmtree, final, True)
    async with Session(base_url, token, timeout_s, patience_s=timeout_s,
                       verify=tls.verify()) as session:
        manifest_path = f"/v1/weights/{run_id}/{version}/manifest"
        manifest, data_url = await session.manifest_and_data_url(run_id, version)
        if manifest is None:
            raise WeightsError(f"{run_id}/{version} is not published on {base_url} (yet or now)")
        check_manifest(manifest, run_id, version)
        await _ensure_base(manifest, dest_root, stats, pull_base, seeded)  # the adapter needs it
        partial_dir = dest_root / run_id / f".partial-{version}"
        try:
            partial = await asyncio.to_thread(Partial, partial_dir, manifest)
        except OSError as exc:
            raise WeightsError(f"cannot prepare {partial_dir}: {exc}", retryable=False) from exc
        svc = _Service(base_url, data_url, token, manifest_path, tls)
        stats.kind = "adapter" if "adapter" in manifest else "full"
        await _try_delta(manifest, partial, dest_root, svc, parallel, timeout_s, stats)
        plan = Plan(partial.chunks, set(partial.done), partial.fds, parallel,
                    random.randrange(max(len(partial.chunks), 1)), peers)
        try:
            if serve is not None:
                serve.offer(run_id, version, manifest, partial_dir, partial.done,
                            plan.service_fetching)
                serve.advertise(base_url, run_id, version)
            poller = None
            if peers:
                # In a thread: it may resolve the service's name, and this is the event loop.
                own = (await asyncio.to_thread(serve.url_for, base_url)
                       if serve is not None else None)
                first = asyncio.Event()
                poll = _poll_peers(plan, session, run_id, version, own, svc, first)
                poller = asyncio.create_task(poll)
                # Start with what peers already hold, rather than race them to the service.
                await wait_event(first, FIRST_POLL_S)
            await _download(plan, partial, svc, run_id, version, parallel, timeout_s, poller)
            await asyncio.to_thread(partial.publish, final)
        except OSError as exc:
            raise WeightsError(f"writing {partial_dir}: {exc}", retryable=False) from exc
        finally:
            partial.close()
            if serve is not None:
                serve.withdraw(run_id, version)
        stats.bytes_from_service, stats.bytes_from_peers = (plan.bytes_from_service,
                                                            plan.bytes_from_peers)
        log.info("pulled %s/%d (%s): %d bytes from peers, %d from the service, %d of delta",
                 run_id, version, stats.kind, plan.bytes_from_peers, plan.bytes_from_service,
                 stats.delta_bytes)
    return final
