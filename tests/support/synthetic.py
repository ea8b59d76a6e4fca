"""A long run's records written straight into Redis: the dashboard's load without the wait.

:func:`fill_run` appends step records shaped as the manager writes them and the instance
events the registry would have recorded (joins, one version load per instance per step,
preemptions), with stream ids spread over the run's time as Redis would have stamped them.
"""

from __future__ import annotations

import json
import math
import time

import redis

from shared.names import Keys


def record(step: int) -> dict[str, float | int | str]:
    step_s = 2.0 + 0.5 * math.sin(step / 7)
    return {"step": step, "weight_version": step, "new_weight_version": step + 1,
            "responses": 128, "tokens": 1024 + step % 50, "reward_mean": 0.2 + 0.6 * step / 1000,
            "eval_reward_mean": 0.3 + 0.5 * step / 1000 if step % 10 == 0 else None,
            "step_s": step_s, "rollout_s": step_s * 0.6, "train_s": step_s * 0.3,
            "publish_s": 0.05, "trainer_idle_s": step_s * 0.6, "rollout_idle_s": step_s * 0.35,
            "seeding_window_s": 0.4, "seeding_mode": "adaptive", "migrations": step % 4,
            "preemptions": int(step % 25 == 0), "tokens_regenerated": 3 * (step % 4),
            "duplicate_chunks_dropped": 0, "stale_chunks_rejected": 0, "loss": 0.01}


def fill_run(r: redis.Redis, run_id: str, first: int, last: int, instances: int,
             t0: float | None = None) -> None:
    """Steps ``first..last-1`` of ``run_id`` and their instance events (``instances`` of them,
    a quarter reserved; every tenth spot instance is preempted at step 500)."""
    t0 = t0 if t0 is not None else time.time() - 2.0 * last
    pipe = r.pipeline(transaction=False)
    names = [f"{'reserved' if i < instances // 4 else 'spot'}-{i}" for i in range(instances)]
    for step in range(first, last):
        t = t0 + 2.0 * step
        events: list[tuple[float, dict[str, str | int]]] = []
        for i, name in enumerate(names):
            kind = name.split("-")[0]
            if step == 0:
                events.append((t, {"type": "join", "instance": name, "kind": kind,
                                   "version": -1}))
            gone = kind == "spot" and i % 10 == 0 and step >= 500
            if step == 500 and gone:
                events.append((t + 0.5, {"type": "leave", "instance": name, "kind": kind,
                                         "reason": "preempt"}))
            elif not gone:
                events.append((t + 0.01 * i, {"type": "version", "instance": name,
                                              "kind": kind, "version": step}))
        events.sort(key=lambda e: e[0])
        for seq, (when, fields) in enumerate(events):
            pipe.xadd(Keys.events(run_id), {k: str(v) for k, v in fields.items()},
                      id=f"{int(when * 1000)}-{seq}")
        pipe.rpush(Keys.step_records(run_id), json.dumps(record(step)))
        if step % 20 == 0:
            pipe.execute()
    pipe.hset(Keys.run(run_id), mapping={"step": last, "updated_at": time.time()})
    pipe.execute()
