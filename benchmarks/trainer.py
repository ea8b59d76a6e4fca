"""``make bench-trainer``: step time, peak and activation memory, plain vs FSDP2, at RL lengths.

One run, one ``torchrun`` job per entry of ``--jobs`` (:data:`JOBS`) on this machine (gloo on
the CPU, nccl where CUDA is), each training the same randomly initialised Qwen2 model
(``--layers`` x ``--hidden``, vocabulary ``--vocab``, untied embeddings unless ``--tied``, fp32
weights and fp32 compute, GRPO, AdamW) on the same synthetic groups: the replicated trainer
(``plain``: a full model and AdamW per rank), the sharded one (``fsdp2``: fully_shard per
decoder layer and embedding), and the sharded one with activation checkpointing switched on
(``fsdp2-ac``: ``RLBOOST_TRAINER_ACTIVATION_CHECKPOINTING``; off in the other two, the
trainer's default; the replicated trainer has no such switch). Neither trainer micro-batches:
a group (``--samples`` sequences) is one forward and one backward, its activations held at
once. A step is ``--groups`` groups; benchmarks/trainer_rank.py runs the steps: two at 16
tokens per sequence, then ``--steps`` at each of ``--seq-lens`` (tokens per sequence, a
4-token prompt included). Printed per job and length, for the last step at that length:

- time: the step's wall seconds on rank 0 (every group's add_group plus the optimizer step),
  rank 0's process CPU seconds (user + system; other work on a shared machine inflates the
  wall time much more than this) and the system part, each against plain x1 at that length.
- memory: the step's peak per rank, the worst rank's, and above ``base`` (a rank's resident
  set before any model: the interpreter and libraries); ``state``: rank 0's resident set
  before the step, above ``base`` (weights, AdamW's moments); ``act``, the *activation
  memory*: the step's peak minus the same job's peak at 16 tokens, i.e. what sequences of this
  length add on top of the weights, gradients, AdamW state and FSDP2's unsharded units, all of
  which the 16-token step holds too; per token it is over one group's ``samples x length``
  positions (the most held at once, padding included); ``act %``: its share of the peak above
  ``base``.
- rank 0's CPU seconds by phase (trainer_rank.PHASES, timed in FSDP2's hooks, the optimizer
  step and ``clip_grad_norm_``); ``rest`` is the forward and backward compute and the loss.
- fsdp2 x1 against plain x1: the extra CPU seconds and how much of them each part holds, with
  the extra kernel time and pages faulted in (minor faults: fresh pages the kernel zero-fills).
- whether activation checkpointing took effect (fsdp2-ac against fsdp2). It does not, as of
  this writing: the trainer scores with the model in eval mode (``logprobs.dropout_off``, to
  turn dropout off) and HF's decoder layers checkpoint only in training mode, so the switch
  changes nothing; the line says so while fsdp2-ac keeps over 90 % of fsdp2's activations.

Memory is the resident set on the CPU (trainer_svc/learn/step_meter.py: ``tracemalloc`` never
sees tensor storage and torch keeps no CPU allocator statistics), torch's allocated bytes on
CUDA. The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor is a mapping of its
own that goes back to the kernel when freed and the resident set is what is live; it also
makes every buffer a fresh mapping, which adds page faults to both trainers (see below).

What the default measures, and favours. The model is small (4 x 256, vocabulary 8192, 7M
parameters) because every step runs fp32 on one CPU core per rank: at 707M parameters one step
of 16 sequences of 12 tokens takes ~22 s here, and the same at 8k tokens would take hours.
Activations per token grow with the width, weights and AdamW state with its square, so a
small model reaches the regime where activations dominate at shorter sequences than a 7B one
does, and FSDP2's memory saving there is smaller than a 7B model's would be at equal length.
The vocabulary is cut from Qwen's 152k so that the fp32 logits, log-softmax and entropy over
the vocabulary (several vocabulary-wide tensors per token) are not nearly all of the
activations. The responses of a group are all of one length, so no row is padded and
attention needs no mask; ``--ragged`` pads them as a rollout's group is (lengths from the full
down to half), which costs both trainers more time and memory for fewer real tokens. The memory
of parameters and AdamW state alone, and its sharding, is the 16-token row; ``--layers 24
--hidden 1536 --vocab 32000 --seq-lens 12 --samples 4 --groups 4`` measures it at 707M.

FSDP2's cost on one rank, measured by phase: every group's forward and backward writes five
model-sized buffers that the plain trainer never allocates: the unsharded parameters before
each unit's forward and again before its backward (``reshard_after_forward``; at one rank a
copy, at more an all-gather), and in the reduce after each unit's backward the flat gradient
(copy-in), its division by the divide factor 1.0 into a temporary and the reduce-scatter's
output (at one rank a copy), which is then added to the sharded gradient (torch 2.13,
``foreach_reduce``). On the CPU each buffer is a fresh mapping (no caching allocator; glibc
maps blocks over 32 MiB anew even without the setting above; the default model's smaller
units are fresh only because of it), so the kernel zero-fills every page before the copy: at
707M that kernel time is most of FSDP2's extra. AdamW and clipping
on DTensors cost little more than on tensors. All of it is per forward and backward and
proportional to the parameters, not the tokens: most of a 16-token step, a few percent at
1k-8k tokens (figures: docs/preemption-seeding-scale.md, sharded training).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.provenance import commit
from benchmarks.trainer_rank import MODES, PHASES, SHORT, RankSpec

REPO = Path(__file__).resolve().parent.parent
# The replicated trainer at 2 ranks is left out to keep the run short: each of its ranks holds
# what plain:1 holds and a flat gradient buffer for the all-reduce, and runs half the groups.
# ``--jobs plain:1,plain:2`` measures it.
JOBS = "plain:1,fsdp2:1,fsdp2:2,fsdp2-ac:2"
SEQ_LENS = "1024,4096,8192"
GIB = 2**30


def _backend() -> str:
    import torch

    if torch.cuda.is_available():
        return f"nccl on {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"gloo on {len(os.sched_getaffinity(0))} CPUs"


def provenance(argv: list[str]) -> str:
    """The commit (``-dirty`` with changes) and command the printed figures come from."""
    return f"commit {commit()}; python -m benchmarks.trainer {' '.join(argv)}".rstrip()


def build_model(out: Path, layers: int, hidden: int, vocab: int = 32000, tied: bool = False,
                positions: int = 64) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256),
                         intermediate_size=hidden * 11 // 4,
                         max_position_embeddings=max(64, positions), tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _job(spec: RankSpec, ranks: int, root: Path) -> dict[str, Any]:
    spec_file = root / f"{spec.mode}-{ranks}.spec.json"
    spec.save(spec_file)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(ranks), "-m", "benchmarks.trainer", "--rank-of", str(spec_file)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    out = Path(spec.out)
    if proc.returncode and not out.is_file():
        raise SystemExit(f"{spec.mode} x{ranks} failed:\n{proc.stderr[-3000:]}")
    if proc.returncode:  # the figures were written; only leaving the process group failed
        print(f"  {spec.mode} x{ranks}: exit {proc.returncode} after writing its figures: "
              f"{proc.stderr.strip().splitlines()[0][:120]}", flush=True)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def by_length(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The last step at each length; the 16-token one is the baseline (not the warm-up)."""
    rows: dict[int, dict[str, Any]] = {}
    for row in result["steps"][1:]:
        rows[row["length"]] = row
    return rows


