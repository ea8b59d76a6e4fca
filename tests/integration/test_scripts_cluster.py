"""Every Redis script the manager registers reaches the keys of one hash slot, on a real cluster.

Each top-level script of ``manager_svc/lua`` (a file no other includes) is run through the
manager's own code (the ledger, the run store, the registry, turns, the rejection counter, the
dispatch lease, the auth callout's binding, run history and events) against three
``redis-server`` cluster nodes sharing the slots, for two runs whose hash tags sit on two
different nodes, the control scripts (``{rlb}`` keys) once. Then: every script was run; no
script execution touched more than one slot; every key of each run is on its tag's node alone.

Why the audit (:class:`tests.support.redis_cluster.SlotAudit`, MONITOR on every node): the
scripts build most keys themselves (a response's hash from its request id, a step's sets from
a name in ARGV), and Redis 6.2 serves a key a script did not declare whenever its slot is on
the same node, so a script mixing two slots of one node would pass here unnoticed. The audit
asks each node which arguments of each command a script ran are keys (COMMAND GETKEYS) and
flags any execution that reached two slots, wherever they live.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from pathlib import Path

import nkeys

from manager_svc import scripts
from manager_svc.accounting import Ledger
from manager_svc.archive import Archive
from manager_svc.callout import AuthCallout
from manager_svc.chunk_auth import Rejections
from manager_svc.crash import CrashPoints
from manager_svc.events import InstanceEvents
from manager_svc.leader import Leadership
from manager_svc.metrics import ManagerMetrics
from manager_svc.registry import Registry
from manager_svc.runs import RunStore
from manager_svc.soft_state import SoftState
from manager_svc.turns import Turns
from rlboost.stack import Stack
from shared import identity
from shared.bus import connect_nats, connect_redis
from shared.config import ManagerConfig
from shared.names import Keys, call_id, request_id, tag
from shared.protocol import (
    FrameEntry,
    Heartbeat,
    HeartbeatReply,
    Held,
    TokenFrame,
    ToolClaim,
    ToolResult,
)
from shared.spec import RunSpec
from tests.support.redis_cluster import RedisClusterNodes, SlotAudit

_TAG = re.compile(r"\{[^}]*\}")


def script_shas() -> dict[str, str]:
    """Every script the manager registers (the lua files no other includes), by file: SHA1."""
    lua = Path(scripts.__file__).with_name("lua")
    included = {m for path in lua.glob("*.lua")
                for m in re.findall(r"^-- include: (\S+\.lua)$", path.read_text(), re.M)}
    return {path.name: hashlib.sha1(scripts.source(path.name).encode()).hexdigest()
            for path in sorted(lua.glob("*.lua")) if path.name not in included}


def shas_by_tag(audit: SlotAudit) -> dict[str, set[str]]:
    """The SHA1s run by EVALSHA with a declared key of each hash tag ("{rlb}", a run's)."""
    found: dict[str, set[str]] = {}
    for sha, keys in audit.evalsha_calls():
        for key in keys:
            m = _TAG.search(key.decode())
            found.setdefault(m.group() if m else key.decode(), set()).add(sha)
    return found


def login(name: str, password: str) -> identity.AuthRequest:
    """An authorization request as the NATS server sends it for a rollout login: a fresh user
    key that signed the server's nonce (the callout checks the signature before binding)."""
    seed = identity.new_user_seed()
    nonce = uuid.uuid4().hex
    signature = nkeys.from_seed(bytearray(seed.encode())).sign(nonce.encode())
    return identity.AuthRequest(
        server_id="S", user_nkey=identity.public_key(identity.new_user_seed()), user="",
        password="", token=password, nkey=identity.public_key(seed),
        signature=base64.urlsafe_b64encode(signature).decode().rstrip("="), nonce=nonce,
        name=name)


def frame(inst: str, *entries: tuple[str, int, int, list[int], str | None]) -> TokenFrame:
    """(request id, epoch, offset, ids, finish reason or None) per entry."""
    return TokenFrame(instance_id=inst, entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=0, offset=offset, token_ids=ids,
        final=finish is not None, finish_reason=finish)  # type: ignore[arg-type]
        for rid, epoch, offset, ids, finish in entries])


