"""2 sharded ranks = 1 rank, for every algorithm; what they publish loads and equals it.

One real ``torchrun --standalone --nproc-per-node 2`` job (gloo on this CPU) runs this file as
a script, for all algorithms in turn, so the job starts once: rank 0 drives a
:class:`DistributedPolicy` with FSDP2 sharding in float64 exactly as the service does (setup,
restore, reset, add_group, step, save) and rank 1 sits in ``worker_loop``. ``save`` writes the
version's HF directory from the shards (each rank its own safetensors files) and a DCP
checkpoint. The 1-rank reference is a plain :class:`TorchPolicy` in the test process.

Publishing (GRPO's version 1) goes to a real weight service: each rank uploads the files it
wrote, each through its own fault proxy, which rank 0 hosts. With rank 1's link cut the publish
fails and nothing is committed; healed, one commit publishes every rank's files, rank 1's
shards cross rank 1's link and rank 0's link carries less than the whole directory (rank 0
sending everything, or rank 1 nothing, fails one of the two).

Tolerance: float64, ``atol = 1e-10`` on every tensor, as for the replicated trainer. The only
legitimate differences are the order of float64 additions (each rank's groups are summed into
its gradient, the reduce-scatter adds the ranks' sums) and a sharded clip-norm summed per shard
before the square root: ~1e-16 relative, which Adam's smooth update keeps far below 1e-10
after one step with lr 1e-2 (a wrong owner, a lost group or a doubled reduction moves weights
by ~1e-3). Zero padding passes add exact zeros.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from rollout_svc.engines.torch_engine import TorchEngine
from shared.algorithm import Algorithm, AlgorithmConfig
from shared.errors import WeightsError
from shared.weights import model_files, published
from tests.integration.test_weight_svc import ServiceProcess
from tests.support.faultproxy import Hub, Link
from tests.support.torchrun import run_job
from trainer_svc.embedded import task
from trainer_svc.embedded.tiny import tiny_config
from trainer_svc.learn.policies import EmuPolicy, PublishesItself, TorchPolicy, distributed
from trainer_svc.learn.policies.distributed import DistributedPolicy, Launch
from trainer_svc.learn.policies.fsdp import ShardedPolicy, ShardingConfig
from trainer_svc.learn.policies.publish import WeightsAccess
from trainer_svc.learn.sharded_checkpoint import INDEX
from trainer_svc.learn.step_trainer import Group, RunShape

LR = 1e-2
ATOL = 1e-10
SHAPE = RunShape(max_new_tokens=8, temperature=1.0, groups_per_step=5)
EXACT = ShardingConfig(param_dtype=None, reduce_dtype=None)  # float64 throughout
# Knobs that reach every path of the step: a KL term against the sharded reference and an
# entropy bonus where the algorithm allows them, two passes of two mini-batches for DAPO.
EXTRA: dict[str, dict[str, Any]] = {
    "reinforce_pp_baseline": {"kl_coef": 0.05, "entropy_coef": 0.01},
    "dapo": {"updates_per_step": 2, "minibatches": 2},
    "grpo": {"kl_coef": 0.05},
}
ALGORITHMS = [a.value for a in Algorithm]
TOKEN = "trainer-token"
RUN_ID = "fsdp-grpo"


def _algorithm(name: str) -> AlgorithmConfig:
    return AlgorithmConfig.for_run({"algorithm": name, **EXTRA.get(name, {})},
                                   max_new_tokens=SHAPE.max_new_tokens,
                                   groups_per_step=SHAPE.groups_per_step)


def _groups() -> list[Group]:
    """Five groups over two ranks: uneven shares (3 and 2), one without signal."""
    rng = random.Random(5)
    out = []
    for index in range(5):
        prompt = task.make_prompt(rng.randrange(10), rng.randint(1, 3))
        responses = [[rng.choice(task.DIGIT_IDS) for _ in range(rng.randint(1, 7))]
                     + [task.EOS_ID] for _ in range(4)]
        rewards = [0.5] * 4 if index == 2 else [0.0, 1.0, *(task.reward(prompt, r)
                                                              for r in responses[2:])]
        out.append(Group(prompt_index=index, prompts=[prompt] * 4, responses=responses,
                         rewards=rewards, truncated=[False] * 4))
    return out


def _model_dir(root: Path, tied: bool = True) -> Path:
    """The tiny model (tied embeddings, as small models have), or with its own output matrix:
    then the embeddings are FSDP units of their own (trainer_svc.learn.policies.fsdp.shard)."""
    out = root / ("model" if tied else "model-untied")
    if not out.is_dir():
        torch.manual_seed(0)
        config = tiny_config()
        config.tie_word_embeddings = tied
        Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


def _train_once(policy: DistributedPolicy) -> dict[str, Any]:
    assert policy.restore() == 0
    policy.reset()
    for group in _groups():
        policy.add_group(group)
    stats = policy.step(0)
    policy.save(1)
    return stats


def _local_optimizer_state(policy: ShardedPolicy) -> list[torch.Tensor]:
    out = []
    for state in policy.optimizer.state.values():
        for value in state.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            out.append(local.detach().clone())
    return out


def _publish_through_a_cut(policy: DistributedPolicy, access: WeightsAccess,
                           links: list[Link], out: Path) -> None:
    """Rank 0: publish v1 with rank 1's link cut (must fail, commit nothing), then healed."""
    files = model_files(policy.checkpoints.hf_dir(1))
    link = links[1]
    link.cut()
    try:
        asyncio.run(policy.publish(access, RUN_ID, 1))
    except WeightsError as exc:
        failed = str(exc)
    else:
        raise AssertionError("published with rank 1's link to the weight service cut")
    assert asyncio.run(published(access.url, access.token, RUN_ID, 1, files)) is None
    link.heal()
    before = links[0].stats.bytes_forwarded
    asyncio.run(policy.publish(access, RUN_ID, 1))
    manifest = asyncio.run(published(access.url, access.token, RUN_ID, 1, files))  # same bytes
    rank1 = sum(p.stat().st_size for p in files if "-r00001-" in p.name)
    out.write_text(json.dumps({
        "failed": failed, "manifest": manifest, "rank1_bytes": rank1, "link_bytes":
        link.stats.bytes_forwarded, "rank0_bytes": links[0].stats.bytes_forwarded - before,
        "total_bytes": sum(p.stat().st_size for p in files)}))


