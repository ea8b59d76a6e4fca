"""Data-parallel training under ``torchrun``: rank 0 serves, every other rank follows its commands.

Contract:

- Rank 0 runs the ordinary trainer service (NATS, REST, checkpoints, publishing). Its policy is
  a :class:`DistributedPolicy`, which has the same interface as
  :class:`~trainer_svc.learn.policies.torch_policy.TorchPolicy`; the service cannot tell the two
  apart. Ranks > 0 run :func:`worker_loop` and never touch the network beyond the process group,
  except to upload their own files of a sharded version to the weight service.
- Every call on rank 0's policy that changes training state is first broadcast as a command
  (the dataclasses below) on a dedicated gloo *command group*, so every rank sees one total
  order of commands. ``setup`` opens a run (the model directory is resolved by rank 0 first,
  so a cached model is never built by two ranks at once); ``restore`` loads the newest
  checkpoint everywhere, checks all ranks loaded the same version, then broadcasts rank 0's
  parameters; ``add_group`` names one owner rank (round-robin over the run): every rank
  records the group (rewards, lengths: what advantages, mini-batches and denominators need)
  and only the owner scores and backpropagates it; ``step`` runs
  :meth:`~trainer_svc.learn.step_trainer.StepTrainer.step` on every rank, which before each
  optimizer step all-reduces (SUM) the gradients, a per-parameter has-gradient flag and the
  loss-side sums (:func:`all_reduce_grads`); every rank then runs the *same* code on the same
  numbers, so parameters and optimizer state stay identical without ever being sent again.
- Only rank 0 writes checkpoints: its state equals every other rank's.
- With a :class:`~trainer_svc.learn.policies.fsdp.ShardingConfig` in ``Setup`` every rank holds a
  :class:`~trainer_svc.learn.policies.fsdp.ShardedPolicy` instead: no rank holds the whole model,
  so every computing call is collective. Rank 0 then hands groups out in rounds of one per
  rank (``AddRound``: as soon as ``world`` groups have arrived, the last partial round at the
  barrier) and every rank restores and saves (``Save``) its own shards, and uploads the files
  it wrote when rank 0 publishes the version (``Upload``,
  :mod:`~trainer_svc.learn.policies.publish`).
- Replicated data parallelism with one explicit all-reduce per optimizer step, on CPU (gloo)
  and CUDA (nccl) alike. DDP does not fit: it all-reduces inside every ``backward``, which
  needs every rank to run the same number of backwards, but here a group is backpropagated by
  its owner alone as it streams in. One reduction per step moves the same bytes DDP would.
  Sharding (above) is for models whose weights and AdamW state do not fit one device.
- The data directory must be shared by the ranks (one node, or a shared file system).

Failure: a rank that dies takes the torchrun job down (torchrun's own rule). On rank 0 the
collective that lost its peer raises :class:`~trainer_svc.errors.GroupLost` rather than an
error that would fail the run; the service exits, torchrun starts the group again
(:mod:`trainer_svc.torchrun`) and the new rank 0 resumes from the last checkpoint like any
restarted trainer. A worker that loses rank 0 raises and exits the same way.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]

from shared.algorithm import AlgorithmConfig
from shared.spec import LoraSpec
from trainer_svc.errors import group_lost
from trainer_svc.learn.checkpoint import RunCheckpoints
from trainer_svc.learn.policies.fsdp import ShardedPolicy, ShardingConfig
from trainer_svc.learn.policies.publish import (
    WeightsAccess,
    publish_from_ranks,
    publish_whole,
    upload_share,
)
from trainer_svc.learn.policies.torch_policy import TorchPolicy
from trainer_svc.learn.step_trainer import Group, RunShape

log = logging.getLogger("trainer.dist")

# The worker's receive waits this long for the next command; rank 0 sends a Ping after
# HEARTBEAT_S of silence, so an idle trainer (no run for hours) never trips the timeout, while
# a hung rank 0 is reported within minutes rather than waited on forever.
COMMAND_TIMEOUT = timedelta(minutes=5)
HEARTBEAT_S = 20.0
# How long leaving waits for a thread of this module to end; one stuck in a collective with a
# dead peer is left behind (the job is failing then anyway).
JOIN_S = 10.0


# --- commands: rank 0 -> every other rank --------------------------------------------------

@dataclass(frozen=True, slots=True)
class Setup:
    model_dir: Path  # HF model directory, already built by rank 0
    run_dir: Path  # the run's checkpoint directory (shared file system)
    learning_rate: float  # base rate; the schedule is learning_rate_at(step, base)
    seed: int  # torch seed set before loading, as on rank 0
    dtype: torch.dtype  # parameter dtype
    algorithm: AlgorithmConfig  # the run's objective
    shape: RunShape  # what the objective needs of the run's shape
    sharding: ShardingConfig | None = None  # FSDP2 over the ranks; None = replicated
    lora: LoraSpec | None = None  # adapters on a frozen base; None = every weight trains


@dataclass(frozen=True, slots=True)
class Restore:
    pass


@dataclass(frozen=True, slots=True)
class AddGroup:
    owner: int  # the one rank that backpropagates this group
    group: Group  # every rank records it


@dataclass(frozen=True, slots=True)
class AddRound:
    groups: list[Group | None]  # index = the rank that backpropagates it (sharded runs)


@dataclass(frozen=True, slots=True)
class Save:
    version: int  # every rank writes its shards of this version (sharded runs)


@dataclass(frozen=True, slots=True)
class Upload:
    run_id: str  # every rank uploads its own files of this version (sharded runs)
    version: int


@dataclass(frozen=True, slots=True)
class Reset:
    pass


@dataclass(frozen=True, slots=True)
class Step:
    step_index: int  # RL step; sets the learning rate


@dataclass(frozen=True, slots=True)
class Ping:
    pass


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Setup | Restore | AddGroup | AddRound | Reset | Step | Save | Upload | Ping | Stop
Local = TorchPolicy | ShardedPolicy  # what each rank holds


class DistributedError(RuntimeError):
    """The ranks disagree (e.g. restored different checkpoints) or a command was out of order."""


@dataclass(frozen=True, slots=True)
class Launch:
    """Where this process sits in a torchrun job (torchrun's RANK/WORLD_SIZE/LOCAL_RANK)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Launch | None:
        """The launch, or None when not started by torchrun."""
        env = os.environ if env is None else env
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")))


# --- the process-wide channel ---------------------------------------------------------------

class Channel:
    """The command group and, on rank 0, the sender with its heartbeat thread."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 sharding: ShardingConfig | None = None,
                 weights: WeightsAccess | None = None) -> None:
        self.group = group
        self.device = device  # where this rank's model lives (cuda:<local rank> under nccl)
        self.sharding = sharding  # the job's default for torch runs (None: replicated)
        self.weights = weights  # where ranks > 0 upload their shards of a version
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._lock = threading.Lock()  # one broadcast at a time: the service thread vs heartbeat
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._beat: threading.Thread | None = None
        if self.rank == 0:
            self._beat = threading.Thread(target=self._heartbeat, name="dist-heartbeat",
                                          daemon=True)
            self._beat.start()

    def send(self, command: Command) -> None:
        if self.rank != 0:
            raise DistributedError("only rank 0 sends commands")
        with self._lock:
            if self._error is not None:
                raise DistributedError(f"command channel failed: {self._error!r}")
            if self._closed.is_set():
                raise DistributedError("command channel closed")
            dist.broadcast_object_list([command], src=0, group=self.group)
            self._last_send = time.monotonic()
            # Closed under the lock: a heartbeat after Stop would wait on workers that left.
            if isinstance(command, Stop):
                self._closed.set()

    def receive(self) -> Command:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        command: Command = box[0]
        return command

    def close(self) -> None:
        """Rank 0: tell the workers to leave and end the heartbeat (idempotent; a dead worker
        is not an error here)."""
        if self.rank != 0:
            return
        if not self._closed.is_set():
            try:
                self.send(Stop())
            except Exception as exc:  # workers already gone, e.g. torchrun forwarded the SIGTERM
                log.warning("could not stop the workers: %r", exc)
                self._closed.set()
        if self._beat is not None:
            _join(self._beat)

    def _heartbeat(self) -> None:
        while not self._closed.wait(HEARTBEAT_S / 4):
            if time.monotonic() - self._last_send < HEARTBEAT_S:
                continue
            try:
                self.send(Ping())
            except Exception as exc:
                # Surfaced by the next real command; torchrun ends the job when a rank dies.
                log.error("heartbeat to the workers failed: %r", exc)
                self._error = exc
                return


# torch.distributed's own state is process-wide; the channel lives beside it, because the
# service builds policies through make_policy(spec, ...), which has no place to pass it.
_channel: Channel | None = None


def init(launch: Launch, sharding: ShardingConfig | None = None,
         weights: WeightsAccess | None = None) -> Channel:
    """Join the torchrun job: nccl on CUDA, gloo on CPU; a gloo command group on top."""
    global _channel
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    store = _attempt_store(launch)
    if store is None:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=store, rank=launch.rank,
                                world_size=launch.world_size)
    # Commands are pickled Python objects: they ride gloo on the CPU even beside nccl, and on
    # their own group so a worker's receiver thread never interleaves with gradient traffic.
    group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    _channel = Channel(group, device, sharding, weights)
    log.info("rank %d of %d on %s", launch.rank, launch.world_size, device)
    return _channel


def _attempt_store(launch: Launch) -> Store | None:
    """torchrun's store with this attempt's own key space; None: not under torchrun's agent.

    The agent keeps one store for every restart of the group, and the ranks of a restarted
    group read their peers' gloo addresses from it: without a prefix per attempt a new rank
    can read a dead one's address, fail to connect ("Gloo connectFullMesh failed ...
    Connection refused") and cost the job one of its restarts (seen here on the first restart
    after a rank was SIGKILLed)."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), launch.world_size,
                          is_master=False, timeout=COMMAND_TIMEOUT)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"rlboost/attempt-{attempt}/", store)


