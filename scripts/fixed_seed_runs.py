"""Fixed-seed runs of this checkout, dumped for comparing two commits sample for sample.

    python scripts/fixed_seed_runs.py run OUT.json      (in each commit's checkout)
    python scripts/fixed_seed_runs.py compare A.json B.json

``run`` starts the embedded brokers and the services (a reserved and a spot instance) once per
engine, runs a small emu run and a small torch run (the tiny model) at seed 9 through REST, and
writes every step's samples (ids, versions, finish, reward) and each step's loss. ``compare``
says, per run, whether the two dumps are equal; exit 1 if any differs. What it shows: a change
that must leave synchronous runs bit for bit as they were (``staleness`` 0) did, on both
engines, losses included. (Run it with the repository root on ``PYTHONPATH``: it uses the
tests' cluster helpers.)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from rlboost.stack import Stack
from tests.support.cluster import start_cluster, wait_run

RUNS: dict[str, tuple[dict[str, Any], str]] = {
    "emu": ({"model": "emu", "steps": 3, "prompts_per_step": 4, "samples_per_prompt": 4,
             "max_new_tokens": 48, "seed": 9}, "emu"),
    "torch": ({"model": "tiny", "steps": 3, "prompts_per_step": 4, "samples_per_prompt": 4,
               "seed": 9}, "torch"),
}
KEPT = ("prompt_index", "sample_index", "weight_version", "prompt_token_ids",
        "response_token_ids", "finish_reason", "reward")


def run_one(root: Path, spec: dict[str, Any], engine: str) -> dict[str, Any]:
    stack = Stack.create(root / "brokers")
    stack.start()
    try:
        cluster = start_cluster(root, stack, spot=1, reserved=1, engine=engine)
        try:
            with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], timeout=10) as c:
                run_id = c.post("/v1/runs", json=spec).json()["id"]
                final = wait_run(c, run_id, 600, cluster)
                if final["state"] != "succeeded":
                    raise SystemExit(f"{engine} run did not succeed: {final}")
                steps = {n: sorted(({k: s[k] for k in KEPT} for s in c.get(
                    f"/v1/runs/{run_id}/steps/{n}/samples").json()),
                    key=lambda s: (s["prompt_index"], s["sample_index"]))
                    for n in range(spec["steps"])}
                losses = [r.get("loss") for r in c.get(f"/v1/runs/{run_id}/steps").json()]
                return {"samples": steps, "losses": losses}
        finally:
            cluster.stop()
    finally:
        stack.stop()


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "run":
        with tempfile.TemporaryDirectory() as tmp:
            out = {name: run_one(Path(tmp) / name, spec, engine)
                   for name, (spec, engine) in RUNS.items()}
        Path(argv[1]).write_text(json.dumps(out, sort_keys=True))
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:])
        differ = False
        for name in RUNS:
            same = a.get(name) == b.get(name)
            differ |= not same
            count = sum(len(s) for s in a.get(name, {}).get("samples", {}).values())
            print(f"{name}: {'equal' if same else 'DIFFERENT'} ({count} samples, losses "
                  f"{a.get(name, {}).get('losses')})")
        return int(differ)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