def _link_url(url: str, rank: int) -> str:
    """Rank ``rank``'s proxy: a fresh Hub's links are 127.77.0.1, .2, ... in order."""
    return url.replace("127.0.0.1", f"127.77.0.{rank + 1}")


def _rank_main(root: Path, url: str) -> None:
    torch.set_num_threads(1)
    launch = Launch.from_env()
    assert launch is not None and launch.world_size == 2
    links: list[Link] = []
    if launch.rank == 0:  # each rank reaches the weight service through its own proxy only
        hub = Hub()
        links = [hub.link(f"rank{r}-weights", [int(url.rsplit(":", 1)[1])]) for r in (0, 1)]
        assert [link.url(url) for link in links] == [_link_url(url, r) for r in (0, 1)]
    access = WeightsAccess(_link_url(url, launch.rank), TOKEN)
    distributed.init(launch, weights=access)
    try:
        if launch.rank != 0:
            distributed.worker_loop()
            return
        model_dir = _model_dir(root)
        for name in ALGORITHMS:
            policy = DistributedPolicy.setup(model_dir, root / name, LR, 0, dtype=torch.float64,
                                             algorithm=_algorithm(name), shape=SHAPE,
                                             sharding=EXACT)
            stats = _train_once(policy)
            (root / name / "stats.json").write_text(json.dumps(stats))
            if name == "grpo":
                _publish_through_a_cut(policy, access, links, root / "publish.json")
        untied = DistributedPolicy.setup(_model_dir(root, tied=False), root / "untied", LR, 0,
                                         dtype=torch.float64, algorithm=_algorithm("grpo"),
                                         shape=SHAPE, sharding=EXACT)
        assert isinstance(untied.local, ShardedPolicy)
        model = untied.local.model
        # Untied, each embedding is an FSDP unit of its own; tied, the root holds the one matrix.
        assert isinstance(model.get_input_embeddings(), FSDPModule)  # type: ignore[operator]
        assert isinstance(model.get_output_embeddings(), FSDPModule)  # type: ignore[operator]
        assert isinstance(policy.local, ShardedPolicy)
        assert not isinstance(policy.local.model.get_output_embeddings(),  # type: ignore[operator]
                              FSDPModule)
        (root / "untied" / "stats.json").write_text(json.dumps(_train_once(untied)))
        # Resume: a fresh sharded policy restores version 1, optimizer state bit for bit.
        assert isinstance(policy.local, ShardedPolicy)
        saved = _local_optimizer_state(policy.local)
        again = DistributedPolicy.setup(model_dir, root / ALGORITHMS[-1], LR, 0,
                                        dtype=torch.float64, algorithm=_algorithm(ALGORITHMS[-1]),
                                        shape=SHAPE, sharding=EXACT)
        assert again.restore() == 1
        assert isinstance(again.local, ShardedPolicy)
        restored = _local_optimizer_state(again.local)
        assert saved and len(restored) == len(saved)
        assert all(torch.equal(a, b) for a, b in zip(saved, restored, strict=True))
        (root / "resumed").write_text(str(len(saved)))
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def sharded_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, float]]:
    root = tmp_path_factory.mktemp("fsdp")
    _model_dir(root)
    service = ServiceProcess(tmp_path_factory.mktemp("weights"), token=TOKEN)
    service.start()
    started = time.monotonic()
    try:
        proc = run_job(__file__, str(root), service.url)
    finally:
        service.stop()
    # Every rank must leave cleanly too: an abort at exit fails the job (and this test).
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    yield root, time.monotonic() - started