async def drive_run(run_id: str, runs: RunStore, ledger: Ledger, registry: Registry,
                    turns: Turns, rejections: Rejections) -> None:
    """Every per-run script once at least, on ``run_id``'s keys, as the manager runs them."""
    assert await runs.active() == run_id  # activate.lua, start_run.lua
    # Step 0, agentic (a model turn's "stop" waits for the environment): create_requests.lua,
    # create_step.lua.
    assert await ledger.create_step(run_id, 0, 0, [[1, 2], [3, 4]], samples=2,
                                    max_new_tokens=8, extra={"max_turns": 2})
    rids = [request_id(run_id, 0, p, s) for p in range(2) for s in range(2)]
    leases = await ledger.assign_many(rids[:3], "i1", 1.0, 0, 2)  # assign.lua
    assert [a.request_id for a in leases] == rids[:3]
    held = [Held(request_id=a.request_id, epoch=a.epoch) for a in leases]
    reply = await registry.on_heartbeat(Heartbeat(  # beat.lua ({rlb}), beat_run.lua (the run's)
        instance_id="i1", kind="spot", engine="emu", state="ready", run_id=run_id,
        weight_version=0, held=held, capacity=4, session="s1"))
    assert isinstance(reply, HeartbeatReply) and reply.target is not None
    assert reply.target.run_id == run_id and not reply.revoke
    assert await ledger.renew_many("i1", [(a.request_id, a.epoch, 1) for a in leases]) == []
    assert len(await ledger.stalled_leases(run_id, 0, 0.0)) == 3  # stalled_leases.lua
    assert await ledger.expired_leases(run_id, 0) == []  # expired_leases.lua
    statuses = [r.status for r in await ledger.commit(frame(  # commit.lua
        "i1", (rids[0], leases[0].epoch, 0, [5, 6], "stop"), (rids[1], leases[1].epoch, 0, [7],
                                                               None)))]
    assert statuses == ["tool", "ok"]
    assert await ledger.revoke(rids[2])  # revoke.lua
    claimed = await turns.on_claim(ToolClaim(run_id=run_id, step=0))  # claim_calls.lua
    assert [c.request_id for c in claimed.calls] == [rids[0]]
    answered = await turns.answer(ToolResult(  # turn.lua
        request_id=rids[0], turn=0, call_id=call_id(rids[0], 0), done=True, reward=1.0))
    assert answered.status == "final"
    samples = await ledger.samples(rids)  # read_samples.lua
    assert samples[0].response_token_ids == [5, 6] and samples[1].response_token_ids == [7]
    bad = frame("i1", (rids[1], leases[1].epoch, -1, [8], None))
    rejections.add(bad, bad.entries[0], "rlb.chunks.x", "invalid", "negative offset -1")
    await rejections.flush()  # count_if_exists.lua
    # Step 1, dynamic sampling: extend_step.lua, then close_step.lua keeps group 0, filters
    # group 1 and aborts group 2 in flight (its owner's lease and response keys built).
    await ledger.create_step(run_id, 1, 0, [[5], [6]], samples=1, max_new_tokens=4,
                             extra={"dynamic": 1})
    assert await ledger.extend_step(run_id, 1, 2, [[7]], 1, 4, max_prompts=6) == 3
    dyn = [request_id(run_id, 1, p, 0) for p in range(3)]
    mine, theirs = await ledger.assign_plan([("i1", dyn[:2]), ("i2", dyn[2:])], 1.0, 0, 2)
    done = await ledger.commit(frame("i1", *[(a.request_id, a.epoch, 0, [9, 2], "stop")
                                             for a in mine]))
    assert [r.status for r in done] == ["group", "group"]
    assert await ledger.close_step(run_id, 1, keep=[0], filtered=[1], capped=False) == (
        0, [("i2", theirs[0].request_id)])
    # A warning and an event: expire_with_run.lua (RunHistory's and InstanceEvents' own).
    await runs.warn(run_id, "a warning")
    await registry.events.died(run_id, "i2")
    # The run's one step ends it: finish_step.lua, then clear_active.lua ({rlb}).
    await runs.finish_step(run_id, 0, {"step": 0}, json.dumps([]), steps=1)
    assert (await runs.get(run_id) or {})["state"] == "succeeded"