def channel() -> Channel | None:
    """The channel when this process is one of several ranks, else None."""
    if _channel is None or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return _channel


def shutdown() -> None:
    """Stop the workers (rank 0) and leave the process group: every group, the command group
    included, is shut down here, on the calling thread, while the interpreter is whole."""
    global _channel
    if _channel is not None:
        _channel.close()
    # A sharded model is a reference cycle (FSDP2's hooks close over their modules) holding
    # the device mesh's groups: collected here, on this thread, while the interpreter is
    # whole, not during finalization, where a group's destructor can abort the process
    # ("terminate called without an active exception", rank 1, 1 of 6 jobs).
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    _channel = None


def _join(thread: threading.Thread) -> None:
    """Wait for one of this module's threads before the process group goes.

    A daemon thread that outlives the main one can hold the last reference to the channel
    (a thread's target is a bound method or closure over it). The command group's Python
    object is then freed on that thread during interpreter finalization; its destructor
    releases the GIL, the thread cannot take it back from a finalizing interpreter and
    exits through the C++ destructor, and the process aborts with "terminate called without
    an active exception" (2 of 6 sharded test jobs here, both on rank 0)."""
    thread.join(JOIN_S)
    if thread.is_alive():
        log.warning("%s did not end within %.0f s", thread.name, JOIN_S)


