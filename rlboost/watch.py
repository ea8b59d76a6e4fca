"""``rlboost watch RUN_ID``: a run followed in the terminal until it ends.

Contract: polls the manager's REST API (the run, its step records when the step moved, the
instances) once per ``interval_s`` and redraws one rich Live view: a progress bar over the
run's steps (the current step's responses fill in between), the latest steps in a table
(reward, eval reward where the run evaluates, tokens/s, step time), the ETA from the recent
step times and the live instances by kind. It returns when the run has ended, after one last
draw: 0 if it succeeded, 1 otherwise. A manager that does not answer for a moment (restarting)
is waited for; an unknown run or a refused token ends it with a message.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

TERMINAL = ("succeeded", "failed", "cancelled")
ROWS = 8  # latest steps shown


def _fmt(value: Any, digits: int) -> str:
    return "-" if not isinstance(value, int | float) else f"{value:.{digits}f}"


def _rate(rec: dict[str, Any]) -> float | None:
    return float(rec["tokens"]) / float(rec["step_s"]) if rec.get("step_s") else None


def eta_s(run: dict[str, Any], steps: list[dict[str, Any]]) -> float | None:
    recent = [float(s["step_s"]) for s in steps[-5:] if s.get("step_s")]
    if run["state"] in TERMINAL or not recent:
        return None
    return max(0, int(run["steps"]) - len(steps)) * sum(recent) / len(recent)


def view(run: dict[str, Any], steps: list[dict[str, Any]], instances: list[dict[str, Any]],
         bar: Progress, task: Any) -> Group:
    progress = run.get("progress") or {}
    part = (progress.get("responses_done", 0) / progress["responses_total"]
            if run["state"] == "running" and progress.get("responses_total") else 0.0)
    done = min(run["step"], run["steps"])
    bar.update(task, completed=done + part, total=run["steps"],
               description=f"step {done}/{run['steps']}")
    eta = eta_s(run, steps)
    kinds: dict[str, int] = {}
    for inst in instances:
        if inst.get("state") != "draining":
            kinds[inst["kind"]] = kinds.get(inst["kind"], 0) + 1
    head = Text.assemble((f"run {run['id']}  ", "bold"), (run["state"], {
        "succeeded": "green", "running": "cyan"}.get(run["state"], "red")),
        f"   ETA {'-' if eta is None else f'{eta:.0f}s'}   instances: "
        + (", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"))
    table = Table(box=None, pad_edge=False)
    for col in ("step", "reward", "eval reward", "tokens/s", "step s", "migrations",
                "preemptions"):
        table.add_column(col, justify="right")
    for rec in steps[-ROWS:]:
        table.add_row(f"{rec['step'] + 1}/{run['steps']}", _fmt(rec.get("reward_mean"), 3),
                      _fmt(rec.get("eval_reward_mean"), 3), _fmt(_rate(rec), 0),
                      _fmt(rec.get("step_s"), 2), str(rec.get("migrations", "-")),
                      str(rec.get("preemptions", "-")))
    parts: list[Any] = [head, bar, table]
    for warning in run.get("warnings") or []:
        parts.append(Text(f"warning: {warning}", style="yellow"))
    if run.get("error"):
        parts.append(Text(f"error: {run['error']}", style="red"))
    return Group(*parts)


def watch(client: httpx.Client, run_id: str, interval_s: float = 1.0,
          console: Console | None = None) -> int:
    console = console or Console()
    bar = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                   console=console)
    task = bar.add_task("step", total=1)
    steps: list[dict[str, Any]] = []
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            try:
                resp = client.get(f"/v1/runs/{run_id}")
                if resp.status_code in (401, 404):
                    live.stop()
                    console.print(f"[red]{resp.json().get('detail', resp.text)}[/red]")
                    return 1
                resp.raise_for_status()
                run = resp.json()
                if run["step"] != len(steps) or run["state"] in TERMINAL:
                    steps = client.get(f"/v1/runs/{run_id}/steps").raise_for_status().json()
                instances = client.get("/v1/instances").raise_for_status().json()
            except (httpx.TransportError, httpx.HTTPStatusError):
                time.sleep(interval_s)  # the manager restarting: wait for it
                continue
            live.update(view(run, steps, instances, bar, task), refresh=True)
            if run["state"] in TERMINAL:
                return 0 if run["state"] == "succeeded" else 1
            time.sleep(interval_s)
