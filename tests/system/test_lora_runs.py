"""A LoRA run end to end: tiny-chat on the shipped word problems through REST, the torch engine,
real brokers, a KL term against the frozen base; then ``rlboost export`` of its final version.

Invariants 1-3 hold as for any run (every sample's reward recomputed here from its text). The
final version is the merged model: every weight outside the adapted projections is the base's
bit for bit, the adapted ones moved; its export is the adapter, which on the base gives the
merged model's logits. The same run again with its trainer and its spot instance SIGKILLed
mid-step (the LoRA run of the fault campaign) equals the first sample for sample. Every
version after the base (version 0, full) is adapter-only, at most 5 % of the base's bytes, and
the spot instance restarted mid-run pulls no full model: it holds the base already. A
``target_modules`` that matches nothing fails its run at setup, saying so, and the queue goes
on. (Whether LoRA runs learn is ``make bench-lora``: docs/algorithms.md.)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlboost.export import export
from rlboost.launcher import Cluster
from rlboost.stack import Stack
from shared.spec import LORA_TARGETS
from tests.support.cluster import start_cluster, wait_run
from tests.support.invariants import check_run, step_records
from tests.system.test_restart import child, kill_and_restart, wait_step
from trainer_svc.embedded.tiny_chat import tiny_chat_key
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids
from trainer_svc.inputs.data import DatasetSpec, load_prompts
from trainer_svc.inputs.rewards import math_reward

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "data" / "word-problems-train.jsonl")
SPEC: dict[str, Any] = {
    "model": "tiny-chat", "dataset": {"path": TRAIN}, "steps": 3, "prompts_per_step": 4,
    "samples_per_prompt": 4, "max_new_tokens": 16, "learning_rate": 2e-3, "seed": 0,
    "kl_coef": 0.05, "lora": {"rank": 4, "alpha": 8}}


def manifest(weights_url: str, run_id: str, version: int) -> dict[str, Any]:
    reply: dict[str, Any] = httpx.get(f"{weights_url}/v1/weights/{run_id}/{version}/manifest",
                                      timeout=10).json()
    return reply


def spot_metrics(client: httpx.Client) -> tuple[int, Counter[str]]:
    """The spot instance's metrics port, its weight pulls by kind and its adapter versions'
    bases by source."""
    inst = next(i for i in client.get("/v1/instances").json() if i["kind"] == "spot")
    text = httpx.get(f"http://127.0.0.1:{inst['metrics_port']}/metrics", timeout=5).text
    found: Counter[str] = Counter()
    for what, label, value in re.findall(
            r'^rlboost_rollout_(?:weight_)?(pulls|adapter_bases)_total(\{\w+="\w+"\}) (\S+)',
            text, re.M):
        found[what.replace("adapter_", "") + label] += int(float(value))
    return int(inst["metrics_port"]), found


def wait_restarted(client: httpx.Client, old_port: int, timeout_s: float = 300
                   ) -> Counter[str]:
    """The restarted spot instance's counters once it has loaded a version (it registers
    with a new metrics port; the old one's entry may outlive it for a while)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        with contextlib.suppress(StopIteration, httpx.HTTPError):
            port, found = spot_metrics(client)
            if port != old_port and any(k.startswith("pulls") and n > 0
                                        for k, n in found.items()):
                return found
        time.sleep(0.5)
    raise AssertionError("the restarted spot instance never loaded a version")


@pytest.fixture
def cluster(brokers: Stack, tmp_path: Path) -> Iterator[Cluster]:
    c = start_cluster(tmp_path, brokers, spot=1, reserved=1,
                      env={"RLBOOST_DATASET_ROOTS": str(ROOT / "examples")})
    try:
        yield c
    finally:
        c.stop()