@pytest.mark.parametrize("name", [*ALGORITHMS, "untied"])
def test_two_sharded_ranks_equal_one_rank(sharded_job: tuple[Path, float], name: str) -> None:
    """Every algorithm on the tied model; GRPO on the untied one ("untied")."""
    root, job_s = sharded_job
    model_dir = _model_dir(root, tied=name != "untied")
    algorithm = _algorithm("grpo" if name == "untied" else name)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: a CPU matmul's summation order may depend on it
    try:
        ref = TorchPolicy(model_dir, root / f"ref-{name}", LR, 0, dtype=torch.float64,
                          algorithm=algorithm, shape=SHAPE)
        assert ref.restore() == 0
        ref.reset()
        for group in _groups():
            ref.add_group(group)
        want_stats = ref.step(0)
    finally:
        torch.set_num_threads(before)
    # Tied, lm_head.weight is the embedding under a second name: HF saves it once.
    want = {k: v for k, v in ref.model.state_dict().items()
            if k != "lm_head.weight" or name == "untied"}
    published = root / name / "hf-1"
    index = json.loads((published / INDEX).read_text())
    files = set(index["weight_map"].values())
    assert any("-r00000-" in f for f in files) and any("-r00001-" in f for f in files)
    got: dict[str, torch.Tensor] = {}
    for f in files:
        got.update(load_file(str(published / f)))
    assert set(got) == set(want)
    init = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float64).state_dict()
    worst = moved = 0.0
    for key, tensor in want.items():
        assert got[key].dtype == torch.float64
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=ATOL, msg=key)
        worst = max(worst, float((got[key] - tensor).abs().max()))
        moved = max(moved, float((tensor - init[key]).abs().max()))
    assert moved > 1e-4  # the step moved the weights, so equality is not vacuous
    print(f"{name}: 2 FSDP2 ranks vs 1 rank: max |param diff| {worst:.3e} "
          f"(moved {moved:.2e}); whole 2-rank job {job_s:.1f} s")

    stats = json.loads((root / name / "stats.json").read_text())
    assert (stats["tokens"], stats["samples"], stats["groups"]) == (
        want_stats["tokens"], want_stats["samples"], want_stats["groups"])
    assert stats["loss"] == pytest.approx(want_stats["loss"], rel=1e-9, abs=1e-12)
    assert stats["grad_norm"] == pytest.approx(want_stats["grad_norm"], rel=1e-9)
    assert stats["optimizer_steps"] == want_stats["optimizer_steps"]
    # The step record's cost fields: the worst rank's resident peak holds at least the model.
    assert stats["peak_memory_bytes"] > sum(t.numel() * 8 for t in want.values())
    assert stats["tokens_per_s_train"] > 0


def test_published_version_loads_in_transformers_and_the_torch_engine(
        sharded_job: tuple[Path, float]) -> None:
    root, _ = sharded_job
    published = root / "grpo" / "hf-1"
    expected = {k: v for k, v in load_file(str(next(published.glob("*-r00000-*")))).items()}
    model = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float64)
    params = dict(model.named_parameters())
    assert expected and all(torch.equal(params[k], v) for k, v in expected.items())
    assert (published / "tokenizer.json").is_file() == (root / "model" / "tokenizer.json").is_file()
    engine = TorchEngine(dtype=torch.float64)
    engine.load(published, "run", 1)
    assert engine.loaded == ("run", 1)
    live = dict(engine._model.named_parameters())
    assert all(torch.equal(live[k], v) for k, v in expected.items())


def test_each_rank_uploads_its_own_shards_and_one_commit_publishes(
        sharded_job: tuple[Path, float]) -> None:
    root, _ = sharded_job
    record = json.loads((root / "publish.json").read_text())
    assert "a rank could not upload its shards; nothing was committed" in record["failed"]
    names = {f["name"] for f in record["manifest"]["files"]}
    # Every file of the directory both ranks wrote, and (published() checked) the same bytes.
    assert names == {p.name for p in model_files(root / "grpo" / "hf-1")}
    assert any("-r00000-" in n for n in names) and any("-r00001-" in n for n in names)
    assert record["link_bytes"] >= record["rank1_bytes"] > 0
    assert record["rank0_bytes"] < record["total_bytes"] - record["rank1_bytes"] // 2


def test_the_service_hands_publishing_to_a_multi_rank_policy_only() -> None:
    # The service uploads hf_dir itself unless the policy PublishesItself: a single-process
    # policy must not claim it, the multi-rank one must.
    assert issubclass(DistributedPolicy, PublishesItself)
    assert not issubclass(TorchPolicy, PublishesItself)
    assert not issubclass(EmuPolicy, PublishesItself)


def test_optimizer_state_resumes_exactly(sharded_job: tuple[Path, float]) -> None:
    root, _ = sharded_job
    # Written by rank 0 only after every local optimizer tensor compared equal bitwise.
    assert int((root / "resumed").read_text()) > 0


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]), sys.argv[2])