def activation(rows: dict[int, dict[str, Any]], length: int) -> int:
    """Bytes sequences of ``length`` add to the step's peak over the 16-token baseline."""
    return int(rows[length]["peak"] - rows[SHORT]["peak"])


def _row_label(mode: str, ranks: int, length: int) -> str:
    return f"{mode:<9}x{ranks:<3}{length:>6} tok"


def report(results: dict[tuple[str, int], dict[str, Any]], samples: int) -> None:
    """The three tables (module doc); ratios against plain x1 at the same length."""
    rows = {job: by_length(res) for job, res in results.items()}
    ref = rows.get(("plain", 1))
    lengths = sorted(next(iter(rows.values())))

    def x(value: float, ref_value: float | None) -> str:
        return f"{value / ref_value:>7.2f}" if ref_value else f"{'-':>7}"

    print(f"\ntime per step, rank 0{'':<6}{'step s':>8}{'x pl1':>7}{'cpu s':>8}{'x pl1':>7}"
          f"{'sys s':>7}{'tok/s':>8}")
    for (mode, ranks), job in rows.items():
        for n in lengths:
            r, pl = job[n], ref[n] if ref else None
            print(f"{_row_label(mode, ranks, n)}{r['step_s']:>9.2f}"
                  f"{x(r['step_s'], pl['step_s'] if pl else None)}{r['cpu_s']:>8.2f}"
                  f"{x(r['cpu_s'], pl['cpu_s'] if pl else None)}{r['sys_s']:>7.2f}"
                  f"{r['tokens'] / r['step_s']:>8.0f}")
    print(f"\nmemory per rank, GiB{'':<7}{'peak':>7}{'-base':>7}{'x pl1':>7}{'state':>7}"
          f"{'act':>7}{'x pl1':>7}{'KiB/tok':>8}{'act %':>7}")
    for (mode, ranks), job in rows.items():
        base = results[mode, ranks]["base"]
        for n in lengths:
            r = job[n]
            above = r["peak"] - base
            ref_above = ref[n]["peak"] - results["plain", 1]["base"] if ref else None
            acts = f"{'-':>7}{'-':>7}{'-':>8}{'-':>7}"  # at or below the baseline's length
            if n > SHORT:
                act = activation(job, n)
                acts = (f"{act / GIB:>7.2f}{x(act, activation(ref, n) if ref else None)}"
                        f"{act / (samples * n) / 1024:>8.1f}{100 * act / max(1, above):>7.0f}")
            print(f"{_row_label(mode, ranks, n)}{r['peak'] / GIB:>8.2f}{above / GIB:>7.2f}"
                  f"{x(above, ref_above)}{(r['before'] - base) / GIB:>7.2f}{acts}")
    print("\nrank 0's CPU s by phase"
          + "".join(f"{p.replace('optimizer', 'optim'):>12}" for p in PHASES) + f"{'rest':>8}")
    for (mode, ranks), job in rows.items():
        for n in lengths:
            r = job[n]
            print(f"{_row_label(mode, ranks, n)}"
                  + "".join(f"{r['cpu'][p]:>12.2f}" for p in PHASES)
                  + f"{r['cpu_s'] - sum(r['cpu'].values()):>8.2f}")