# --- what every rank does identically --------------------------------------------------------

def _build(setup: Setup, device: torch.device) -> Local:
    if setup.sharding is not None:
        return ShardedPolicy(setup.model_dir, setup.run_dir, setup.learning_rate, setup.seed,
                             dtype=setup.dtype, device=device, algorithm=setup.algorithm,
                             shape=setup.shape, sharding=setup.sharding, lora=setup.lora)
    return TorchPolicy(setup.model_dir, setup.run_dir, setup.learning_rate, setup.seed,
                       dtype=setup.dtype, device=device, algorithm=setup.algorithm,
                       shape=setup.shape, reduce=all_reduce_grads, lora=setup.lora)


def _sync_restore(local: TorchPolicy, version: int | None) -> int:
    """Rank 0 passes the version it restored; the others restore only after it has.

    Ordered so, because restoring may write the version's HF directory, and two ranks
    writing one directory of a shared file system would corrupt it. A rank that then finds
    another version means the data directory is not shared; every rank sees the same mismatch
    flag, so all of them raise together.
    """
    device = next(local.model.parameters()).device
    theirs = torch.tensor([version if version is not None else 0], dtype=torch.int64,
                          device=device)
    dist.broadcast(theirs, src=0)
    if version is None:
        version = local.checkpoints.restore(local.model, local.optimizer)
    mismatch = torch.tensor([int(version != int(theirs[0]))], dtype=torch.int64, device=device)
    dist.all_reduce(mismatch)
    if int(mismatch[0]):
        raise DistributedError(f"rank 0 restored v{int(theirs[0])} but a rank found another "
                               "version; is the data directory shared?")
    # Identical by construction already; the broadcast makes it so by fiat, once per run.
    with torch.no_grad():
        for p in local.model.parameters():
            dist.broadcast(p.data, src=0)
    return version


