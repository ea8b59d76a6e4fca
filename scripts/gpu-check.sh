#!/usr/bin/env bash
# gpu-check: the sharded trainer (FSDP2) on nccl, then the whole system end to end with the
# SGLang engine on a real GPU and a real model.
#
#   make gpu-check MODEL=/path/to/small-hf-model      (or: scripts/gpu-check.sh /path/to/model)
#
# Needs: an NVIDIA GPU, SGLang importable by the venv's python (pip install sglang), and a small
# HF causal LM directory (e.g. Qwen2.5-0.5B-Instruct downloaded beforehand). It starts the
# embedded brokers, the manager, the weight service, the trainer and one spot rollout instance
# with RLBOOST_ENGINE=sglang (which launches `python -m sglang.launch_server` on loopback), runs
# 2 GRPO steps through REST, and checks: the run succeeded, every step has all its responses,
# every sample was generated with its step's weight version, and the instance reports the
# sglang engine. Exit 0 = pass, 1 = fail, 2 = this machine cannot run the check.
set -euo pipefail

MODEL="${1:-${MODEL:-}}"
PY="${PYTHON:-.venv/bin/python}"
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here; nothing checked" >&2
    exit 2
fi

# The sharded trainer on nccl first (needs no model and no SGLang): FSDP2 on min(GPUs, 2)
# ranks, one GPU each (nccl refuses two ranks on one device), vs the replicated trainer on one
# GPU: step time and torch's peak allocated memory per rank, printed for the FSDP2 figures of
# docs/preemption-seeding-scale.md.
GPUS=$(nvidia-smi -L | wc -l)
RANKS=$(( GPUS >= 2 ? 2 : 1 ))
echo "gpu-check: FSDP2 with nccl on $RANKS rank(s)"
"$PY" -m benchmarks.trainer --layers "${FSDP_LAYERS:-16}" --hidden "${FSDP_HIDDEN:-1024}" \
    --steps 3 --jobs "plain:1,fsdp2:$RANKS"

if [[ -z "$MODEL" || ! -f "$MODEL/config.json" ]]; then
    echo "usage: $0 /path/to/hf-model-dir (a directory with config.json)" >&2
    exit 2
fi
if ! "$PY" -c "import sglang" 2>/dev/null; then
    echo "gpu-check: $PY cannot import sglang (pip install sglang); nothing checked" >&2
    exit 2
fi

ROOT="${GPU_CHECK_ROOT:-.rlboost/gpu-check}"
rm -rf "$ROOT"
exec "$PY" - "$MODEL" "$ROOT" <<'PYEOF'
import sys
import time
from pathlib import Path

import httpx

from rlboost.launcher import Cluster

model, root = str(Path(sys.argv[1]).resolve()), Path(sys.argv[2])
spec = {"model": model, "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
        "max_new_tokens": 16, "seed": 0}
cluster = Cluster(root, spot=1, reserved=0, engine="sglang",
                  extra_env={"RLBOOST_ENGINE": "sglang", "RLBOOST_GRACE_S": "10"})
failures = []
try:
    cluster.start()
    with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=30) as client:
        run = client.post("/v1/runs", json=spec).json()
        print(f"run {run['id']} submitted: {spec}", flush=True)
        end = time.monotonic() + 1800  # the first SGLang start loads the model and CUDA graphs
        while time.monotonic() < end:
            state = client.get(f"/v1/runs/{run['id']}").json()
            if state["state"] in ("succeeded", "failed", "cancelled"):
                break
            dead = [c.name for c in cluster.dead()]
            if dead:
                failures.append(f"processes died: {dead}")
                break
            time.sleep(2)
        print(f"run state: {state}", flush=True)
        if state["state"] != "succeeded":
            failures.append(f"run ended {state['state']}")
        for record in client.get(f"/v1/runs/{run['id']}/steps").json():
            n = record["step"]
            samples = client.get(f"/v1/runs/{run['id']}/steps/{n}/samples").json()
            print(f"step {n}: {len(samples)} responses, {record['tokens']} tokens, "
                  f"reward {record['reward_mean']:.3f}, rollout {record['rollout_s']:.1f}s")
            if len(samples) != spec["prompts_per_step"] * spec["samples_per_prompt"]:
                failures.append(f"step {n}: {len(samples)} responses")
            if {s["weight_version"] for s in samples} != {n}:
                failures.append(f"step {n}: off-policy samples")
        engines = {i["engine"] for i in client.get("/v1/instances").json()}
        if engines != {"sglang"}:
            failures.append(f"instances report engines {engines}")
finally:
    cluster.stop()
if failures:
    print("gpu-check FAILED:", *failures, sep="\n  ")
    for child in cluster.children:
        print(f"--- {child.name}\n{child.tail(30)}")
    sys.exit(1)
print("gpu-check passed")
PYEOF
