"""2 ranks = 1 rank: the distributed trainer takes the same optimizer steps as one process.

The 2-rank side is real: ``torchrun --standalone --nproc-per-node 2`` runs this file as a
script; rank 0 drives a :class:`DistributedPolicy` exactly as the service does (setup, restore,
reset, add_group, step, save, restore again) and rank 1 sits in ``worker_loop``. The 1-rank
reference is a plain :class:`TorchPolicy` in the test process on the same groups.

Tolerance: float64 model, ``atol = 1e-10`` on every parameter. The only legitimate difference
is the order of float64 additions (rank 0 sums groups 0, 2, 4, rank 1 groups 1, 3 and the
all-reduce adds the two partial sums); Adam's update is smooth in the gradient, so that
~1e-16 relative difference stays far below the bound. Rank 1 must equal rank 0 bitwise: both
run the same step on the same reduced numbers.

Parametrised over every algorithm. Three exercise each path of the step over the whole
four-step scenario (a restart included): GRPO streaming every group; REINFORCE++ with baseline
(batch-normalised advantages streamed as two gradient sums, a KL term against the frozen
reference, an entropy bonus) over two passes; DAPO (overlong shaping, clip-higher, dynamic
sampling's deferred mini-batches) over two passes of two mini-batches. The other four (Dr.
GRPO's constant normaliser, RLOO's leave-one-out baseline, REINFORCE++'s batch whitening
without baseline, GSPO's sequence ratio over its default four mini-batches) differ from those
only in their estimator or loss, so one step of five groups on uneven rank shares each keeps
the test's cost down.

LoRA (``+lora``) runs the four-step scenario on adapters over the frozen base: replicated, and
sharded by FSDP2 (``+fsdp2``, float64 throughout), GRPO alone and REINFORCE++ with baseline
(its KL reference is the sharded base with the adapters off). No sharded rank holds the model,
so those compare what the job publishes after the scenario (the merged model and the adapter's
files, same tolerance) and check that the merge is bit for bit the unsharded code's on the
published adapter and that the checkpoint holds the adapter and its AdamW state alone. The
restart in the scenario is the checkpoint's round trip: a lost adapter or AdamW moment after it
moves the weights by ~1e-3.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.filesystem import FileSystemReader
from transformers import Qwen2ForCausalLM

from shared.algorithm import AlgorithmConfig
from shared.spec import LoraSpec, RunSpec
from shared.weights.manifest import ADAPTER_SUFFIX
from tests.support.torchrun import run_job
from trainer_svc.embedded import task
from trainer_svc.embedded.tiny import tiny_config
from trainer_svc.errors import RunSpecError
from trainer_svc.learn.policies import Policy, TorchPolicy, distributed, make_policy
from trainer_svc.learn.policies.distributed import DistributedPolicy, Launch
from trainer_svc.learn.policies.fsdp import ShardingConfig
from trainer_svc.learn.sharded_checkpoint import INDEX, file_rank
from trainer_svc.learn.step_trainer import Group, RunShape

LR = 1e-2
ATOL = 1e-10

SHAPE = RunShape(max_new_tokens=8, temperature=1.0, groups_per_step=5)
CASES: dict[str, dict[str, Any]] = {
    "grpo": {},
    "reinforce_pp_baseline": {"kl_coef": 0.05, "entropy_coef": 0.01, "updates_per_step": 2},
    # Dynamic sampling (opt-in, as the preset now says): steps of fewer groups than
    # groups_per_step, whose mini-batches are known only at the barrier.
    "dapo": {"updates_per_step": 2, "minibatches": 2, "dynamic_sampling": True},
    "dr_grpo": {},
    "rloo": {},
    "reinforce_pp": {},
    "gspo": {},
}
FULL = ("grpo", "reinforce_pp_baseline", "dapo")  # the four-step scenario; the rest one step
# A case "<algorithm>+lora" trains LoRA adapters on the frozen base instead of every weight;
# "+fsdp2" shards the ranks' model (base and adapters) with FSDP2 instead of replicating it.
# With a KL term (reinforce_pp_baseline) the sharded reference is the base, adapters off.
LORA_CASES = ("grpo+lora", "grpo+lora+fsdp2", "reinforce_pp_baseline+lora+fsdp2")
LORA = LoraSpec(rank=4, alpha=8.0)
EXACT = ShardingConfig(param_dtype=None, reduce_dtype=None)  # FSDP2 in float64 throughout
FINAL = 4  # a sharded case's last version: saved (merged model, adapter) after the scenario


def _base(case: str) -> str:
    return case.split("+")[0]


def _lora(case: str) -> LoraSpec | None:
    return LORA if "+lora" in case else None


def _sharding(case: str) -> ShardingConfig | None:
    return EXACT if "+fsdp2" in case else None


def _algorithm(case: str) -> AlgorithmConfig:
    case = _base(case)
    return AlgorithmConfig.for_run({"algorithm": case, **CASES[case]},
                                   max_new_tokens=SHAPE.max_new_tokens,
                                   groups_per_step=SHAPE.groups_per_step)


def _group(rng: random.Random, size: int, index: int, no_signal: bool = False) -> Group:
    prompt = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
    responses = [
        [rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, 7))] + [task.EOS_ID]
        for _ in range(size)
    ]
    rewards = [task.reward(prompt, r) for r in responses]
    if no_signal:
        rewards = [0.5] * size  # zero advantages: tokens count, no gradient
    else:
        rewards[0], rewards[1] = 0.0, 1.0  # never all equal
    return Group(prompt_index=index, prompts=[prompt] * size, responses=responses,
                 rewards=rewards, truncated=[False] * size)


def _steps(case: str) -> list[list[Group]]:
    rng = random.Random(5)
    steps = [
        # Five groups over two ranks: uneven shares (3 and 2), one without signal.
        [_group(rng, 4, 0), _group(rng, 4, 1), _group(rng, 4, 2, no_signal=True),
         _group(rng, 4, 3), _group(rng, 4, 4)],
        # One group, the sixth of the run: owned by rank 1, so rank 0 has no gradient at all.
        [_group(rng, 4, 0)],
        # After a save and a restore into a fresh policy.
        [_group(rng, 4, 0), _group(rng, 4, 1), _group(rng, 4, 2)],
        # No signal anywhere: no rank has a gradient, so no optimizer step may be taken
        # (AdamW's momentum would move the weights on a zero gradient).
        [_group(rng, 4, 0, no_signal=True)],
    ]
    return steps if _base(case) in FULL else steps[:1]


def _model_dir(root: Path) -> Path:
    out = root / "model"
    if not out.is_dir():
        torch.manual_seed(0)
        Qwen2ForCausalLM(tiny_config()).save_pretrained(out, safe_serialization=True)
    return out


def _scenario(make: Callable[[], Policy], case: str) -> tuple[Policy, list[dict[str, Any]]]:
    """What the service does to a policy over four steps, with a restart before the third."""
    steps = _steps(case)
    stats: list[dict[str, Any]] = []
    policy = make()
    assert policy.restore() == 0
    for index in range(len(steps)):
        if index == 2:
            policy.save(2)
            policy = make()
            assert policy.restore() == 2
        policy.reset()
        for group in steps[index]:
            policy.add_group(group)
        stats.append(policy.step(index))
    return policy, stats


def _model_of(policy: Policy) -> torch.nn.Module:
    if isinstance(policy, DistributedPolicy):
        return policy.local.model
    assert isinstance(policy, TorchPolicy)
    return policy.model


def _rank_main(root: Path, case: str) -> None:
    """One torchrun rank (this file run as a script)."""
    torch.set_num_threads(1)
    launch = Launch.from_env()
    assert launch is not None and launch.world_size == 2
    distributed.init(launch)
    model_dir = _model_dir(root)
    try:
        if launch.rank == 0:
            spec = RunSpec(model=str(model_dir), learning_rate=LR, seed=0)
            # What the service gets from make_policy in a multi-rank job (float32, not used on).
            picked = make_policy(spec, root, root / "run-picked", 0.0)
            assert isinstance(picked, DistributedPolicy)
            if _lora(case) is not None:
                # Target modules that match nothing fail the run at setup, on every rank alike:
                # the job stays usable for the next run.
                with pytest.raises(RunSpecError, match=r"lora\.target_modules"):
                    DistributedPolicy.setup(model_dir, root / "run-x", LR, 0,
                                            sharding=_sharding(case),
                                            lora=LoraSpec(target_modules=["no_such_proj"]))
            policy, stats = _scenario(lambda: DistributedPolicy.setup(
                model_dir, root / "run-2", LR, 0, dtype=torch.float64,
                algorithm=_algorithm(case), shape=SHAPE, lora=_lora(case),
                sharding=_sharding(case)), case)
            if _sharding(case) is not None:
                policy.save(FINAL)  # no rank holds the model: compared as it is published
            model = _model_of(policy)
            (root / "stats.json").write_text(json.dumps(stats))
        else:
            worker = distributed.worker_loop()
            assert worker is not None
            model = worker.model
    finally:
        distributed.shutdown()  # rank 0: sends Stop, which ends rank 1's worker_loop
    # None of the module's threads may outlive leaving: one that ends during interpreter
    # finalization can free the command group there and abort the process.
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dist-")]
    if _sharding(case) is None:
        torch.save(model.state_dict(), root / f"rank{launch.rank}.pt")


def _compare_ranks(root: Path, ref: Policy, init: dict[str, torch.Tensor],
                   case: str) -> tuple[float, float]:
    """Replicated: each rank's parameters against the plain policy's (worst diff, moved)."""
    rank0 = torch.load(root / "rank0.pt", weights_only=True)
    rank1 = torch.load(root / "rank1.pt", weights_only=True)
    worst = moved = 0.0
    for name, want in _model_of(ref).state_dict().items():
        assert rank0[name].dtype == torch.float64
        torch.testing.assert_close(rank0[name], want, rtol=0, atol=ATOL, msg=name)
        torch.testing.assert_close(rank1[name], rank0[name], rtol=0, atol=0, msg=name)
        worst = max(worst, float((rank0[name] - want).abs().max()))
        if _lora(case) is None:
            moved = max(moved, float((want - init[name]).abs().max()))
        elif "lora_B" in name:  # PEFT starts B at zero
            moved = max(moved, float(want.abs().max()))
        elif ".lora_" not in name:  # the frozen base, bit for bit
            base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(want, init[base]), name
    return worst, moved


def _published(hf_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """A LoRA version's merged weights, its adapter's tensors and its adapter config."""
    weights: dict[str, torch.Tensor] = {}
    for path in hf_dir.glob("*.safetensors"):
        weights.update(load_file(str(path)))
    adapter = load_file(str(hf_dir / ("adapter_model.safetensors" + ADAPTER_SUFFIX)))
    config = json.loads((hf_dir / ("adapter_config.json" + ADAPTER_SUFFIX)).read_text())
    # PEFT keeps target_modules as a set and writes it in the process's string-hash order.
    config["target_modules"] = sorted(config["target_modules"])
    return weights, adapter, config


def _compare_published(root: Path, ref: TorchPolicy, init: dict[str, torch.Tensor],
                       model_dir: Path) -> tuple[float, float]:
    """FSDP2 + LoRA: the sharded job's last version against what the plain policy publishes.

    The merged model and the adapter within ATOL of the plain policy's; the base's tensors
    that no adapter touches bit for bit the model directory's; the merged weights bit for bit
    what the unsharded merge makes of the sharded job's own adapter; and the checkpoint holds
    the adapter and its AdamW state, no base weight (worst diff, moved)."""
    from trainer_svc.learn import lora  # PEFT: seconds to import, only these cases need it

    ref.save(FINAL)
    want, want_adapter, want_config = _published(ref.checkpoints.hf_dir(FINAL))
    hf_dir = root / "run-2" / f"hf-{FINAL}"
    got, adapter, config = _published(hf_dir)
    index = json.loads((hf_dir / INDEX).read_text())
    assert set(index["weight_map"]) == set(got) == set(want)
    assert {file_rank(f) for f in index["weight_map"].values()} == {0, 1}  # both ranks wrote
    assert config == want_config and set(adapter) == set(want_adapter)
    worst = 0.0
    for tensors, wanted in ((got, want), (adapter, want_adapter)):
        for name, tensor in wanted.items():
            assert tensors[name].dtype == torch.float64
            torch.testing.assert_close(tensors[name], tensor, rtol=0, atol=ATOL, msg=name)
            worst = max(worst, float((tensors[name] - tensor).abs().max()))
    adapted = [n for n in got if any(f".{m}.weight" in n for m in LORA.target_modules)]
    assert adapted
    for name in set(got) - set(adapted):
        assert torch.equal(got[name], init[name]), name
    plain = lora.wrap(Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float64), LORA)
    lora.load_adapter_state(plain, adapter)
    merged = lora.merged_state_dict(plain)
    for name in got:
        assert torch.equal(got[name], merged[name]), name
    saved = FileSystemReader(str(root / "run-2" / f"v{FINAL}.dcp")).read_metadata()
    keys = list(saved.state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.")]
    moments = [k for k in keys if k.startswith("optimizer.state.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:3]
    assert moments and all(".lora_" in k for k in moments), moments[:3]
    adapter_bytes = (hf_dir / ("adapter_model.safetensors" + ADAPTER_SUFFIX)).stat().st_size
    print(f"adapter {adapter_bytes} B beside {sum(t.nbytes for t in got.values())} B merged; "
          f"checkpoint: {len(model_keys)} adapter tensors, {len(moments)} AdamW moments")
    return worst, max(float(t.abs().max()) for n, t in adapter.items() if "lora_B" in n)


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Same thread count as the ranks: a CPU matmul's summation order may depend on it.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("case", [*CASES, *LORA_CASES])
def test_two_ranks_equal_one_rank(tmp_path: Path, one_thread: None, case: str) -> None:
    model_dir = _model_dir(tmp_path)
    started = time.monotonic()
    proc = run_job(__file__, str(tmp_path), case, timeout_s=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two_s = time.monotonic() - started

    ref, ref_stats = _scenario(lambda: TorchPolicy(
        model_dir, tmp_path / "run-1", LR, 0, dtype=torch.float64,
        algorithm=_algorithm(case), shape=SHAPE, lora=_lora(case)), case)
    init = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float64).state_dict()
    if _sharding(case) is None:
        worst, moved = _compare_ranks(tmp_path, ref, init, case)
    else:
        assert isinstance(ref, TorchPolicy)
        worst, moved = _compare_published(tmp_path, ref, init, model_dir)
    assert moved > 1e-4  # the steps moved the weights, so equality is not vacuous
    print(f"{case}: 2 ranks vs 1 rank: max |param diff| {worst:.3e}, 2-rank job {two_s:.1f} s")

    stats = json.loads((tmp_path / "stats.json").read_text())
    for got, want in zip(stats, ref_stats, strict=True):
        assert (got["tokens"], got["samples"], got["groups"]) == (
            want["tokens"], want["samples"], want["groups"])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-9, abs=1e-12)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-9)
        for name in ("clip_fraction", "kl", "entropy", "streamed_fraction"):
            assert (name in got) is (name in want), name
            if name in want:
                assert got[name] == pytest.approx(want[name], rel=1e-9), name
    assert stats[0]["groups"] == 5 and stats[0]["grad_norm"] > 0
    if _base(case) not in FULL:
        return
    # The one-group step really ran on rank 1 alone and still moved the shared weights.
    assert stats[1]["groups"] == 1 and stats[1]["grad_norm"] > 0
    # A KL term, or DAPO's length shaping, has a gradient without signal.
    if _base(case) == "grpo":
        assert stats[3]["grad_norm"] == 0.0
    if _algorithm(case).updates_per_step > 1:
        # The second pass clips: at once when every weight trains; adapters start at zero
        # (B = 0) and their first step moves the ratio less, so a step later.
        assert stats[0 if _lora(case) is None else 1]["clip_fraction"] > 0


def test_world_of_one_is_the_plain_torch_policy(tmp_path: Path) -> None:
    assert Launch.from_env({}) is None
    assert Launch.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == Launch(1, 2, 1)
    assert distributed.channel() is None
    spec = RunSpec(model=str(_model_dir(tmp_path)), learning_rate=LR, seed=0)
    policy = make_policy(spec, tmp_path, tmp_path / "run", 0.0)
    assert type(policy) is TorchPolicy
    with pytest.raises(distributed.DistributedError):
        DistributedPolicy.setup(_model_dir(tmp_path), tmp_path / "run", LR, 0)
    with pytest.raises(distributed.DistributedError):
        distributed.worker_loop()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), sys.argv[2])
