"""The ``rlboost`` command: every service as a subcommand, plus ``up`` (the embedded stack)
and the commands that talk to a running manager (RLBOOST_MANAGER_URL, RLBOOST_API_TOKEN).

    rlboost up [--seed N] [--steps N] [--spot 2] [--reserved 1]   start all, run, summarise, stop
    rlboost manager | weights | trainer | rollout                 one service (same as python -m)
    rlboost submit [--spec FILE.yaml|.json] [--FIELD VALUE ...]   POST /v1/runs (every run-spec
                                                                  field is a flag: --help)
    rlboost runs                                                  the runs, one line each
    rlboost status [RUN_ID]                                       GET /v1/runs[/RUN_ID] as JSON
    rlboost watch RUN_ID                                          follow a run live until it ends
    rlboost cancel RUN_ID                                         POST /v1/runs/RUN_ID/cancel
    rlboost resume RUN_ID                                         POST /v1/runs/RUN_ID/resume
    rlboost export RUN_ID DIR [--version N] [--merged]            a run's weights as an HF model
                                                                  directory, from the weight
                                                                  service (RLBOOST_WEIGHTS_URL,
                                                                  RLBOOST_WEIGHTS_READ_TOKEN);
                                                                  of a LoRA run its adapter, or
                                                                  with --merged the merged model
    rlboost certs DIR [--host NAME ...] [--force]                 a CA and TLS certificates for
                                                                  NATS, the manager, the weight
                                                                  service and rollout peers
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rlboost.certs import CertsError, make_certs
from rlboost.export import ExportError, run_export
from rlboost.launcher import Cluster
from rlboost.spec_flags import add_spec_flags, spec_body
from rlboost.watch import watch
from shared.process import exit_on_sigterm
from shared.settings import mask_url
from shared.tls import Tls


def _headers() -> dict[str, str]:
    token = os.environ.get("RLBOOST_API_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def _manager_url() -> str:
    return os.environ.get("RLBOOST_MANAGER_URL", "http://127.0.0.1:8000")


def _verify() -> ssl.SSLContext | bool:
    """RLBOOST_TLS_CA_FILE: the CA the manager's certificate is checked against."""
    return Tls.client_env().verify()


def _client() -> httpx.Client:
    return httpx.Client(base_url=_manager_url(), headers=_headers(), timeout=10.0,
                        verify=_verify())


