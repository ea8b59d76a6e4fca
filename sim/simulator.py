"""The whole system in simulated time, driven by the manager's own policy code.

SIMULATION. Mechanism here, policy from the services: the seeding window of each step is
:func:`manager_svc.seeding.next_window` fed by :func:`manager_svc.seeding.observe` with the
same measurements the manager records; who may take work, how much each instance is leased,
and which responses a rebalance moves are :mod:`manager_svc.placement`, the functions the
dispatcher calls. The step follows the services' protocol: the step starts when the trainer
has published its version; the reserved side generates during the window, hands its
unfinished responses to spot instances (token-level: they keep their committed tokens) and
trains groups as they complete; after the barrier the trainer finishes, steps the optimizer
and publishes the next version, which the reserved side swaps in and spot instances pull.

Bounded staleness (``Policy.staleness`` k > 0, issue 39): step m's responses are created
and leased once version m - k is published, oldest step first, to instances whose version is in
[m - k, m], so a trained token is never more than k versions old. The step the trainer is on
(``self.step``) keeps the synchronous step's seeding window and hand-off; spot instances keep
generating across its barrier, pull new versions in the background and stop only to load them,
after which the responses they hold continue on the new version (partial rollout) with their
whole context prefilled again (AReaL's interrupt and re-prefill). The reserved side never
generates while its GPUs train (the trainer takes its responses back first). With k = 0 only
one step is ever open and every event is the synchronous protocol's.

Agentic responses (:class:`sim.config.Turns`, docs/agentic.md): a model turn that ends before
the response does hands the response back (its slot frees at once); its tool call runs on the
reserved side's tool pool, taking no GPU; when the answer comes the observation's tokens are
committed and the response is pending again, leased like any other (the next instance prefills
its whole context, as after a move).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from manager_svc import placement
from manager_svc.seeding import DEFAULT_WINDOW_S, SeedingState, next_window, observe, retarget
from sim import engine
from sim.config import Cluster, Costs, Policy, Workload
from sim.engine import Instance, Response
from sim.events import EventQueue
from sim.fleet import Fleet
from sim.turns import make_response


@dataclass
class Step:
    index: int
    responses: list[Response]
    started: float = 0.0  # when the trainer came to it (its version published)
    window: float = 0.0
    mode: str = "off"
    opened: float = 0.0  # when its rollout could start: at ``started`` in a synchronous run
    pending: list[tuple[int, int, int]] = field(default_factory=list)  # heap: prompt, sample
    open_groups: list[int] = field(default_factory=list)  # responses left per prompt
    queue: list[int] = field(default_factory=list)  # complete groups the trainer knows of
    remaining: int = 0
    window_over: bool = False
    window_serial: int = 0  # the pending window-end event carries it; a moved end is new
    reserved_free: bool = False
    barrier_at: float | None = None
    barrier_seen: bool = False  # the trainer knows of the barrier (Costs.barrier_s after it)
    spot_first_at: float | None = None
    reserved_last_at: float | None = None  # the reserved side's last token (commit.lua's)
    tokens_reserved: int = 0
    tokens_spot: int = 0
    migrations: int = 0
    regenerated: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0  # summed over the step's calls
    reprefilled: int = 0  # context tokens prefilled again after a version swap mid-response


@dataclass
class Trainer:
    busy_until: float = 0.0
    busy_s: float = 0.0
    training: bool = False
    finishing: bool = False


def off_policy(r: Response) -> int:
    """Tokens of ``r`` sampled by a version older than its step's."""
    ends = [i for i, _ in r.versions[1:]] + [r.length]
    return sum(end - i for (i, v), end in zip(r.versions, ends, strict=True) if v < r.step)


