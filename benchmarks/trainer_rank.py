"""One rank of a ``make bench-trainer`` job: a step at each sequence length, timed by phase.

Run under torchrun by ``python -m benchmarks.trainer --rank-of SPEC`` (SPEC: a :class:`RankSpec`
as JSON); rank 0 writes its ``base`` bytes and one :class:`StepRow` per step as JSON to
``RankSpec.out``. benchmarks/trainer.py documents what the figures mean; this module only
measures them.

The steps, in order: two at :data:`SHORT` tokens per sequence (the first creates AdamW's state,
the second is the baseline every activation figure is taken against), then ``steps`` steps at
each of ``seq_lens``. A step is ``groups`` groups of ``samples`` sequences of ``length`` tokens:
a 4-token prompt and ``length - 4`` response tokens, drawn at random from the vocabulary, every
response of a group the same length (no padding), or with ``ragged`` from the full length down
to half of it (padded to the longest row in the forward).

Phases. :class:`PhaseClock` times, in process CPU seconds, what FSDP2's hooks
(``torch/distributed/fsdp/_fully_shard``: the methods :func:`instrumented` wraps), the
optimizer step (torch's global optimizer hooks) and ``clip_grad_norm_`` do in each step; a
range nested in another counts for the inner one only. ``torch.profiler`` is not used: the
resident memory it kept after each profiled step (0.39 GiB on the 707M model) would have been
counted as activations.
"""

from __future__ import annotations

import json
import os
import random
import resource
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SHORT = 16  # tokens per sequence of the warm-up and baseline steps: the old ~12-token regime
MODES = ("plain", "fsdp2", "fsdp2-ac")  # replicated; sharded; sharded with recomputation

# FSDP2's hooks and the phase each one's own time goes to. Before a unit's forward and its
# backward it unshards (at one rank a copy of every parameter into its unsharded storage; at
# more an all-gather with its copies, and the wait for the slowest rank); after the backward it
# reduce-scatters the gradient (copies in and out, the collective) and frees the unsharded
# parameters; everything else (freeing after forward, the root's set-up and final callback)
# is "fsdp other".
FSDP_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("FSDPParamGroup", "pre_forward", "unshard fwd"),
    ("FSDPParamGroup", "pre_backward", "unshard bwd"),
    ("FSDPParamGroup", "post_backward", "reduce"),
    ("FSDPParamGroup", "post_forward", "fsdp other"),
    ("FSDPParamGroup", "finalize_backward", "fsdp other"),
    ("FSDPState", "_root_pre_forward", "fsdp other"),
    ("FSDPState", "_root_post_backward_final_callback", "fsdp other"),
)
PHASES = ("unshard fwd", "unshard bwd", "reduce", "fsdp other", "optimizer", "clip")


class PhaseClock:
    """CPU seconds per phase; a nested range's time counts for it, not its parent.

    Only the thread that made the clock is timed: FSDP2's hooks and the optimizer run on the
    rank's main thread (on the CPU autograd runs backward on the calling thread), and a
    distributed rank's receiver thread must not enter ranges half-way.
    """

    def __init__(self, now: Callable[[], float] = time.process_time) -> None:
        self.owner = threading.get_ident()
        self._now = now
        self.cpu: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._open: list[tuple[str, float, list[float]]] = []  # phase, start, children's

    def reset(self) -> None:
        self.cpu = dict.fromkeys(PHASES, 0.0)

    def enter(self, phase: str) -> None:
        if threading.get_ident() == self.owner:
            self._open.append((phase, self._now(), [0.0]))

    def exit(self) -> None:
        if threading.get_ident() != self.owner or not self._open:
            return
        phase, start, children = self._open.pop()
        spent = self._now() - start
        self.cpu[phase] += spent - children[0]
        if self._open:
            self._open[-1][2][0] += spent

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        return timed