class Progress:
    """Prints one line per finished step and a final summary; tolerant of a slow manager."""

    def __init__(self, client: httpx.Client, run_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.shown = 0
        self.started = time.monotonic()

    def poll(self) -> dict[str, Any]:
        run: dict[str, Any] = self.client.get(f"/v1/runs/{self.run_id}").json()
        steps = self.client.get(f"/v1/runs/{self.run_id}/steps").json()
        instances = self.client.get("/v1/instances").json()
        alive = sum(1 for i in instances if i.get("state") in ("ready", "loading", "starting"))
        for rec in steps[self.shown:]:
            rate = rec["tokens"] / rec["step_s"] if rec["step_s"] > 0 else 0.0
            held_out = f"  eval {rec['eval_reward_mean']:.3f}" if "eval_reward_mean" in rec else ""
            print(f"step {rec['step'] + 1:>3}/{run['steps']}  reward {rec['reward_mean']:.3f}  "
                  f"tokens {rec['tokens']:>5}  {rate:7.0f} tok/s  step {rec['step_s']:5.2f}s  "
                  f"instances {alive}  migrations {rec['migrations']}{held_out}", flush=True)
        self.shown = len(steps)
        run["_steps"] = steps
        return run

    def summary(self, run: dict[str, Any]) -> dict[str, float]:
        steps = run["_steps"]
        rewards = [s["reward_mean"] for s in steps]
        k = min(5, len(rewards))
        first = sum(rewards[:k]) / k if k else 0.0
        last = sum(rewards[-k:]) / k if k else 0.0
        tokens = sum(s["tokens"] for s in steps)
        elapsed = time.monotonic() - self.started
        print(f"\nrun {self.run_id}: {run['state']} after {len(steps)} steps in {elapsed:.1f}s")
        print(f"  mean reward, first {k} steps: {first:.3f}")
        print(f"  mean reward, last {k} steps:  {last:.3f}   (change {last - first:+.3f})")
        print(f"  tokens trained: {tokens}   responses: {sum(s['responses'] for s in steps)}")
        evals = [f"{s['step']}:{s['eval_reward_mean']:.3f}" for s in steps
                 if "eval_reward_mean" in s]
        if evals:
            print(f"  eval reward (before step): {' '.join(evals)}")
        for key in ("migrations", "preemptions", "duplicate_chunks_dropped",
                    "stale_chunks_rejected", "tokens_regenerated"):
            print(f"  {key}: {sum(s[key] for s in steps)}")
        return {"first": first, "last": last}


def cmd_up(args: argparse.Namespace) -> int:
    exit_on_sigterm()
    root = Path(args.root).resolve()
    cluster = Cluster(root, spot=args.spot, reserved=args.reserved, engine=args.engine,
                      trainer_ranks=args.trainer_ranks, managers=args.managers, ha=args.ha)
    print(f"rlboost: starting the embedded stack under {root} (logs in {root / 'logs'})",
          flush=True)
    try:
        cluster.start()
        urls = {name: mask_url(cluster.env[f"RLBOOST_{name.upper()}_URL"])
                for name in ("manager", "weights", "nats", "redis")}
        print("  " + "  ".join(f"{name} {url}" for name, url in urls.items()), flush=True)
        print(f"  dashboard {urls['manager']}/ui/   (or: rlboost watch RUN_ID)", flush=True)
        body: dict[str, Any] = {"seed": 0, **spec_body(args)}
        if args.seed is not None:  # given on the command line: it beats a spec file's seed
            body["seed"] = args.seed
        if args.steps:
            body["steps"] = args.steps
        with httpx.Client(base_url=cluster.env["RLBOOST_MANAGER_URL"], headers=_headers(),
                          timeout=10.0, verify=Tls.client_env(cluster.env).verify()) as client:
            resp = client.post("/v1/runs", json=body)
            if resp.is_client_error:  # the spec: say what is wrong with it, as submit does
                print(f"rlboost up: run refused ({resp.status_code}): "
                      f"{resp.json().get('detail', resp.text)}", file=sys.stderr)
                return 2
            resp.raise_for_status()
            run_id = resp.json()["id"]
            print(f"submitted {run_id}: {json.dumps(body)}", flush=True)
            progress = Progress(client, run_id)
            deadline = time.monotonic() + args.timeout
            while True:
                run = progress.poll()
                if run["state"] in ("succeeded", "failed", "cancelled"):
                    break
                dead = cluster.dead()
                if dead:
                    raise RuntimeError(f"{dead[0].name} died:\n{dead[0].tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run did not finish in {args.timeout}s")
                time.sleep(0.5)
            result = progress.summary(run)
            if run["state"] != "succeeded":
                print(f"run {run['state']}: {run.get('error')}", file=sys.stderr)
                return 1
            if args.require_gain is not None and result["last"] - result["first"] < \
                    args.require_gain:
                print(f"reward gain below {args.require_gain}", file=sys.stderr)
                return 1
            return 0
    except KeyboardInterrupt:
        print("\ninterrupted; stopping everything", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"rlboost up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        body = spec_body(args)
    except (OSError, ValueError) as exc:  # yaml's errors are ValueErrors too
        print(f"rlboost submit: {exc}", file=sys.stderr)
        return 2
    with _client() as client:
        resp = client.post("/v1/runs", json=body)
    print(json.dumps(resp.json(), indent=2))
    return 0 if resp.status_code == 201 else 1


def cmd_runs(_: argparse.Namespace) -> int:
    with _client() as client:
        resp = client.get("/v1/runs")
    if resp.status_code != 200:
        print(resp.json().get("detail", resp.text), file=sys.stderr)
        return 1
    print(f"{'run':<18} {'state':<10} {'step':>11}  {'model':<16} created")
    for run in resp.json():
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["created_at"]))
        print(f"{run['id']:<18} {run['state']:<10} {run['step']:>5}/{run['steps']:<5}  "
              f"{str(run['spec'].get('model', ''))[:16]:<16} {created}")
    return 0


