"""``make bench-weights``: weight transfer against raw TCP, peer fan-out and delta versions.

Everything is real and on this machine: a ``python -m weight_svc`` process serving a synthetic
checkpoint (random bytes, ``--gib`` GiB, 64 MiB chunks), pullers using ``shared.weights``.
Printed, all measured in this run:
1. raw loopback TCP: a plain socket ``sendall`` of the checkpoint's bytes (read from the file in
   16 MiB blocks) to a ``recv_into`` that discards them: the baseline. For reference also the
   kernel's ``sendfile`` of the same file to the same receiver (the fastest way to send a file).
2. one puller: ``pull_version`` (every chunk sha256-verified, written, fsynced, renamed) and its
   throughput as a ratio of the baseline. Each of 1, 2 and 3 runs ``--repeat`` times, interleaved,
   best kept: on a shared machine the other load only ever slows a run down.
3. a bound on any puller: a verified pull must receive every byte (the sendfile row), hash it
   and write it into a fresh file; two rows do each of the last two alone, on one thread, from a
   cache-hot block: the least CPU each can take. Even overlapping all three perfectly on every
   core, a pull needs their summed CPU time divided by the cores, so ``raw`` over that caps the
   ratio any puller can reach on this machine. Every row prints its CPU time (this process plus
   the service's).
4. eight joiners started at the same moment, each its own process, without and with peer fan-out:
   completion time of the last one, and the service's egress (its ``bytes_served`` counter) as a
   multiple of the checkpoint size. With fan-out each joiner runs a PeerServer offering the chunks
   it has verified so far (chunk-level availability) and takes chunks from the others.

5. delta versions (:mod:`benchmarks.weights_delta`): over ``--steps`` real training steps of a
   Qwen2-shaped model, the bytes per version a puller holding the version before pulls (the
   delta) against the version's full bytes, and both pull times, in the same run.
6. adapter versions (:mod:`benchmarks.weights_adapter`): the same model, initial weights and
   steps as 5., trained as a LoRA run at the project's default rank and targets; each version
   published as its adapter files alone, pulled by a fresh puller; then full, delta and adapter
   side by side: bytes per version and pull time, each as a ratio of full.

``--only transfer`` or ``--only delta`` (5. and 6.) runs one part.

Pullers write to /dev/shm when it exists: the link and the protocol are measured, not the disk
(fsync on tmpfs is free; on the VM disk here it costs ~2 s per GiB whatever the protocol).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np

from benchmarks import weights_adapter, weights_delta
from shared.weights import PeerServer, pull_version, upload_version

REPO = Path(__file__).resolve().parent.parent
CHUNK = 64 << 20
TOKEN = "bench-token"
CPUS = len(os.sched_getaffinity(0))  # the cores this process may use, not the host's
RUN = "bench"


def make_checkpoint(model: Path, gib: float) -> int:
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "synthetic"}')
    rng = np.random.default_rng(0)
    size = int(gib * (1 << 30))
    with (model / "model.safetensors").open("wb") as f:
        for start in range(0, size, 64 << 20):
            f.write(rng.bytes(min(64 << 20, size - start)))
    return size + len('{"model_type": "synthetic"}')


def raw_tcp(path: Path, use_sendfile: bool) -> None:
    """Move the file's bytes over one loopback TCP connection into a buffer that discards them."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s, path.open("rb") as f:
            if use_sendfile:
                s.sendfile(f)
            else:
                while block := f.read(16 << 20):
                    s.sendall(block)

    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = listener.accept()
    buf = bytearray(1 << 20)
    while conn.recv_into(buf):
        pass
    sender.join()
    conn.close()
    listener.close()


def one_part(size: int, store: Path | None) -> None:
    """One part of a pull's work alone, on one thread reusing one cache-hot 1 MiB block as a
    pull's receive buffer is: sha256 of ``size`` bytes, or (with ``store``) writing them into a
    fresh file. The least CPU that work can take: nothing competes with it (two writers of one
    tmpfs file, for one, slow each other down)."""
    fd = os.open(store, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) if store else None

    def one(start: int) -> None:
        block = memoryview(os.urandom(1 << 20))
        h = hashlib.sha256()
        for pos in range(start, min(start + CHUNK, size), len(block)):
            piece = block[: min(len(block), size - pos)]
            if fd is None:
                h.update(piece)
            else:
                os.pwrite(fd, piece, pos)

    try:
        for start in range(0, size, CHUNK):
            one(start)
    finally:
        if fd is not None:
            os.close(fd)


def pull_once(url: str, dest: Path) -> None:
    asyncio.run(pull_version(url, TOKEN, RUN, 1, dest, parallel=2, timeout_s=120))