class Simulator:
    def __init__(self, workload: Workload, costs: Costs, cluster: Cluster, policy: Policy,
                 rebalance_skew: int = 8, initial_window_s: float = DEFAULT_WINDOW_S,
                 audit: bool = False) -> None:
        self.workload, self.costs, self.cluster, self.policy = workload, costs, cluster, policy
        self.skew = rebalance_skew if policy.rebalance else 0
        self.clock = EventQueue()
        self.fleet = Fleet(self.clock, costs, self._on_ready, self._on_notice, workload.seed,
                           versions=policy.versions, base_preseeded=cluster.base_preseeded,
                           on_change=self._spot_changed, on_kill=self._on_kill,
                           hard_kill_share=cluster.hard_kill_share,
                           spot_speed=cluster.spot_speed, spot_batch=cluster.spot_batch)
        # A disaggregated reserved side: the rollout GPUs' instances only, and a trainer on
        # the others at their count's speed (the compute model's figures are per GPU count).
        self.dedicated = policy.rollout_gpus > 0
        if self.dedicated:
            train = cluster.reserved_gpus - policy.rollout_gpus
            if train < 1 or policy.rollout_gpus < costs.serving.gpus:
                raise ValueError(f"policy {policy.name}: {policy.rollout_gpus} rollout GPUs of "
                                 f"{cluster.reserved_gpus} leave no trainer or no instance")
            self.costs = costs = replace(costs, compute=replace(costs.compute, gpus=train))
        rollout = policy.rollout_gpus if self.dedicated else cluster.reserved_gpus
        self.fleet.add_reserved(max(1, rollout // costs.serving.gpus))
        self.seeding = SeedingState(window_s=policy.window_s or initial_window_s)
        self.trainer = Trainer()
        self.records: list[dict[str, Any]] = []
        self.step: Step | None = None  # the trainer's step
        self.open: dict[int, Step] = {}  # steps whose rollout has begun, not yet trained
        self.fleet.on_swap = self._swap
        self._idle_since: dict[str, float] = {}
        self._rebalanced: dict[str, float] = {}
        self._completed = 0
        # With ``audit``: (step, prompt, sample, tokens left, versions) of every completion,
        # for the tests; versions are the response's (first token index, version) changes.
        self.audit: list[tuple[int, int, int, int, tuple[tuple[int, int], ...]]] | None = \
            [] if audit else None
        # Stepping by hand (the hindsight sweep): a finished step does not start the next;
        # ``begin_step`` does, with ``force_window`` over the controller's choice if set.
        self.manual = False
        self.force_window: float | None = None

    # --- running ------------------------------------------------------------------------

    def run(self, span_s: float, warmup_steps: int = 1,
            steps: int | None = None) -> tuple[float, float]:
        """Run ``warmup_steps`` with the trace's first count up, then replay the trace from
        the next step's start for ``span_s`` (looping it if the span outlasts it, as the
        benchmark's trace player does), or with ``steps`` only until that many more steps
        have finished. Returns the measured span's (start, end)."""
        times, counts = self.cluster.spot_times, self.cluster.spot_counts
        if self.policy.spot:
            self.fleet.set_spot(counts[0], warm=self.cluster.spot_join_at_start)
        self._start_step(0)
        self.clock.run_until(math.inf, lambda: len(self.records) >= warmup_steps)
        t0 = self.clock.now
        if self.policy.spot and len(times) > 1:
            length = self.cluster.trace_length_s or times[-1] + 1.0
            for lap in range(int(span_s // length) + 1):
                for t, c in zip(times, counts, strict=True):
                    if (lap or t > 0) and lap * length + t < span_s:
                        self.clock.at(t0 + lap * length + t, partial(self.fleet.set_spot, c))
        if steps is None:
            self.clock.run_until(t0 + span_s)
            return t0, t0 + span_s
        self.clock.run_until(t0 + span_s, lambda: len(self.records) >= warmup_steps + steps)
        return t0, self.clock.now

    # --- the step -----------------------------------------------------------------------

    def _open_step(self, index: int) -> Step:
        """Step ``index``'s responses, pending: its rollout may begin."""
        w = self.workload
        responses: list[Response] = []
        for p in range(w.prompts):
            for s in range(w.samples):
                r = make_response(w, index, p, s, len(responses))
                r.step = index
                responses.append(r)
        step = Step(index, responses, opened=self.clock.now,
                    open_groups=[w.samples] * w.prompts, remaining=len(responses))
        step.pending = [(r.prompt, r.sample, n) for n, r in enumerate(responses)]
        heapq.heapify(step.pending)
        self.open[index] = step
        return step

    def _start_step(self, index: int) -> None:
        """Version ``index`` is published: the trainer comes to step ``index``, and every step
        up to ``index + staleness`` may roll out."""
        for m in range(index, index + self.policy.staleness + 1):
            if m not in self.open:
                self._open_step(m)
        spot_alive = placement.spot_count(self._registered())
        mode = self.policy.seeding if self.policy.spot else "off"
        if self.force_window is not None and mode != "off":
            window = self.force_window
        elif mode == "adaptive":
            window = next_window(self.seeding, spot_alive)
        else:
            window = self.policy.window_s if mode == "fixed" else 0.0
        self.seeding.window_s, self.seeding.spot_count = window, spot_alive
        step = self.open[index]
        step.started, step.window, step.mode = self.clock.now, window, mode
        # The trainer takes groups as they complete once the reserved side is free of rollout:
        # at once when spot instances do it all, or when the rollout GPUs are not the trainer's.
        step.reserved_free = (mode == "off" and spot_alive > 0) or self.dedicated
        step.window_over = mode == "off"
        self.step = step
        if mode != "off":
            self.clock.after(window, partial(self._window_end, step, step.window_serial))
        if step.barrier_seen:  # rolled out ahead while the last step trained: train it now
            self._train_next()
        self._dispatch()
        self._tick(step)

    def _spot_changed(self) -> None:
        """The registered spot count may have moved: an open adaptive window follows it, as
        the manager's dispatcher does (:func:`manager_svc.seeding.retarget`)."""
        step = self.step
        if step is None or step.window_over or step.mode != "adaptive" \
                or self.force_window is not None:
            return
        count = placement.spot_count(self._registered())
        window = retarget(self.seeding, count)
        if window is None:
            return
        self.seeding.window_s, self.seeding.spot_count = window, count
        step.window = window
        step.window_serial += 1
        self.clock.after(max(0.0, step.started + window - self.clock.now),
                         partial(self._window_end, step, step.window_serial))

    def _registered(self) -> list[dict[str, Any]]:
        """The registry's view: instances that started their engine and have not left."""
        rows = [i.row() for i in self.fleet.instances if i.state in ("loading", "ready",
                                                                      "draining")]
        if not self.policy.midstep_join and self.step is not None:
            rows = placement.joined_in_time(rows, self.step.started)
        return rows

    def _rolling(self) -> list[Step]:
        """Open steps with responses not yet complete, oldest first."""
        return [s for _, s in sorted(self.open.items()) if s.barrier_at is None]

    def _window_end(self, step: Step, serial: int) -> None:
        if step is not self.step or step.barrier_at is not None or serial != step.window_serial:
            return
        step.window_over = True
        if not placement.spot_alive(self._registered()):
            return  # nobody to hand to: the reserved side generates on, trains after
        for inst in self.fleet.instances:
            if inst.kind == "reserved" and inst.held:
                self._take_back(inst, list(inst.held), flush=True)
        self.clock.after(self.costs.handoff_s, partial(self._reserved_free, step))

    def _reserved_free(self, step: Step) -> None:
        """The hand-off is done: the reserved side trains on groups as they complete."""
        if step is self.step:
            step.reserved_free = True
            self._train_next()
            self._dispatch()

    def _tick(self, step: Step) -> None:
        """The dispatcher's periodic pass (its rebalancing needs time to pass), one chain from
        each trainer step's start while any open step is still rolling out."""
        if step is not self.step or not self._rolling():
            return
        self._dispatch()
        self.clock.after(self.costs.dispatch_interval_s, partial(self._tick, step))

    # --- dispatch: the manager's placement policy ----------------------------------------

    def _dispatch(self) -> None:
        step, rolling = self.step, self._rolling()
        if step is None or not rolling:
            return
        everyone = self._registered()
        in_window = step.mode != "off" and not step.window_over
        takers = placement.takers([i for i in everyone if i["state"] == "ready"], in_window,
                                  in_window or placement.spot_alive(everyone))
        if self.policy.staleness and not self.dedicated and (self.trainer.training
                                                             or self.trainer.finishing):
            takers = [i for i in takers if i["kind"] != "reserved"]  # its GPUs train
        k = self.policy.staleness
        for s in rolling:  # oldest first; an instance serves a step within k versions of it
            if not s.pending:
                continue
            ready = [i for i in takers if s.index - k <= i["obj"].version <= s.index]
            for row, room in placement.lease_plan(len(s.pending), [i["obj"].row()
                                                                   for i in ready]):
                inst: Instance = row["obj"]
                batch = []
                while room > 0 and s.pending:
                    batch.append(s.responses[heapq.heappop(s.pending)[2]])
                    room -= 1
                for r in batch:
                    r.owner = inst
                    inst.held.append(r)
                self.clock.after(self.costs.control_s, partial(self._deliver, inst, batch))
            if s.pending:
                return
        ready = [i for i in takers if i["obj"].version >= rolling[0].index - k]
        if self.skew and ready:
            self._rebalance(ready)

    def _rebalance(self, ready: list[dict[str, Any]]) -> None:
        now = self.clock.now
        rows = [i["obj"].row() for i in ready]
        placement.idle_marks(rows, self._idle_since, now)
        chosen = placement.rebalance_move(rows, self._idle_since, self._rebalanced, now,
                                          self.skew)
        if chosen is None:
            return
        busy, _, count = chosen
        self._rebalanced[busy["id"]] = now
        inst: Instance = busy["obj"]
        by_id = {f"{r.step}:{r.prompt}:{r.sample}": r for r in inst.held}
        move = placement.least_advanced([(k, r.committed) for k, r in by_id.items()], count)
        self._take_back(inst, [by_id[k] for k in move], flush=False)
        self.clock.after(0.0, self._dispatch)

    def _deliver(self, inst: Instance, batch: list[Response]) -> None:
        # A response taken back before its delivery and leased to the same instance again has
        # two deliveries on their way: the second finds it there already.
        there = {id(r) for r in inst.queue} | {id(r) for r in inst.active}
        batch = [r for r in batch if r.owner is inst and not r.done and id(r) not in there]
        if not batch or inst.state not in ("ready", "loading"):
            return
        inst.queue.extend(batch)
        self._touch(inst)

    def _take_back(self, inst: Instance, rids: list[Response], flush: bool) -> None:
        """Revoke ``rids`` from ``inst``: back to pending, with what survives the move."""
        self._cut(inst)
        gone = set(map(id, rids))
        inst.held = [r for r in inst.held if id(r) not in gone]
        inst.active = [r for r in inst.active if id(r) not in gone]
        inst.queue = type(inst.queue)(r for r in inst.queue if id(r) not in gone)
        for r in rids:
            if r.done or r.owner is not inst:  # finished, or its turn did, in the cut
                continue
            keep = r.committed if flush else \
                r.committed // self.costs.chunk_tokens * self.costs.chunk_tokens
            keep = max(keep, r.turn_start)  # a committed turn end and observation stay
            if self.policy.migration == "request":
                keep, r.turn = 0, 0  # the trajectory from its start (tools run again)
            r.versions = [v for v in r.versions if v[0] < keep]
            step = self.open[r.step]
            step.regenerated += r.committed - keep
            r.committed, r.owner = keep, None
            r.moves += 1
            step.migrations += 1
            heapq.heappush(step.pending, (r.prompt, r.sample, r.index))
        self._restart(inst)

    def _on_ready(self, inst: Instance) -> None:
        self._dispatch()

    def _on_notice(self, inst: Instance) -> None:
        if inst.held:
            self._take_back(inst, list(inst.held), flush=True)
        self.clock.after(0.0, self._dispatch)

    def _on_kill(self, inst: Instance) -> None:
        """A hard kill: the engine stops with what it generated so far and hands nothing
        back; the manager takes its responses back when their leases expire, from their last
        committed chunk (what was generated past it is lost)."""
        if not inst.held:
            return
        self._cut(inst)
        self.clock.after(self.costs.lease_ttl_s, partial(self._leases_expired, inst))

    def _leases_expired(self, inst: Instance) -> None:
        if inst.held:
            self._take_back(inst, list(inst.held), flush=False)
            self._dispatch()

    # --- the engine: segments of continuous batching -------------------------------------

    def _cut(self, inst: Instance) -> None:
        """Stop the running segment at the next decode-step boundary."""
        end = engine.boundary(inst, self.clock.now)
        self._finish(inst, self._advance(inst, cut=True))
        inst.seg_start = end  # the engine is busy until then

    def _touch(self, inst: Instance) -> None:
        if inst.seg_steps:
            self._cut(inst)
            self._restart(inst)
        elif inst.seg_start <= self.clock.now or not inst.active:
            self._restart(inst)

    def _restart(self, inst: Instance) -> None:
        start = max(self.clock.now, inst.seg_start)
        if start > self.clock.now:
            serial = inst.seg_serial + 1
            inst.seg_serial = serial
            self.clock.at(start, partial(self._begin, inst, serial))
            return
        self._begin(inst, inst.seg_serial)

    def _begin(self, inst: Instance, serial: int) -> None:
        if serial != inst.seg_serial or inst.seg_steps:
            return
        end = engine.start_segment(inst, self.costs, self.clock.now)
        if end is None:
            return
        step = self.step
        if inst.kind == "spot" and step is not None and step.spot_first_at is None:
            step.spot_first_at = self.clock.now
        serial = inst.seg_serial
        self.clock.at(end, partial(self._segment_end, inst, serial))

    def _segment_end(self, inst: Instance, serial: int) -> None:
        if serial != inst.seg_serial:
            return
        self._finish(inst, self._advance(inst, cut=False))
        inst.seg_start = self.clock.now
        self._begin(inst, inst.seg_serial)
        self._dispatch()

    def _advance(self, inst: Instance, cut: bool) -> tuple[list[Response], int]:
        """:func:`sim.engine.advance`, noting the version of each response's new tokens: one
        segment runs on one version (a swap cuts it)."""
        batch = list(inst.active)
        done = engine.advance(inst, self.clock.now, cut)
        steps, version = done[1] // max(1, len(batch)), inst.version  # each made ``steps``
        if steps:
            for r in batch:
                if not r.versions or r.versions[-1][1] != version:
                    r.versions.append((r.committed - steps, version))
        return done

    def _swap(self, inst: Instance, load_s: float) -> None:
        """A serving instance has pulled a new version: its engine stops at the next decode
        step for the load, then prefills the whole context of every response it was running
        again (the KV cache was computed with the old weights)."""
        resume = max(inst.seg_start, self.clock.now)  # a pause already under way stays
        self._cut(inst)
        if self.step is not None:
            self.step.reprefilled += sum(r.prompt_tokens + r.committed for r in inst.active)
        inst.seg_start = max(inst.seg_start, resume) + load_s
        inst.queue.extendleft(reversed(inst.active))
        inst.active = []
        self._restart(inst)

    def _finish(self, inst: Instance, done: tuple[list[Response], int]) -> None:
        finished, tokens = done
        step = self.step
        if step is not None:  # what the reserved side and spot made while the trainer was here
            if inst.kind == "spot":
                step.tokens_spot += tokens
            else:
                step.tokens_reserved += tokens
                if tokens:
                    step.reserved_last_at = self.clock.now
        for r in finished:
            step = self.open[r.step]
            if r.committed < r.length:  # a model turn ended: its tool call, off the GPU
                r.owner = None
                inst.held.remove(r)
                seconds = r.tool_s[r.turn]
                step.tool_calls += 1
                step.tool_s += seconds
                self.clock.after(seconds, partial(self._answered, step, r))
                continue
            r.done, r.owner = True, None
            inst.held.remove(r)
            step.remaining -= 1
            self._completed += 1
            if self.audit is not None:
                self.audit.append((step.index, r.prompt, r.sample, r.committed - r.length,
                                   tuple(r.versions)))
            step.open_groups[r.prompt] -= 1
            if step.open_groups[r.prompt] == 0:
                self._to_trainer(partial(step.queue.append, r.prompt))
            if step.remaining == 0 and step.barrier_at is None:
                step.barrier_at = self.clock.now
                self._to_trainer(partial(setattr, step, "barrier_seen", True))
        if finished:
            self._train_next()

    def _answered(self, step: Step, r: Response) -> None:
        """A tool call's answer: the observation is committed, the next turn is pending."""
        if self.open.get(step.index) is not step:
            return
        r.turn += 1
        r.committed = r.turn_start
        heapq.heappush(step.pending, (r.prompt, r.sample, r.index))
        self._dispatch()

    def _to_trainer(self, news: Any) -> None:
        """What the manager tells the trainer (a group complete, the barrier): it arrives
        Costs.barrier_s later, the control plane's latency from the last token."""
        if self.costs.barrier_s <= 0:
            news()
            return

        def arrive() -> None:
            news()
            self._train_next()
        self.clock.after(self.costs.barrier_s, arrive)

    # --- the trainer ---------------------------------------------------------------------

    def _train_next(self) -> None:
        t, step = self.trainer, self.step
        if step is None or t.training or t.finishing:
            return
        if step.queue and (step.reserved_free or step.barrier_seen):
            prompt = step.queue.pop(0)
            group = step.responses[prompt * self.workload.samples:
                                   (prompt + 1) * self.workload.samples]
            tokens = sum(r.prompt_tokens + r.length for r in group)
            self._busy(tokens * self.costs.compute.seconds_per_token, self._trained)
        elif not step.queue and step.barrier_seen:
            t.finishing = True
            self._busy(self.costs.compute.optimizer_step_s + self.costs.publish_s,
                       self._published)

    def _busy(self, seconds: float, then: Any) -> None:
        if self.policy.staleness and not self.dedicated:  # the reserved GPUs train now
            for inst in self.fleet.instances:
                if inst.kind == "reserved" and inst.held:
                    self._take_back(inst, list(inst.held), flush=True)
            self.clock.after(0.0, self._dispatch)
        self.trainer.training = True
        self.trainer.busy_s += seconds
        self.clock.after(seconds, then)

    def _trained(self) -> None:
        self.trainer.training = False
        self._train_next()

    def _published(self) -> None:
        if self.costs.report_s > 0:  # the report's way back, and the next step's creation
            self.clock.after(self.costs.report_s, self._step_end)
        else:
            self._step_end()

    def _step_end(self) -> None:
        step, t = self.step, self.trainer
        assert step is not None and step.barrier_at is not None
        now = self.clock.now
        # A step rolled out ahead reached its barrier before the trainer came to it: for the
        # trainer's spans it came when the step started.
        barrier_at = max(step.barrier_at, step.started)
        # Trained tokens: what the model sampled (observations are masked out of the loss).
        tokens = sum(r.length - r.observed for r in step.responses)
        window = min(step.window, barrier_at - step.started)
        # The span the reserved side generated over, as the manager measures it: the window,
        # or, never handed off (no spot to take the work), until its last token.
        last = step.reserved_last_at if step.reserved_last_at is not None else barrier_at
        generated = min(last, barrier_at) - step.started if not step.reserved_free \
            else window
        spot_first = barrier_at if step.spot_first_at is None else \
            min(step.spot_first_at, barrier_at)
        record = {
            "step": step.index, "tokens": tokens, "responses": len(step.responses),
            "started_at": step.started, "finished_at": now, "step_s": now - step.started,
            "rollout_s": barrier_at - step.started, "train_s": t.busy_s,
            "trainer_idle_s": now - self.costs.report_s - step.started - t.busy_s,
            "publish_s": self.costs.publish_s, "seeding_window_s": step.window,
            "window_seen_s": window, "tokens_reserved": step.tokens_reserved,
            "tokens_spot": step.tokens_spot, "migrations": step.migrations,
            "tokens_regenerated": step.regenerated, "spot_count": self.seeding.spot_count,
            "tool_calls": step.tool_calls, "tool_s": step.tool_s,
            "spot_first_s": spot_first - step.started,
            "reserved_last_s": min(last, barrier_at) - step.started,
            "tail_s": barrier_at - step.started - window,
            "opened_at": step.opened, "oldest_version": min(
                (v for r in step.responses for _, v in r.versions), default=step.index),
            "tokens_off_policy": sum(off_policy(r) for r in step.responses),
            "tokens_reprefilled": step.reprefilled,
            "train_tail_s": now - self.costs.report_s - barrier_at - self.costs.publish_s
            - self.costs.compute.optimizer_step_s,
        }
        registered = self._registered()
        spot_rows = [i for i in registered if i["kind"] == "spot"]
        spot_now = len(spot_rows)
        observe(self.seeding, {
            "tokens": tokens, "tokens_reserved": step.tokens_reserved,
            "tokens_spot": step.tokens_spot, "window_s": generated, "train_s": t.busy_s,
            "spot_ready_s": spot_first - step.started, "spot_busy_s": barrier_at - spot_first,
            "spot_count": spot_now, "publish_s": self.costs.publish_s,
            "reserved_count": sum(1 for i in registered if i["kind"] == "reserved"),
            "spot_joined": [float(i["joined_at"]) - step.started for i in spot_rows]})
        self.records.append(record)
        self.trainer = Trainer()
        self.step = None
        del self.open[step.index]
        self.fleet.publish(step.index + 1, keep_serving=self.policy.staleness > 0)
        if not self.manual:
            self._start_step(step.index + 1)

    def begin_step(self, index: int) -> None:
        """Manual stepping: start step ``index`` now (the previous one has finished)."""
        self._start_step(index)

    def start_trace(self) -> None:
        """Manual stepping: the trace's count at 0 up now, its changes from now on."""
        times, counts = self.cluster.spot_times, self.cluster.spot_counts
        self.fleet.set_spot(counts[0], warm=self.cluster.spot_join_at_start)
        for t, c in zip(times[1:], counts[1:], strict=True):
            self.clock.at(t, partial(self.fleet.set_spot, c))

    # --- what it cost --------------------------------------------------------------------

    def gpu_seconds(self, start: float, end: float) -> tuple[float, float]:
        """(reserved, spot) GPU-seconds billed in [start, end]."""
        gpus = self.cluster.spot_gpus or self.costs.serving.gpus
        return (self.cluster.reserved_gpus * (end - start),
                self.fleet.spot_instance_s(start, end) * gpus)

    @property
    def completed(self) -> int:
        return self._completed