async def test_every_script_reaches_one_slot_on_a_cluster(brokers: Stack,
                                                          tmp_path: Path) -> None:
    shas = script_shas()
    with RedisClusterNodes(tmp_path / "cluster") as nodes:
        audit = SlotAudit(nodes.ports)
        audit.start()
        redis = await connect_redis(nodes.url)
        nc = await connect_nats(brokers.nats.url, "scripts-cluster")
        try:
            archive = Archive(tmp_path)
            metrics = ManagerMetrics()
            runs = RunStore(redis, archive)
            ledger = Ledger(redis, lease_ttl_s=30.0)
            registry = Registry(ManagerConfig.from_env({}), redis, ledger, runs, metrics,
                                SoftState(), InstanceEvents(redis, archive),
                                CrashPoints("", tmp_path))
            turns, rejections = Turns(redis), Rejections(redis, metrics)
            spec = RunSpec(model="emu", steps=1, prompts_per_step=2, samples_per_prompt=2)
            # Two runs on two nodes (enqueue.lua): a candidate on the first's node is
            # cancelled (clear_active.lua) and another submitted.
            first = (await runs.create(spec))["id"]
            second = (await runs.create(spec))["id"]
            while nodes.node_of(Keys.run(second)) == nodes.node_of(Keys.run(first)):
                await runs.cancel(second)
                second = (await runs.create(spec))["id"]
            for run_id in (first, second):
                await drive_run(run_id, runs, ledger, registry, turns, rejections)
            # The control scripts with no run: the dispatch lease (leader.lua) taken and
            # given up, and the callout's binding (bind_identity.lua), the second login
            # past the credential's cap of one live id (its prune reads other ids' keys).
            lead = Leadership(redis, Keys.dispatch_leader, "m1", 5.0, metrics)
            assert await lead.held()
            await lead.release()
            callout = AuthCallout(nc, redis, identity.new_account_seed(), {"spot": "pw"},
                                  metrics, max_instances=1)
            assert await callout.check(login("login-1", "pw")) is None
            refused = await callout.check(login("login-2", "pw"))
            assert refused is not None and "live instances" in refused
            audit.settle(nodes.client)
        finally:
            audit.stop()
            await nc.close()
            await redis.aclose()

        ran = audit.evalshas()
        not_run = sorted(n for n, sha in shas.items() if sha not in ran)
        assert not not_run, f"scripts never run: {not_run}"
        # Per-run scripts ran for both runs; the others on the control keys.
        by_tag = shas_by_tag(audit)
        control = by_tag.get("{rlb}", set())
        for run_id in (first, second):
            mine = by_tag.get(tag(run_id), set())
            missing = sorted(n for n, sha in shas.items() if sha not in control | mine)
            assert not missing, f"not run on the keys of {run_id}: {missing}"
        executions, commands, bad = audit.violations()
        # Enough to mean something: two runs' worth of every per-run script, each a few calls.
        assert executions >= 2 * len(shas) and commands >= 5 * executions, (executions,
                                                                             commands)
        assert not bad, [(port, slots, [b" ".join(c[:2]) for c in run[:6]])
                         for port, slots, run in bad[:5]]
        # Every key of each run sits on its tag's node, and on no other.
        for run_id in (first, second):
            home = nodes.node_of(Keys.run(run_id))
            for port in nodes.ports:
                with nodes.client(port) as node:
                    found = list(node.scan_iter(match=f"*{tag(run_id)}*", count=1000))
                if port == home:
                    assert Keys.run(run_id) in found and len(found) > 10, (run_id, found)
                else:
                    assert found == [], (run_id, port, found[:5])