def cpu_s(pid: int | None = None) -> float:
    """User+system CPU seconds of this process (all threads) or of process ``pid``."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def egress(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    m = re.search(r"^rlboost_weights_bytes_served_total (\S+)$", text, re.M)
    assert m is not None, "no egress counter"
    return float(m[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_service(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBOOST_")}
    env.update(RLBOOST_WEIGHTS_URL=f"http://127.0.0.1:{port}", RLBOOST_DATA_DIR=str(data),
               RLBOOST_NATS_URL=f"nats://127.0.0.1:{free_port()}", RLBOOST_LOG_LEVEL="WARNING",
               RLBOOST_WEIGHTS_CHUNK_BYTES=str(CHUNK), RLBOOST_WEIGHTS_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "weight_svc"], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(f"{url}/healthz", timeout=0.5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("weight service did not start")


def joiner(url: str, dest: Path, peers: bool) -> None:
    """One joining instance (run as its own process): pull, keep serving until told to stop."""
    logging.basicConfig(level=logging.WARNING, format=f"joiner {dest.name}: %(message)s")
    logging.getLogger("shared.weights.pull").setLevel(logging.INFO)  # where its bytes came from
    serve = PeerServer(dest, TOKEN) if peers else None
    if serve is not None:
        serve.start()
    started = time.perf_counter()
    asyncio.run(pull_version(url, TOKEN, RUN, 1, dest, parallel=2, timeout_s=120,
                             peers=peers, serve=serve))
    print(f"done {time.perf_counter() - started:.3f}", flush=True)
    sys.stdin.read()  # keep serving peers until the benchmark closes our stdin
    if serve is not None:
        serve.close()


def joiners(url: str, root: Path, n: int, peers: bool) -> tuple[float, list[float]]:
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.weights", "--joiner", url, str(root / f"j{i}"),
             "1" if peers else "0"],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for i in range(n)
    ]
    times = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line.startswith("done"):
            raise RuntimeError(f"a joiner failed (rc={p.wait()})")
        times.append(float(line.split()[1]))
    wall = time.perf_counter() - started
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=30)
    return wall, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("all", "transfer", "delta"), default="all")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--joiners", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    delta = ap.add_argument_group("delta versions (benchmarks/weights_delta.py)")
    delta.add_argument("--steps", type=int, default=10)
    delta.add_argument("--layers", type=int, default=4)
    delta.add_argument("--hidden", type=int, default=512)
    delta.add_argument("--lr", type=float, default=1e-6)
    delta.add_argument("--dtypes", default="bf16,fp32",
                       help="the first is the one the adapter rows are set against")
    delta.add_argument("--lora-lr", type=float, default=1e-5,
                       help="the adapter's AdamW rate: LoRA's usual ~10x full fine-tuning's")
    ap.add_argument("--joiner", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.joiner:
        joiner(args.joiner[0], Path(args.joiner[1]), args.joiner[2] == "1")
        return
    if args.only in ("all", "transfer"):
        bench_transfer(args)
    if args.only in ("all", "delta"):
        bench_deltas(args)


def bench_deltas(args: argparse.Namespace) -> None:
    """Sections 5 and 6 (module doc): delta and adapter against full, per version, over real
    training steps."""
    with workspace("deltas") as (root, pulls, _, url):
        dtypes = args.dtypes.split(",")
        started = time.perf_counter()
        versions = weights_delta.train(root / "model", args.steps, args.layers, args.hidden,
                                       args.lr, dtypes)
        print(f"\n{args.steps} training steps ({args.layers} layers x {args.hidden}, AdamW lr "
              f"{args.lr:g}) in {time.perf_counter() - started:.1f} s; every rebuilt version "
              "equals the trainer's byte for byte (checked)")
        rows = {}
        for d in dtypes:
            rows[d] = weights_delta.measure(url, TOKEN, f"delta-{d}", versions[d], pulls)
            weights_delta.report(d, rows[d])
        d = dtypes[0]
        print(weights_delta.corrupt_one(url, TOKEN, root / "data", f"delta-{d}", versions[d],
                                        pulls))
        started = time.perf_counter()
        adapters, described = weights_adapter.train(root / "adapter", args.steps, args.layers,
                                                     args.hidden, args.lora_lr)
        print(f"\n{args.steps} LoRA training steps (AdamW lr {args.lora_lr:g}) in "
              f"{time.perf_counter() - started:.1f} s; {described}")
        adapter_rows = weights_delta.measure(url, TOKEN, "adapter", adapters, pulls)
        weights_adapter.report(adapter_rows, rows[d], d)


@contextlib.contextmanager
def workspace(name: str) -> Iterator[tuple[Path, Path, subprocess.Popen[bytes], str]]:
    """A scratch root, a directory for pulls (tmpfs where there is one) and a running weight
    service over ``root/data``: (root, pulls, its process, its URL); all gone afterwards."""
    root = Path(tempfile.mkdtemp(prefix=f"rlboost-bench-{name}-", dir="/tmp"))
    shm = Path("/dev/shm")
    pulls = Path(tempfile.mkdtemp(prefix="rlboost-bench-pulls-", dir=shm if shm.is_dir() else root))
    proc, url = start_service(root / "data")
    try:
        yield root, pulls, proc, url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(pulls, ignore_errors=True)


def bench_transfer(args: argparse.Namespace) -> None:
    """Sections 1-4 (module doc): one puller against raw TCP, then joiners with fan-out."""
    with workspace("weights") as (root, pulls, proc, url):
        size = make_checkpoint(root / "model", args.gib)
        asyncio.run(upload_version(url, TOKEN, RUN, 1, root / "model", timeout_s=120))
        weights = root / "model" / "model.safetensors"
        nbytes = weights.stat().st_size
        rows = [  # (label, what to run): interleaved, so a busy moment hits them all alike
            ("raw TCP send/recv (baseline)", lambda i: raw_tcp(weights, False)),
            ("raw TCP sendfile/recv (ref.)", lambda i: raw_tcp(weights, True)),
            ("part: sha256 alone", lambda i: one_part(nbytes, None)),
            ("part: write alone, fresh file", lambda i: one_part(nbytes, pulls / "w")),
            ("one puller (verified, 2 streams)", lambda i: pull_once(url, pulls / f"single{i}")),
        ]
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _ in rows}
        for i in range(args.repeat):
            for label, fn in rows:
                cpu, t = cpu_s() + cpu_s(proc.pid), time.perf_counter()
                fn(i)
                runs[label].append((time.perf_counter() - t, cpu_s() + cpu_s(proc.pid) - cpu))
                for leftover in pulls.iterdir():  # delete what it wrote, outside the measurement
                    (shutil.rmtree if leftover.is_dir() else Path.unlink)(leftover)
        best = {label: min(runs[label]) for label in runs}
        results = {}
        for peers in (False, True):
            before = egress(url)
            wall, times = joiners(url, pulls / f"join{int(peers)}", args.joiners, peers)
            results[peers] = (wall, max(times), (egress(url) - before) / size)
            shutil.rmtree(pulls / f"join{int(peers)}")

    print(f"\ncheckpoint {size / (1 << 30):.2f} GiB, {CHUNK >> 20} MiB chunks, "
          f"{CPUS} CPUs, pulls into {pulls.parent}; best of {args.repeat}")
    raw_s = best["raw TCP send/recv (baseline)"][0]
    gib = size / (1 << 30)
    print(f"{'transfer':34} {'seconds':>8} {'GiB/s':>7} {'CPU s':>6} {'x baseline':>11}")
    for label, (secs, cpu) in best.items():
        print(f"{label:34} {secs:8.2f} {gib / secs:7.2f} {cpu:6.2f} {raw_s / secs:11.2f}")
    head = f"{args.joiners} joiners started at once"
    print(f"\n{head:34} {'all done s':>10} {'slowest pull s':>15} {'egress x ckpt':>14}")
    for peers, (wall, slowest, mult) in results.items():
        name = "with peer fan-out" if peers else "service only"
        print(f"{name:34} {wall:10.2f} {slowest:15.2f} {mult:14.2f}")
    ratio = raw_s / best["one puller (verified, 2 streams)"][0]
    fan = results[True][2]
    print(f"\nacceptance: one puller {ratio:.2f}x baseline (>= 0.8: "
          f"{'PASS' if ratio >= 0.8 else 'FAIL'}); fan-out egress {fan:.2f}x checkpoint "
          f"(<= 2: {'PASS' if fan <= 2 else 'FAIL'})")
    # A verified pull must receive (as the sendfile row does), hash and write every byte; at
    # best it overlaps them perfectly on every core, so this caps its ratio from above.
    parts = ("raw TCP sendfile/recv (ref.)", "part: sha256 alone", "part: write alone, fresh file")
    work = sum(min(cpu for _, cpu in runs[label]) for label in parts)
    bound = raw_s / (work / CPUS)
    print(f"bound: receiving, hashing and writing the bytes, each alone, take {work:.2f} CPU s; "
          f"on {CPUS} CPUs no verified puller can exceed {bound:.2f}x the baseline "
          f"on this machine")


if __name__ == "__main__":
    main()