def test_lora_run_trains_adapters_and_exports_them(cluster: Cluster, tmp_path: Path) -> None:
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as client:
        run_id = client.post("/v1/runs", json=SPEC).json()["id"]
        bad = client.post("/v1/runs", json={**SPEC, "lora": {"target_modules": ["nope_proj"]}})
        # The first includes building tiny-chat: about a minute of CPU, ten under heavy load.
        final = wait_run(client, run_id, timeout_s=1500, cluster=cluster)
        assert final["state"] == "succeeded", final
        failed = wait_run(client, bad.json()["id"], timeout_s=300, cluster=cluster)
        assert failed["state"] == "failed" and "lora.target_modules" in failed["error"], failed

        base_dir = tmp_path / "data" / "models" / f"tiny-chat-{tiny_chat_key(0)}"
        tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
        chat = ChatFormat(tokenizer)
        train = load_prompts(DatasetSpec(TRAIN), require_answer=True)
        def checked(run: str) -> dict[int, list[dict[str, Any]]]:
            return check_run(client, run, SPEC,
                             prompts=lambda step: [chat.render(e.prompt).prompt_token_ids
                                                   for e in train.draw(0, step, 4)],
                             eos_id=eos_token_ids(base_dir, tokenizer),
                             sample_reward=lambda s: math_reward(s["prompt"], s["response_text"],
                                                                 s["answer"]))
        clean = checked(run_id)
        records = step_records(client, run_id)
        assert all(r["grad_norm"] > 0 for r in records[1:]), records
        assert all("kl" in r for r in records)

        # The same run under faults: the trainer SIGKILLed mid-step (it resumes from the last
        # adapter checkpoint, optimizer state included), then the spot instance (its responses
        # migrate). Every sample equals the fault-free run's: adapters restored exactly, and
        # the merged versions the instances pull are the same bytes.
        faulted_id = client.post("/v1/runs", json=SPEC).json()["id"]
        wait_step(client, faulted_id, 1)
        trainer = child(cluster, "trainer")
        trainer.signal(signal.SIGKILL)
        assert trainer.proc is not None
        trainer.proc.wait(timeout=10)
        # The spot instance too, mid-step; the trainer stays down until it is back, so the run
        # cannot end before the restarted instance has loaded a version of it.
        port, before = spot_metrics(client)
        kill_and_restart(child(cluster, "spot-0"))
        after = wait_restarted(client, port)
        trainer.start()
        final = wait_run(client, faulted_id, timeout_s=600, cluster=cluster)
        assert final["state"] == "succeeded", final
        # Before the kill the spot instance had pulled adapter versions over a base it held;
        # restarted, it found the base on disk (verified by hash) and pulled adapters only.
        assert before['pulls{kind="adapter"}'] >= 1 and before['bases{source="disk"}'] >= 1, \
            before
        assert after['pulls{kind="full"}'] == 0 and after['bases{source="disk"}'] >= 1, after
        assert after['pulls{kind="adapter"}'] + after['pulls{kind="local"}'] >= 1, after
        faulted = checked(faulted_id)
        assert faulted.keys() == clean.keys()
        for step, samples in faulted.items():
            want = {(x["prompt_index"], x["sample_index"]): x["response_token_ids"]
                    for x in clean[step]}
            assert {(x["prompt_index"], x["sample_index"]): x["response_token_ids"]
                    for x in samples} == want, step

    weights = cluster.env["RLBOOST_WEIGHTS_URL"]
    # Every version after the base is its adapter alone: a few percent of the full model.
    sizes = {v: sum(f["size"] for f in manifest(weights, run_id, v)["files"])
             for v in range(SPEC["steps"] + 1)}
    assert "adapter" not in manifest(weights, run_id, 0)
    for v in range(1, SPEC["steps"] + 1):
        assert manifest(weights, run_id, v)["adapter"]["base"] == 0
        assert sizes[v] <= 0.05 * sizes[0], sizes
    merged = asyncio.run(export(weights, None, run_id, tmp_path / "merged", merged=True))
    assert merged.version == SPEC["steps"] and not merged.adapter
    base = load_file(base_dir / "model.safetensors")
    trained = load_file(merged.path / "model.safetensors")
    assert trained.keys() == base.keys()
    adapted = [k for k in base if k.rsplit(".", 2)[-2] in LORA_TARGETS and k.endswith("weight")]
    assert adapted
    for key, value in base.items():
        assert torch.equal(trained[key], value) is (key not in adapted), key

    adapter = asyncio.run(export(weights, None, run_id, tmp_path / "adapter"))
    assert adapter.adapter and "adapter_model.safetensors" in adapter.files
    ids = torch.tensor([chat.render("Tom has 3 apples and buys 4 more.").prompt_token_ids])
    on_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir),
                                        adapter.path)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(merged.path)(input_ids=ids).logits
        torch.testing.assert_close(on_base(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