def one_rank_cost(results: dict[tuple[str, int], dict[str, Any]]) -> None:
    """FSDP2 x1 against plain x1 per length: the extra CPU seconds, split into FSDP2's hooks,
    the optimizer and clipping, and the rest (compute), with the extra pages faulted in."""
    if ("plain", 1) not in results or ("fsdp2", 1) not in results:
        return
    plain, fsdp = by_length(results["plain", 1]), by_length(results["fsdp2", 1])
    hooks = [p for p in PHASES if p not in ("optimizer", "clip")]
    print("\nfsdp2 x1 against plain x1, rank CPU: ratio, extra s, of which in FSDP2's hooks, "
          "the optimizer and clipping, the rest")
    for n in sorted(plain):
        p, f = plain[n], fsdp[n]
        in_hooks = sum(f["cpu"][k] for k in hooks)
        opt = sum(f["cpu"][k] - p["cpu"][k] for k in ("optimizer", "clip"))
        extra = f["cpu_s"] - p["cpu_s"]
        pages = (f["faults"] - p["faults"]) * 4096 / GIB
        print(f"  {n:>6} tok: {f['cpu_s'] / p['cpu_s']:.2f}x, {extra:+.2f} s: hooks "
              f"{in_hooks:.2f}, optimizer+clip {opt:+.2f}, rest {extra - in_hooks - opt:+.2f}; "
              f"in the kernel {f['sys_s'] - p['sys_s']:+.2f} s, {pages:+.1f} GiB more pages "
              "faulted in")