@contextmanager
def instrumented(clock: PhaseClock) -> Iterator[None]:
    """FSDP2's hooks (:data:`FSDP_HOOKS`), ``clip_grad_norm_`` and every optimizer step timed
    by ``clock`` while inside. Class attributes are replaced: FSDP2 looks its hooks up at each
    call, and the step trainer calls ``torch.nn.utils.clip_grad_norm_`` by that name."""
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    owners: dict[str, Any] = {"FSDPParamGroup": _fsdp_param_group.FSDPParamGroup,
                              "FSDPState": _fsdp_state.FSDPState}
    swapped: list[tuple[Any, str, Any]] = [(torch.nn.utils, "clip_grad_norm_",
                                            torch.nn.utils.clip_grad_norm_)]
    swapped += [(owners[cls], name, getattr(owners[cls], name)) for cls, name, _ in FSDP_HOOKS]
    phase_of = {name: phase for _, name, phase in FSDP_HOOKS} | {"clip_grad_norm_": "clip"}
    with ExitStack() as stack:
        for owner, name, original in swapped:
            setattr(owner, name, clock.wrap(phase_of[name], original))
            stack.callback(setattr, owner, name, original)
        pre = register_optimizer_step_pre_hook(lambda *_: clock.enter("optimizer"))
        post = register_optimizer_step_post_hook(lambda *_: clock.exit())
        stack.callback(pre.remove)
        stack.callback(post.remove)
        yield


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What one job's ranks run (passed to them as a JSON file)."""

    model_dir: str
    mode: str  # one of MODES
    seq_lens: list[int]
    steps: int  # measured steps per length
    groups: int  # per step
    samples: int  # per group
    vocab: int
    out: str
    ragged: bool = False  # a group's responses run from the full length down to half of it

    @staticmethod
    def load(path: Path) -> RankSpec:
        return RankSpec(**json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


@dataclass(slots=True)
class StepRow:
    """One step as rank 0 saw it."""

    length: int  # tokens per sequence, prompt included
    tokens: int  # every sequence's tokens over the step's groups, padding included
    before: int  # rank 0's resident (CUDA: allocated) bytes once reset, before the step
    step_s: float = 0.0  # wall seconds: every group's add_group plus the optimizer step
    cpu_s: float = 0.0  # rank 0's process CPU seconds (user + system) over the same span
    sys_s: float = 0.0  # of which in the kernel: page faults of fresh buffers, mostly
    faults: int = 0  # minor page faults: 4 KiB pages touched for the first time
    peak: int = 0  # the step's peak bytes, the worst rank's
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per phase (PHASES)


def _group(rng: random.Random, index: int, length: int, spec: RankSpec) -> Any:
    from trainer_svc.embedded import task
    from trainer_svc.learn.step_trainer import Group

    prompt = task.make_prompt(rng.randrange(10), 3)
    samples, full = spec.samples, length - len(prompt)
    # Ragged: the i-th response is shorter by i / (2 (samples - 1)) of the full length, so the
    # forward pads every row but the first to the longest, as a rollout's group does.
    sizes = [full - (full * i // (2 * (samples - 1)) if spec.ragged else 0)
             for i in range(samples)]
    responses = [[rng.randrange(task.SEP_ID + 1, spec.vocab) for _ in range(n)] for n in sizes]
    rewards = [(0.0, 1.0, 0.5, 0.25)[i % 4] for i in range(samples)]  # never all equal
    return Group(prompt_index=index, prompts=[prompt] * samples, responses=responses,
                 rewards=rewards, truncated=[False] * samples)


def _policy(spec: RankSpec, launch: Any, device: Any) -> Any:
    """Rank 0's policy; None on the other ranks, after they served the job."""
    import torch.distributed as dist

    from trainer_svc.learn.policies import distributed
    from trainer_svc.learn.policies.distributed import DistributedPolicy
    from trainer_svc.learn.policies.fsdp import ShardedPolicy, ShardingConfig
    from trainer_svc.learn.policies.torch_policy import TorchPolicy
    from trainer_svc.learn.step_trainer import RunShape

    # float32 compute in both trainers, so they do the same arithmetic.
    sharding = None if spec.mode == "plain" else ShardingConfig(
        param_dtype=None, reduce_dtype=None, activation_checkpointing=spec.mode == "fsdp2-ac")
    shape = RunShape(max_new_tokens=max(spec.seq_lens), groups_per_step=spec.groups)
    run_dir = Path(spec.out).parent / f"run-{spec.mode}-{launch.world_size}"
    model_dir = Path(spec.model_dir)
    if launch.world_size == 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        if sharding:
            return ShardedPolicy(model_dir, run_dir, 1e-5, 0, device=device, shape=shape,
                                 sharding=sharding)
        return TorchPolicy(model_dir, run_dir, 1e-5, 0, device=device, shape=shape)
    distributed.init(launch, sharding)
    if launch.rank != 0:
        distributed.worker_loop()
        return None
    return DistributedPolicy.setup(model_dir, run_dir, 1e-5, 0, shape=shape, sharding=sharding)


def _step(policy: Any, step: int, row: StepRow, groups: list[Any], clock: PhaseClock) -> None:
    """Run one step into ``row``: its time, CPU, faults and phases (its peak: the caller)."""
    from trainer_svc.learn.policies.fsdp import ShardedPolicy

    clock.reset()
    system, faults = os.times().system, resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started, cpu = time.perf_counter(), time.process_time()
    for group in groups:
        if isinstance(policy, ShardedPolicy):
            policy.add_round([group])  # one rank: a round is one group
        else:
            policy.add_group(group)
    row.peak = int(policy.step(step)["peak_memory_bytes"])
    row.step_s = time.perf_counter() - started
    row.cpu_s = time.process_time() - cpu
    row.sys_s = os.times().system - system  # clock ticks: 10 ms resolution
    row.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    row.cpu = dict(clock.cpu)


def run(spec: RankSpec) -> None:
    """This rank's part of the job (module doc)."""
    import torch
    import torch.distributed as dist

    from trainer_svc.learn.policies import distributed
    from trainer_svc.learn.policies.distributed import Launch
    from trainer_svc.learn.step_meter import PeakMemory

    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    memory = PeakMemory(device)
    # On CUDA the figures are torch's allocated bytes, which start at 0; on the CPU the
    # resident set, of which this much is the interpreter and libraries.
    base = 0 if device.type == "cuda" else memory.current_bytes()
    launch = Launch.from_env()
    assert launch is not None
    policy = _policy(spec, launch, device)
    if policy is not None:
        rng = random.Random(0)
        rows: list[StepRow] = []
        clock = PhaseClock()
        plan = [SHORT, SHORT] + [n for n in spec.seq_lens for _ in range(spec.steps)]
        with instrumented(clock):
            for step, length in enumerate(plan):
                groups = [_group(rng, i, length, spec) for i in range(spec.groups)]
                policy.reset()
                row = StepRow(length, spec.groups * spec.samples * length,
                              memory.current_bytes())
                _step(policy, step, row, groups, clock)
                rows.append(row)
                print(f"{spec.mode} x{launch.world_size} {length} tokens: {row.step_s:.1f} s",
                      flush=True)
        Path(spec.out).write_text(json.dumps({"base": base,
                                              "steps": [asdict(r) for r in rows]}))
    if launch.world_size > 1:
        distributed.shutdown()
    else:
        dist.destroy_process_group()
