"""The chunk schedule of one pull, shared by its worker threads and its peer poller.

Contract: :meth:`Plan.take` hands each missing chunk to exactly one worker at a time, with the
source to fetch it from (a peer URL, or None for the service), and blocks while nothing can be
started; it returns None once every chunk is taken or the plan is stopped. Policy, and why:
1. A chunk some live peer holds goes to the least busy such peer (at most ``PEER_CAP`` chunks in
   flight per peer): every byte a peer serves is a byte the service does not.
2. Otherwise the service gets a missing chunk that no live peer holds or is fetching: with
   ``peers=True`` a random one, else the next in this puller's order (a rotation from a random
   start). Joiners that start together thus fetch *different* chunks from the service and swap
   them through rule 1, so the service sends about one copy, not one per joiner; random rather
   than a rotation because joiners walking their rotations at the same pace keep reaching the
   same next chunk within one poll of each other, before either's claim can be seen.
   With peers in play (``peers=True`` and a live peer known, or the first ``DISCOVERY_S`` of the
   pull, before the peer list can have arrived) a puller keeps only one chunk in flight from the
   service, so its other workers wait for peers rather than race them to the service; alone, it
   uses all ``parallel`` workers on the service. A chunk a peer reports it is fetching from the
   service counts as held while that report is fresh (``CLAIM_FRESH_S``) and younger than
   ``CLAIM_MAX_S``: joiners would otherwise pull the same chunk from the service at the same time,
   which is most of the duplicate egress when many start together; the age cap keeps a stalled
   or vanished peer from stalling everyone else. The cap grows with how long this pull's own
   chunks take from the service: over a slow link a peer's fetch takes as long, and a cap
   shorter than that would lapse every claim and duplicate every chunk.
3. A peer that fails is dropped for the rest of the pull; a chunk it served with bad bytes is
   fetched from the service only. A 404 from a peer just means "not (any more) here".
"""

from __future__ import annotations

import logging
import random
import threading
import time

from shared.weights.manifest import Chunk

log = logging.getLogger(__name__)

PEER_CAP = 2  # chunks in flight per peer per puller: spreads load over peers
WAIT_S = 0.05  # how long an idle worker sleeps before it looks for work again
DISCOVERY_S = 1.5  # time for a joiner to learn of peers that started with it
CLAIM_FRESH_S = 2.0  # a peer's "fetching" list counts while its last answer is this recent
CLAIM_MAX_S = 5.0  # at least: a 64 MiB chunk from a busy service on a LAN takes ~1 s
CLAIM_SLACK = 3.0  # ...and at least this many times this pull's slowest recent service chunk