def checkpointing(results: dict[tuple[str, int], dict[str, Any]]) -> None:
    """fsdp2-ac against fsdp2 at the same ranks: did recomputation cut the activations?"""
    for (mode, ranks), res in results.items():
        if mode != "fsdp2-ac" or ("fsdp2", ranks) not in results:
            continue
        ac, off = by_length(res), by_length(results["fsdp2", ranks])
        longest = max(ac)
        kept = activation(ac, longest) / max(1, activation(off, longest))
        verdict = "no effect (module doc)" if kept > 0.9 else "in effect"
        print(f"\nactivation checkpointing (fsdp2-ac x{ranks} / fsdp2 x{ranks}) at {longest} "
              f"tokens: activations {kept:.2f}x, CPU "
              f"{ac[longest]['cpu_s'] / off[longest]['cpu_s']:.2f}x: {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Small on purpose (module doc): 7M parameters in fp32 keep a default run with 8k-token
    # sequences to 6-10 minutes on two shared CPU cores.
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-lens", default=SEQ_LENS, help="tokens per sequence, comma-"
                        "separated; each measured after the 16-token baseline")
    parser.add_argument("--steps", type=int, default=1, help="measured steps per length")
    parser.add_argument("--groups", type=int, default=2, help="groups per step")
    parser.add_argument("--samples", type=int, default=2, help="sequences per group (one "
                        "forward); at least 2, or GRPO has nothing to train on")
    parser.add_argument("--ragged", action="store_true", help="a group's responses run from "
                        "the full length down to half of it, padded to the longest (default: "
                        "all of the full length, no padding)")
    parser.add_argument("--tied", action="store_true", help="tie the input and output "
                        "embeddings (small models do; Qwen2.5-7B and larger do not)")
    parser.add_argument("--jobs", default=JOBS, help="trainer:ranks,... with trainer one of "
                        f"{', '.join(MODES)} (plain:1 first: the ratios' reference)")
    parser.add_argument("--rank-of", metavar="SPEC", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if args.rank_of:
        from benchmarks import trainer_rank

        trainer_rank.run(RankSpec.load(Path(args.rank_of)))
        return
    seq_lens = [int(n) for n in args.seq_lens.split(",")]
    if args.samples < 2 or min(seq_lens) <= 4:
        parser.error("--samples must be >= 2 and every length > 4 (the prompt)")
    started_all = time.monotonic()
    print(provenance(argv), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        root = Path(tmp)
        params = build_model(root / "model", args.layers, args.hidden, args.vocab, args.tied,
                             max(seq_lens))
        print(f"model: Qwen2 {args.layers} layers x {args.hidden}, vocabulary {args.vocab}, "
              f"{'tied' if args.tied else 'untied'} embeddings, {params / 1e6:.1f}M params "
              f"({params * 4 / GIB:.3f} GiB fp32; AdamW state twice that); GRPO, "
              f"{args.groups} groups x {args.samples} sequences per step "
              f"({'ragged, padded' if args.ragged else 'equal lengths'}), no micro-batching; "
              f"activation checkpointing only in fsdp2-ac; {_backend()}", flush=True)
        results: dict[tuple[str, int], dict[str, Any]] = {}
        for job in args.jobs.split(","):
            mode, ranks = job.split(":")[0], int(job.split(":")[1])
            if mode not in MODES:
                parser.error(f"unknown trainer {mode!r} in --jobs")
            spec = RankSpec(str(root / "model"), mode, seq_lens, args.steps, args.groups,
                            args.samples, args.vocab, str(root / f"{mode}-{ranks}.json"),
                            args.ragged)
            started = time.monotonic()
            results[mode, ranks] = _job(spec, ranks, root)
            print(f"  ran {mode} x{ranks} in {time.monotonic() - started:.0f} s", flush=True)
    report(results, args.samples)
    one_rank_cost(results)
    checkpointing(results)
    print(f"\n{time.monotonic() - started_all:.0f} s in all")


if __name__ == "__main__":
    main()