def _max_over_ranks(value: float, device: torch.device) -> float:
    """Every rank calls this after each step: the step record's memory is the worst rank's."""
    box = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box[0])


def all_reduce_grads(params: list[torch.nn.Parameter], sums: torch.Tensor) -> torch.Tensor:
    """Sum every rank's gradients into each rank's ``.grad``; returns ``sums`` summed too."""
    device, dtype = params[0].device, params[0].dtype
    sizes = [p.numel() for p in params]
    # One flat buffer: each gradient (zeros where this rank has none) then a has-gradient flag
    # per parameter. The flags keep "no gradient" distinct from "zero gradient": AdamW still
    # moves a parameter whose gradient is zero, so a parameter no rank touched must stay None,
    # exactly as in a single process.
    flat = torch.zeros(sum(sizes) + len(params), dtype=dtype, device=device)
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            flat[offset:offset + sizes[i]].copy_(p.grad.reshape(-1))
            flat[sum(sizes) + i] = 1
        offset += sizes[i]
    summed = sums.to(device=device, dtype=torch.float64)
    dist.all_reduce(flat)
    dist.all_reduce(summed)
    offset = 0
    for i, p in enumerate(params):
        has_grad = bool(flat[sum(sizes) + i] > 0)
        p.grad = flat[offset:offset + sizes[i]].view_as(p).clone() if has_grad else None
        offset += sizes[i]
    return summed.cpu()


# --- rank 0 --------------------------------------------------------------------------------

@contextlib.contextmanager
def _on_group() -> Iterator[None]:
    """Around rank 0's calls that need every rank: a lost peer surfaces as GroupLost."""
    try:
        yield
    except Exception as exc:
        lost = group_lost(exc)
        if lost is None or lost is exc:
            raise
        raise lost from exc


class DistributedPolicy:
    """Rank 0's policy: broadcasts each training command, then does its own share."""

    def __init__(self, local: Local, chan: Channel) -> None:
        self.local = local
        self.chan = chan
        self.checkpoints: RunCheckpoints = local.checkpoints
        self.eos_id: int = local.eos_id
        self.vocab_size: int = local.vocab_size
        self._groups = 0  # groups added this run: the next owner is _groups % world
        self._round: list[Group] = []  # sharded: groups waiting for a full round

    @classmethod
    @_on_group()
    def setup(cls, model_dir: Path, run_dir: Path, learning_rate: float, seed: int,
              dtype: torch.dtype = torch.float32, *, algorithm: AlgorithmConfig | None = None,
              shape: RunShape | None = None,
              sharding: ShardingConfig | None = None,
              lora: LoraSpec | None = None) -> DistributedPolicy:
        chan = channel()
        if chan is None:
            raise DistributedError("torch.distributed is not initialised with several ranks")
        sharding = sharding or chan.sharding
        cmd = Setup(model_dir, run_dir, learning_rate, seed, dtype,
                    algorithm or AlgorithmConfig.for_algorithm(), shape or RunShape(),
                    sharding, lora)
        chan.send(cmd)
        return cls(_build(cmd, chan.device), chan)

    @_on_group()
    def restore(self) -> int:
        self.chan.send(Restore())
        if isinstance(self.local, ShardedPolicy):
            return self.local.restore()
        return _sync_restore(self.local, self.local.restore())

    def reward(self, prompt: list[int], response: list[int]) -> float:
        return self.local.reward(prompt, response)

    @_on_group()
    def add_group(self, group: Group) -> None:
        if isinstance(self.local, ShardedPolicy):
            self._round.append(group)
            if len(self._round) == self.chan.world_size:
                self._flush(self.local)
            return
        owner = self._groups % self.chan.world_size
        self._groups += 1
        # Sent to every rank: each records the group, only its owner backpropagates it.
        self.chan.send(AddGroup(owner, group))
        self.local.add_group(group, owned=owner == 0)

    def _flush(self, local: ShardedPolicy) -> None:
        groups: list[Group | None] = [*self._round]
        groups += [None] * (self.chan.world_size - len(groups))
        self._round = []
        self.chan.send(AddRound(groups))
        local.add_round(groups)

    @_on_group()
    def reset(self) -> None:
        self._round = []
        self.chan.send(Reset())
        self.local.reset()

    @_on_group()
    def step(self, step_index: int) -> dict[str, Any]:
        if isinstance(self.local, ShardedPolicy) and self._round:
            self._flush(self.local)
        self.chan.send(Step(step_index))
        stats = self.local.step(step_index)
        stats["peak_memory_bytes"] = _max_over_ranks(stats["peak_memory_bytes"], self.chan.device)
        return stats

    @_on_group()
    def save(self, version: int) -> None:
        if isinstance(self.local, ShardedPolicy):
            self.chan.send(Save(version))
        self.local.save(version)

    async def publish(self, access: WeightsAccess, run_id: str, version: int) -> None:
        """Upload and commit a saved version: from every rank when sharded, else from here."""
        hf_dir = self.checkpoints.hf_dir(version)
        if not isinstance(self.local, ShardedPolicy):
            await publish_whole(access, run_id, version, hf_dir)
            return
        with _on_group():
            await publish_from_ranks(access, run_id, version, hf_dir, self.chan.device,
                                     lambda: self.chan.send(Upload(run_id, version)))


