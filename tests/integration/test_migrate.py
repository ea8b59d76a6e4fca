"""An upgrade from keys without hash tags: a step in flight goes on under the tagged names."""

from __future__ import annotations

import redis.asyncio as aioredis

from manager_svc.accounting import Ledger
from manager_svc.migrate import LAYOUT, LAYOUT_KEY, migrate, tagged_name
from shared.names import Keys
from shared.protocol import FrameEntry, TokenFrame

RUN = "run-old"


def frame(rid: str, epoch: int, offset: int, tokens: list[int], final: bool = False
          ) -> TokenFrame:
    return TokenFrame(instance_id="i1", entries=[FrameEntry.of(
        request_id=rid, epoch=epoch, weight_version=0, offset=offset, token_ids=tokens,
        final=final, finish_reason="stop" if final else None)])


async def to_old_layout(store: aioredis.Redis) -> None:
    """Rename every key to the name the release before tags gave it: the control keys lose
    ``{rlb}``, a run's keys their braces, and the per-run held sets merge into one set per
    instance (``rlb:inst:<id>:held``), as that release kept them."""
    async for key in store.scan_iter(match="*", count=1000):
        if key.startswith("rlb:held:"):
            instance = key.split(":")[-1]
            merged = f"rlb:inst:{instance}:held"
            await store.sunionstore(merged, [merged, key])
            await store.delete(key)
        elif key.endswith(":holders"):
            await store.delete(key)
        elif key.startswith("{rlb}:"):
            await store.rename(key, "rlb:" + key.removeprefix("{rlb}:"))
        elif "{" in key:
            await store.rename(key, key.replace("{", "").replace("}", ""))


def test_old_names_map_to_tagged_ones() -> None:
    rid = f"{RUN}:3:1:0"
    assert tagged_name(f"rlb:req:{rid}") == Keys.request(rid)
    assert tagged_name(f"rlb:req:{rid}:tokens") == Keys.tokens(rid)
    assert tagged_name(f"rlb:lease:{rid}") == Keys.lease(rid)
    assert tagged_name(f"rlb:run:{RUN}") == Keys.run(RUN)
    assert tagged_name(f"rlb:run:{RUN}:warnings") == Keys.run_warnings(RUN)
    assert tagged_name(f"rlb:step:{RUN}:3:pending") == Keys.pending(RUN, 3)
    assert tagged_name(f"rlb:samples:{RUN}:3") == Keys.samples(RUN, 3)
    assert tagged_name(f"rlb:steps:{RUN}") == Keys.step_records(RUN)
    assert tagged_name(f"rlb:events:{RUN}") == Keys.events(RUN)
    assert tagged_name(f"rlb:seeding:{RUN}") == Keys.seeding(RUN)
    assert tagged_name("rlb:runs") == Keys.runs and tagged_name("rlb:runq") == Keys.queue
    assert tagged_name("rlb:chunk-key") == Keys.chunk_key()
    assert tagged_name("rlb:inst:i1") == Keys.instance("i1")
    assert tagged_name("rlb:identity:i1") == Keys.identity("i1")
    # Tagged names, other programs' keys and held sets (split apart) are not renamed.
    assert tagged_name(Keys.request(rid)) is None and tagged_name("other:req:x") is None
    assert tagged_name("rlb:inst:i1:held") is None


async def test_a_step_in_flight_goes_on_after_the_move(store: aioredis.Redis) -> None:
    ledger = Ledger(store, lease_ttl_s=30)
    await ledger.create_step(RUN, 0, 0, [[1, 2], [3, 4]], samples=2, max_new_tokens=6)
    first, second = f"{RUN}:0:0:0", f"{RUN}:0:1:0"
    a = await ledger.assign(first, "i1", 1.0, 0, 2)
    b = await ledger.assign(second, "i1", 1.0, 0, 2)
    assert a is not None and b is not None
    [ok] = await ledger.commit(frame(first, a.epoch, 0, [5, 6]))
    assert ok.status == "ok"
    await store.set(Keys.chunk_key(), "secret")
    await store.set(Keys.active, RUN)
    await to_old_layout(store)
    assert await store.exists("rlb:inst:i1:held", f"rlb:lease:{first}", "rlb:active") == 3
    assert not [k async for k in store.scan_iter(match="*{*")]

    moved = await migrate(store)
    assert moved > 10
    assert await store.get(LAYOUT_KEY) == LAYOUT
    assert not [k async for k in store.scan_iter(match="rlb:*") if "{" not in k]
    assert await store.get(Keys.chunk_key()) == "secret" and await store.get(Keys.active) == RUN
    assert await store.smembers(Keys.held(RUN, "i1")) == {first, second}
    assert await store.smembers(Keys.holders(RUN)) == {"i1"}
    assert 0 < await store.pttl(Keys.lease(second)) <= 30_000  # its TTL moved with it
    # The lease, the offset and the committed tokens are where the ledger looks now.
    [done] = await ledger.commit(frame(first, a.epoch, 2, [7, 2], final=True))
    assert done.status == "final"
    [sample] = await ledger.samples([first])
    assert sample.response_token_ids == [5, 6, 7, 2]
    assert await store.smembers(Keys.held(RUN, "i1")) == {second}
    # Marked: a later start costs one read and moves nothing.
    await store.set("rlb:runq", "left by a stopped old manager")
    assert await migrate(store) == 0