def cmd_run_action(args: argparse.Namespace) -> int:
    """``cancel`` or ``resume``: POST /v1/runs/RUN_ID/<command>."""
    with _client() as client:
        resp = client.post(f"/v1/runs/{args.run_id}/{args.command}")
    if resp.status_code != 200:
        print(resp.json().get("detail", resp.text), file=sys.stderr)
        return 1
    print(f"{args.run_id}: {resp.json()['state']}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    try:
        done = run_export(args.run_id, Path(args.dir), args.version, args.merged)
    except ExportError as exc:
        print(f"rlboost export: {exc}", file=sys.stderr)
        return 1
    what = "LoRA adapter " if done.adapter else ""
    print(f"{done.run_id} version {done.version} -> {what}{done.path}: {', '.join(done.files)}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    try:
        issued = make_certs(Path(args.dir), args.host or (), force=args.force)
    except (CertsError, OSError) as exc:
        print(f"rlboost certs: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a CA, server and peer certificates to {issued.directory}")
    print(f"  server names: {' '.join(issued.names)}")
    print(f"  every service and client: RLBOOST_TLS_CA_FILE={issued.directory / 'ca.pem'}")
    print("  keep ca-key.pem off the machines that run services")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    with _client() as client:
        try:
            return watch(client, args.run_id, args.interval)
        except KeyboardInterrupt:
            return 130


def cmd_status(args: argparse.Namespace) -> int:
    path = f"/v1/runs/{args.run_id}" if args.run_id else "/v1/runs"
    with _client() as client:
        resp = client.get(path)
    print(json.dumps(resp.json(), indent=2))
    return 0 if resp.status_code == 200 else 1


def _service(module: str) -> int:
    import importlib

    importlib.import_module(f"{module}.__main__").main()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlboost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start everything on the embedded stack and run one RL run")
    up.add_argument("--seed", type=int, default=None, help="default: the spec's, else 0")
    up.add_argument("--steps", type=int, default=0, help="0 = the run spec's default")
    up.add_argument("--spot", type=int, default=2)
    up.add_argument("--reserved", type=int, default=1)
    up.add_argument("--engine", default="torch", choices=["torch", "emu"])
    up.add_argument("--trainer-ranks", type=int, default=1,
                    help="trainer processes under torchrun (RLBOOST_TRAINER_SHARDING picks "
                    "replicate or fsdp2); a dead rank restarts the group from its checkpoint")
    up.add_argument("--managers", type=int, default=1,
                    help="manager replicas (one dispatches and one ingests at a time; any may "
                    "die); the first serves RLBOOST_MANAGER_URL, the others free ports")
    up.add_argument("--ha", action="store_true",
                    help="clustered brokers: a 3-node NATS JetStream cluster (the chunk stream "
                    "in 3 copies) and a Redis Cluster of 3 primaries with a replica each, any one "
                    "of which may die (docs/high-availability.md)")
    up.add_argument("--spec", help="run spec file (YAML or JSON)")
    up.add_argument("--set", action="append", metavar="KEY=VALUE", help="one run spec field")
    up.add_argument("--root", default=".rlboost")
    up.add_argument("--timeout", type=float, default=600.0)
    up.add_argument("--require-gain", type=float, default=None,
                    help="exit 1 unless last-5 mean reward exceeds first-5 by this much")
    add_spec_flags(up, skip=frozenset({"seed", "steps"}))
    for name, module in (("manager", "manager_svc"), ("weights", "weight_svc"),
                         ("trainer", "trainer_svc"), ("rollout", "rollout_svc")):
        sub.add_parser(name, help=f"run the {module} service (= python -m {module})") \
            .set_defaults(module=module)
    submit = sub.add_parser("submit", help="submit a run to RLBOOST_MANAGER_URL")
    submit.add_argument("--spec", help="run spec file: YAML (.yaml, .yml) or JSON (.json)")
    submit.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="one run spec field (dotted for nested ones), value as JSON")
    add_spec_flags(submit)
    sub.add_parser("runs", help="list the runs")
    status = sub.add_parser("status", help="show runs, or one run, as JSON")
    status.add_argument("run_id", nargs="?")
    follow = sub.add_parser("watch", help="follow a run live (progress, rewards, instances)")
    follow.add_argument("run_id")
    follow.add_argument("--interval", type=float, default=1.0, help="seconds between polls")
    cancel = sub.add_parser("cancel", help="cancel a queued or running run")
    cancel.add_argument("run_id")
    resume = sub.add_parser("resume", help="queue a failed or cancelled run again; it goes on "
                            "from its last finished step's checkpoint")
    resume.add_argument("run_id")
    export = sub.add_parser("export", help="write a run's weights as an HF model directory")
    export.add_argument("run_id")
    export.add_argument("dir", help="where to write it (must not exist, or be empty)")
    export.add_argument("--version", type=int, default=None,
                        help="weight version (default: the newest the weight service holds)")
    export.add_argument("--merged", action="store_true",
                        help="of a LoRA run: the merged model instead of the adapter")
    certs = sub.add_parser("certs", help="make a CA and TLS certificates (docs/deployment.md)")
    certs.add_argument("dir", help="where to write them (created, keys 0600)")
    certs.add_argument("--host", action="append", metavar="NAME",
                       help="one more name or IP address of the server certificate (repeat)")
    certs.add_argument("--force", action="store_true", help="replace existing files")
    args = parser.parse_args(argv)
    commands = {"up": cmd_up, "submit": cmd_submit, "runs": cmd_runs, "status": cmd_status,
                "watch": cmd_watch, "cancel": cmd_run_action, "resume": cmd_run_action,
                "export": cmd_export, "certs": cmd_certs}
    if args.command in commands:
        return commands[args.command](args)
    return _service(args.module)


if __name__ == "__main__":
    sys.exit(main())
