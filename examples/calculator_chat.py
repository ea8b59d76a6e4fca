"""Talk to a model directory with the calculator tool, as an agentic run does.

    .venv/bin/python examples/calculator_chat.py DIR [--problems FILE] [-n 200] [--turns 3]

DIR is an HF model directory with a chat template (``rlboost export RUN_ID DIR`` of a run of
``examples/tiny-chat-tools.json``). For each of the first ``n`` problems the model answers
greedily; a turn that calls ``<calc>EXPRESSION</calc>`` gets the ``calculator`` environment's
answer as the template's tool message and the model goes on, up to ``--turns`` model turns,
exactly as the trainer's tool loop renders it (``ChatFormat.observation``). Prints the first
conversation, then the share of problems where the model called the tool and the mean reward
(the environment's: ``math`` on the final ``#### N``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shared.generation import DrawKey, generate
from trainer_svc.inputs.calculator import CalculatorEnv
from trainer_svc.inputs.chat import ChatFormat, eos_token_ids

EVAL = Path(__file__).resolve().parent / "data" / "word-problems-eval.jsonl"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--problems", type=Path, default=EVAL)
    parser.add_argument("-n", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="per model turn")
    args = parser.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    chat, eos = ChatFormat(tok), eos_token_ids(args.model_dir, tok)
    rows = [json.loads(line) for line in args.problems.read_text().splitlines()[: args.n]]
    envs = [CalculatorEnv(r["prompt"], r["answer"], 0) for r in rows]
    seqs = [chat.render(r["prompt"]).prompt_token_ids for r in rows]
    shown = [f"user: {rows[0]['prompt']}"] if rows else []
    rewards, called = [0.0] * len(rows), [False] * len(rows)
    live = list(range(len(rows)))
    for turn in range(args.turns):
        if not live:
            break
        keys = [DrawKey(0, turn, i, 0) for i in live]
        with torch.no_grad():
            turns = generate(model, [seqs[i] for i in live], args.max_new_tokens, 0.0, eos, keys)
        going = []
        for i, ids in zip(live, turns, strict=True):
            action = chat.decode(ids)
            out = envs[i].step(action, f"chat:{i}:{turn}")
            if i == 0:
                shown.append(f"assistant: {action}")
            if out["done"] or turn == args.turns - 1:
                rewards[i] = float(out["reward"] or 0.0)
                continue
            called[i] = True
            if i == 0:
                shown.append(f"tool: {out['observation']}")
            seqs[i] = seqs[i] + list(ids) + chat.observation(out["observation"], ids[-1])
            going.append(i)
        live = going
    print("\n".join(shown))
    n = max(1, len(rows))
    print(f"{len(rows)} problems: called the tool on {sum(called) / n:.1%}, "
          f"mean reward {sum(rewards) / n:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