class Plan:
    def __init__(self, chunks: list[Chunk], done: set[int], fds: dict[str, int], parallel: int,
                 start: int, peers: bool = False) -> None:
        self.chunks = chunks
        self.fds = fds
        self.parallel = parallel
        n = len(chunks)
        self.order = [(start + k) % n for k in range(n)]
        self.rank = {index: k for k, index in enumerate(self.order)}
        self.pending = set(range(n)) - done  # neither verified nor in flight
        self.inflight: set[int] = set()
        self._cursor = 0
        self._rng = random.Random()  # seeded from the OS: joiners must not share a sequence
        self.have: dict[str, set[int]] = {}
        self.complete: set[str] = set()  # peers holding the whole version
        self.coming: dict[str, set[int]] = {}  # what each peer is fetching from the service
        self.heard: dict[str, float] = {}  # when each peer last answered
        self.claimed_at: dict[tuple[str, int], float] = {}
        self.from_service: dict[int, float] = {}  # this pull's chunks from the service: since
        self.service_chunk_s = 0.0  # slowest recent chunk from the service (decaying)
        self.dead: set[str] = set()
        self.load: dict[str | None, int] = {None: 0}
        self.service_only: set[int] = set()
        self.bytes_from_peers = 0
        self.bytes_from_service = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.progress_at = self.started_at = time.monotonic()
        self.peers = peers
        self._cond = threading.Condition()

    def remaining(self) -> int:
        with self._cond:
            return len(self.pending) + len(self.inflight)

    def take(self) -> tuple[int, str | None] | None:
        with self._cond:
            while not self.stop.is_set() and self.pending:
                job = self._pick()
                if job is not None:
                    index, source = job
                    self.pending.discard(index)
                    self.inflight.add(index)
                    self.load[source] = self.load.get(source, 0) + 1
                    if source is None:
                        self.from_service[index] = time.monotonic()
                    return job
                self._cond.wait(WAIT_S)
            return None

    def _pick(self) -> tuple[int, str | None] | None:
        live = [u for u in self.have if u not in self.dead and self.load.get(u, 0) < PEER_CAP]
        for url in sorted(live, key=lambda u: self.load.get(u, 0)):
            held = self.pending if url in self.complete else self.have[url] & self.pending
            candidates = held - self.service_only
            if candidates:
                return min(candidates, key=self.rank.__getitem__), url
        if self.load[None] >= self._service_cap(live):
            return None
        # A chunk a live peer holds waits for that peer's capacity: fetching it from the service
        # instead would be the very duplicate egress fan-out exists to avoid. Except a chunk a
        # peer served corrupt: that one comes from the service even while peers hold it.
        alive = [u for u in self.have if u not in self.dead]
        if any(u in self.complete for u in alive):
            held = set(self.pending)
        else:
            held = set().union(*(self.have[u] for u in alive), self._claimed(alive))
        held -= self.service_only
        if self.peers:  # rule 2: at random
            free = sorted(self.pending - held)
            return (self._rng.choice(free), None) if free else None
        # Alone: the next in this puller's rotation. Without peers no chunk ever goes back to
        # pending (a worker retries a failed service fetch itself), so the cursor only advances.
        while self._cursor < len(self.order):
            index = self.order[self._cursor]
            self._cursor += 1
            if index in self.pending:
                return index, None
        return None

    def claim_cap(self) -> float:
        return max(CLAIM_MAX_S, CLAIM_SLACK * self.service_chunk_s)

    def _claimed(self, alive: list[str]) -> set[int]:
        now, cap = time.monotonic(), self.claim_cap()
        return {
            i for u in alive if now - self.heard.get(u, 0.0) < CLAIM_FRESH_S
            for i in self.coming.get(u, ()) if now - self.claimed_at[(u, i)] < cap
        }

    def service_fetching(self) -> list[int]:
        """Chunks this pull is fetching from the service now: what it tells its peers."""
        with self._cond:
            return sorted(self.from_service)

    def _service_cap(self, live: list[str]) -> int:
        if not self.peers:
            return self.parallel
        if live or any(u not in self.dead for u in self.have):
            return 1
        return 1 if time.monotonic() - self.started_at < DISCOVERY_S else self.parallel

    def finish(self, index: int, source: str | None) -> None:
        with self._cond:
            self.inflight.discard(index)
            self.load[source] -= 1
            size = self.chunks[index].size
            if source is None:
                self.bytes_from_service += size
                took = time.monotonic() - self.from_service.pop(index)
                self.service_chunk_s = max(took, 0.8 * self.service_chunk_s)
            else:
                self.bytes_from_peers += size
            self.progress_at = time.monotonic()
            self._cond.notify_all()

    def peer_failed(self, url: str, index: int, *, missing: bool = False, corrupt: bool = False,
                    why: str = "") -> None:
        """Give the chunk back; drop the peer unless it merely lacked the chunk."""
        with self._cond:
            self.inflight.discard(index)
            self.load[url] -= 1
            self.pending.add(index)  # only pulls with peers get here: they pick at random
            if missing:
                self.have.get(url, set()).discard(index)
                self.complete.discard(url)
            else:
                log.warning("dropping peer %s (%s); chunk %d comes from elsewhere", url, why, index)
                self.dead.add(url)
                if corrupt:
                    self.service_only.add(index)
            self._cond.notify_all()

    def worth_asking(self, url: str) -> bool:
        with self._cond:
            return url not in self.dead and url not in self.complete

    def update_peer(self, url: str, complete: bool, chunks: set[int],
                    fetching: set[int] | frozenset[int] = frozenset()) -> None:
        with self._cond:
            if url in self.dead:
                return
            if complete:
                self.complete.add(url)
            n, now = len(self.chunks), time.monotonic()
            self.have[url] = {i for i in chunks if 0 <= i < n}
            coming = {i for i in fetching if 0 <= i < n}
            for i in coming:  # aged from its first claim: dropping and renewing it resets nothing
                self.claimed_at.setdefault((url, i), now)
            self.coming[url] = coming
            self.heard[url] = now
            self._cond.notify_all()

    def fail(self, exc: BaseException | None) -> None:
        """Stop every worker; the first real error is the one the caller sees."""
        with self._cond:
            if self.error is None and exc is not None:
                self.error = exc
            self.stop.set()
            self._cond.notify_all()
