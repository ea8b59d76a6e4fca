"""``make bench-wan``: a rollout instance streaming its tokens over a WAN link, against the LAN.

Spot instances often run in another region or cloud than the reserved side (SkyPilot moves a
preempted worker to the next region), so every chunk they commit crosses a link with tens of
milliseconds of round trip. EMULATION of the link only: one emu rollout instance (32 responses
at once, modelled H100 decode time) reaches NATS through a local TCP proxy that delays each
direction by half of ``--rtt-ms``; the manager, trainer, weight service and brokers are the real
ones, as usual. Printed, measured in the same run: rollout tokens per second with the proxy at
0 ms (the baseline) and at the given round trip, and their ratio: how much of the instance's
generation the link costs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared.ports import free_port
from shared.process import exit_on_sigterm

SPEC = {"model": "emu", "steps": 4, "prompts_per_step": 8, "samples_per_prompt": 4,
        "max_new_tokens": 256, "seed": 7}
ENV = {"RLBOOST_EMU_TIME_SCALE": "1.0", "RLBOOST_CHUNK_TOKENS": "4", "RLBOOST_MAX_BATCH": "32",
       "RLBOOST_LOG_LEVEL": "WARNING"}


class DelayProxy:
    """Forwards TCP connections from a local port to ``target``, each byte ``one_way_s`` late in
    either direction (a link's latency, not its bandwidth), on a loop in its own thread."""

    def __init__(self, target_port: int, one_way_s: float) -> None:
        self.target_port, self.one_way_s = target_port, one_way_s
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer))

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                dst.write(data)
                await dst.drain()
            dst.close()

        sender = asyncio.create_task(deliver())
        with contextlib.suppress(ConnectionError):
            while data := await src.read(1 << 16):
                queue.put_nowait((time.monotonic() + self.one_way_s, data))
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(ConnectionError):
            await sender


def run_at(rtt_s: float, root: Path) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    env = {**stack.env(), **ENV, "RLBOOST_DATA_DIR": str(root / "data")}
    cluster = Cluster(root, spot=0, reserved=0, engine="emu", base_env=env)
    nats_port = int(env["RLBOOST_NATS_URL"].rsplit(":", 1)[1])
    try:
        with DelayProxy(nats_port, rtt_s / 2) as proxy:
            cluster.start()
            far = env["RLBOOST_NATS_URL"].rsplit(":", 1)[0] + f":{proxy.port}"
            cluster.add_instance("spot", "spot-far", {"RLBOOST_NATS_URL": far})
            with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
                run_id = client.post("/v1/runs", json=SPEC).json()["id"]
                end = time.monotonic() + 600
                while (run := client.get(f"/v1/runs/{run_id}").json())["state"] not in (
                        "succeeded", "failed", "cancelled"):
                    if time.monotonic() > end:
                        raise RuntimeError(f"run did not finish at rtt {rtt_s * 1e3:.0f} ms")
                    time.sleep(0.3)
                steps = client.get(f"/v1/runs/{run_id}/steps").json()[1:]  # step 0: start-up
    finally:
        cluster.stop()
        stack.stop()
    if run["state"] != "succeeded":
        raise RuntimeError(f"run {run['state']}: {run.get('error')}")
    return {"rtt_ms": rtt_s * 1e3,
            "tok_s": sum(s["tokens"] for s in steps) / sum(s["rollout_s"] for s in steps),
            "rollout_s": statistics.fmean(s["rollout_s"] for s in steps)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="the WAN link's round trip")
    args = parser.parse_args(argv)
    exit_on_sigterm()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlboost-bench-wan-") as tmp:
        for rtt_ms in (0.0, args.rtt_ms):
            print(f"rollout over a {rtt_ms:.0f} ms link ...", flush=True)
            rows.append(run_at(rtt_ms / 1e3, Path(tmp) / f"rtt{rtt_ms:.0f}"))
    print("\nEMULATION (emu engine, modelled H100 decode; delayed loopback link to NATS)")
    print(f"{'link RTT ms':>11} {'rollout tok/s':>14} {'rollout s/step':>15} {'x baseline':>11}")
    for r in rows:
        print(f"{r['rtt_ms']:>11.0f} {r['tok_s']:>14.0f} {r['rollout_s']:>15.2f} "
              f"{r['tok_s'] / rows[0]['tok_s']:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