# --- ranks > 0 -----------------------------------------------------------------------------

def worker_loop() -> Local | None:
    """Serve rank 0's commands until Stop; returns the last policy (tests compare it)."""
    chan = channel()
    if chan is None or chan.rank == 0:
        raise DistributedError("worker_loop runs on ranks > 0 of a multi-rank job")
    # A receiver thread keeps taking commands while the main thread computes, so rank 0's
    # add_group returns at once and the ranks backpropagate their groups in parallel.
    inbox: queue.Queue[Command | BaseException] = queue.Queue()

    def receive() -> None:
        while True:
            try:
                command = chan.receive()
            except BaseException as exc:
                inbox.put(exc)
                return
            inbox.put(command)
            if isinstance(command, Stop):
                return

    receiver = threading.Thread(target=receive, name="dist-receive", daemon=True)
    receiver.start()
    policy: Local | None = None
    while True:
        item = inbox.get()
        if isinstance(item, BaseException | Stop):
            _join(receiver)  # it has returned, or is returning (_join)
        if isinstance(item, BaseException):
            raise DistributedError(f"lost rank 0: {item!r}") from item
        if isinstance(item, Stop):
            return policy
        if isinstance(item, Setup):
            policy = None  # free the last run's model before loading the next
            try:
                policy = _build(item, chan.device)
            except Exception:
                # Rank 0 fails the same load and fails the run; this rank waits for the next
                # Setup instead of taking the whole job down over one bad run.
                log.exception("could not set up %s", item.model_dir)
        elif not isinstance(item, Ping):
            if policy is None:
                raise DistributedError(f"{type(item).__name__} before any Setup")
            _apply(policy, item, chan.rank)


def _apply(policy: Local, command: Command, rank: int) -> None:
    if isinstance(policy, ShardedPolicy):
        match command:
            case Restore():
                policy.restore()
            case AddRound(groups=groups):
                policy.add_round(groups)
            case Save(version=version):
                policy.save(version)
            case Upload(run_id=run_id, version=version):
                chan = channel()
                upload_share(chan.weights if chan else None, run_id, version,
                             policy.checkpoints.hf_dir(version), rank, policy.device)
            case Reset():
                policy.reset()
            case Step(step_index=step_index):
                _max_over_ranks(policy.step(step_index)["peak_memory_bytes"], policy.device)
            case _:
                raise DistributedError(f"{type(command).__name__} in a sharded run")
        return
    match command:
        case Restore():
            _sync_restore(policy, None)
        case AddGroup(owner=owner, group=group):
            policy.add_group(group, owned=owner == rank)
        case Reset():
            policy.reset()
        case Step(step_index=step_index):
            _max_over_ranks(policy.step(step_index)["peak_memory_bytes"],
                            next(policy.model.parameters()).device)
        case _:
            pass  # Setup, Ping and Stop never reach here (worker_loop handles them)
