"""One RL step's optimisation: groups stream in before the barrier, the rest runs after it.

Contract: :class:`StepTrainer` trains one step of any algorithm of :mod:`shared.algorithm` with
the math of :mod:`trainer_svc.learn.algorithms`. ``add_group`` is called once per group, in any
order, while rollout goes on; ``step`` is called at the barrier and runs every optimizer step
of the RL step: ``updates_per_step`` passes over the step's groups, each pass split into
``minibatches`` optimizer steps. The result equals the batch computation (every group at once,
old log-probs from the step's weights, the same passes and mini-batches) exactly, in float64;
``tests/unit/test_step_trainer.py`` holds that reference.

What can run before the barrier, and what must wait:

* Mini-batch *k* of a pass holds the groups ranked ``[k n / M, (k + 1) n / M)`` by prompt index
  among the step's n groups. Without dynamic sampling n is ``prompts_per_step`` and a group's
  mini-batch is known from its prompt index on arrival; with it, only when M is 1 (a kept
  group may have any prompt index, :mod:`trainer_svc.dynamic_sampling`).
* The first mini-batch of the first pass runs with the step's weights, so its ratio is exactly
  1. Its groups are backpropagated as they arrive: a ``group``-scope estimator's advantages
  are final per group; a ``batch``-scope one (REINFORCE++) streams through
  :func:`~trainer_svc.learn.algorithms.losses.first_pass_parts` into two extra gradient buffers,
  combined at the barrier once the step's whitening is known (three gradient copies in memory
  while the step streams).
* Every other group is only scored before the barrier (old and reference log-probs, no
  gradient); its backward passes run after the barrier, after the first optimizer step.
* The step record's ``streamed_fraction`` is the share of backpropagated tokens (over every
  pass) whose backward ran before the barrier: 1 with one pass and one mini-batch, at most
  ``1 / (updates_per_step * minibatches)`` otherwise.

Multi-turn responses carry a loss mask (``Group.loss_masks``, from the samples' turns by
:func:`shared.turns.loss_mask`): their observation tokens are context, never trained. Every
response is scored through that mask
(:func:`~trainer_svc.learn.algorithms.logprobs.response_scores`), so from there on a response
*is* its trained tokens: advantages, whitening, the policy, KL and entropy terms, GSPO's
sequence ratio, every denominator and ``loss_tokens`` count them alone, for every algorithm
and ``loss_agg`` mode. Only DAPO's overlong penalty and the ``response_len_*`` statistics see
the whole response: the generation budget spends observation tokens too. Without masks
(``None``) nothing changes.

A group of a ``group``-scope estimator with all-zero advantages and no KL or entropy term has
no gradient in any pass: it is never scored, but its tokens count in the denominators, as in
the batch computation.

Ranks: every rank is told about every group (``owned=False`` for the groups another rank
backpropagates), so rewards, lengths, whitening, mini-batches and denominators are known on
each rank without communication; ``reduce`` sums the gradients and the loss-side sums over the
ranks before each optimizer step (the identity in one process). A sharded model (FSDP2) runs a
collective inside every forward and backward, so its ranks must run the same pattern of them:
:meth:`StepTrainer.work` says which pattern a group's owner runs before the barrier, and
:meth:`StepTrainer.pad` runs that pattern on a one-token input with a zero loss, on a rank that
has no such group to run; the gradient lands where the real one does, so every rank's buffers
hold the same reduced sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from shared.algorithm import AlgorithmConfig, OffPolicy, Scope
from trainer_svc.learn.algorithms import advantages, logprobs, losses
from trainer_svc.learn.algorithms.off_policy import (
    Weights,
    behaviour_weights,
    trained_behaviour,
)
from trainer_svc.learn.algorithms.stats import TrainStats, response_stats

DEFAULT_MAX_GRAD_NORM = 1.0


@dataclass(frozen=True, slots=True)
class Group:
    """One prompt's responses as the trainer trains them (ranks receive it pickled)."""

    prompt_index: int  # the group's identity within the step; orders the mini-batches
    prompts: list[list[int]]  # per response, the prompt token ids
    responses: list[list[int]]  # per response, the response token ids
    rewards: list[float]  # task rewards, before DAPO's overlong shaping
    truncated: list[bool]  # per response: ran out of budget rather than ending
    # Per response, per token: 1 trained, 0 an observation (module doc); None: all trained.
    loss_masks: list[list[int]] | None = None
    # Per response, per token: the behaviour log-prob its engine sampled it with (an empty
    # list: unknown, weighted 1); None: none given (the run corrects nothing).
    behaviour: list[list[float]] | None = None


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the objective needs to know about the run besides the algorithm's knobs."""

    max_new_tokens: int = 8  # the budget: overlong shaping and Dr. GRPO's constant
    temperature: float = 1.0  # every log-prob is taken at the sampling temperature
    groups_per_step: int = 16  # prompts per step: a group's mini-batch from its index


class Work(Enum):
    """What the owner of a group computes before the barrier (the collectives it runs)."""

    NONE = "none"  # silent: never scored
    STREAM = "stream"  # scored with gradient and backpropagated now
    SCORE = "score"  # scored without gradient; backpropagated after the barrier


# Sums the gradients of ``params`` and the float64 vector over the ranks; returns the vector.
Reduce = Callable[[list[torch.nn.Parameter], torch.Tensor], torch.Tensor]


def local_reduce(_: list[torch.nn.Parameter], sums: torch.Tensor) -> torch.Tensor:
    return sums


@dataclass(slots=True)
class _Entry:
    """A group of the step as this rank keeps it."""

    group: Group
    lengths: list[int]  # trained tokens per response: what every loss and count is over
    raw: list[torch.Tensor]  # stage-1 advantages per response (float64)
    owned: bool  # this rank backpropagates it
    silent: bool  # no gradient in any pass: never scored
    old: list[torch.Tensor] | None = None  # log-probs under the step's weights
    ref: list[torch.Tensor] | None = None  # log-probs under the reference policy
    streamed: bool = False  # its first-pass gradient is already accumulated
    # behaviour log-probs of the trained tokens, per response (None: unknown)
    behaviour: list[list[float] | None] | None = None

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(slots=True)
class _Pass:
    """Loss-side sums of one optimizer step, reduced over the ranks."""

    partial: float = 0.0
    stats: TrainStats = field(default_factory=TrainStats)

    def add(self, partial: float, stats: TrainStats) -> None:
        self.partial += partial
        self.stats.merge(stats)

    def vector(self) -> torch.Tensor:
        s = self.stats
        return torch.tensor([self.partial, *(getattr(s, name) for name in _LOSS_SIDE)],
                            dtype=torch.float64)

    @staticmethod
    def from_vector(v: torch.Tensor) -> _Pass:
        x = v.tolist()
        stats = TrainStats(**{name: kind(value) for (name, kind), value in zip(
            _LOSS_SIDE.items(), x[1:], strict=True)})
        return _Pass(x[0], stats)


# The loss-side statistics a pass sums over the ranks, and their types.
_LOSS_SIDE: dict[str, type] = {
    "loss_tokens": int, "clipped_tokens": int, "kl_sum": float, "kl_tokens": int,
    "entropy_sum": float, "entropy_tokens": int, "behaviour_tokens": int,
    "behaviour_weight_sum": float, "behaviour_capped": int,
    "behaviour_log_ratio_abs_sum": float}


class StepTrainer:
    """Accumulates one step group by group, then takes the step's optimizer steps."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 cfg: AlgorithmConfig, shape: RunShape, pad_id: int, *,
                 reference: torch.nn.Module | None = None,
                 reduce: Reduce = local_reduce) -> None:
        if cfg.needs_reference and reference is None:
            raise ValueError("kl_coef > 0 needs the frozen reference policy")
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.shape = shape
        self.pad_id = pad_id
        self.reference = reference if cfg.needs_reference else None
        self.reduce = reduce
        # The trained parameters: all of them, or a LoRA run's adapters (its base is frozen).
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.reset()

    def reset(self) -> None:
        """Forget the step's groups and gradients (a new step, or an aborted one)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._entries: dict[int, _Entry] = {}
        self._first = _Pass()  # the streamed part of the first optimizer step
        self._parts_adv: list[torch.Tensor | None] = [None] * len(self.params)
        self._parts_one: list[torch.Tensor | None] = [None] * len(self.params)
        self._parts_value = (0.0, 0.0)  # the values of the streamed (P_adv, P_one)

    # --- before the barrier -----------------------------------------------------------------

    @property
    def _can_stream(self) -> bool:
        # With dynamic sampling the step's groups, hence the mini-batches, are known only at
        # the barrier; with one mini-batch every group is in the first.
        return self.cfg.minibatches == 1 or not self.cfg.dynamic_sampling

    @property
    def _passes(self) -> int:
        return self.cfg.updates_per_step * self.cfg.minibatches

    def add_group(self, group: Group, owned: bool = True) -> None:
        """Record a group; if owned, score it and backpropagate what the barrier cannot change."""
        if group.prompt_index in self._entries:
            raise ValueError(f"group {group.prompt_index} added twice in one step")
        entry = self._entry(group, owned)
        self._entries[group.prompt_index] = entry
        if not owned or entry.silent:
            return
        if self._would_stream(entry):
            self._stream(entry)
        else:
            with torch.no_grad():
                entry.old = self._scores(entry).logprobs
                entry.ref = self._reference(entry)

    def work(self, group: Group) -> Work:
        """What :meth:`add_group` computes for ``group`` if owned (nothing is recorded)."""
        entry = self._entry(group, True)
        if entry.silent:
            return Work.NONE
        return Work.STREAM if self._would_stream(entry) else Work.SCORE

    def pad(self, work: Work | None = None) -> None:
        """The forwards and backwards of ``work`` (None: one barrier-time backward), on a
        one-token input whose loss is zero: a sharded model's collectives stay in step."""
        if work is Work.NONE:
            return
        device = self.params[0].device
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=device)
        with torch.set_grad_enabled(work is not Work.SCORE):
            loss = self.model(input_ids=ids).logits.sum() * 0.0
        if work is not None and self.reference is not None:
            with torch.no_grad():
                self.reference(input_ids=ids)
        if work is Work.SCORE:
            return
        if work is Work.STREAM and self.cfg.scope is not Scope.GROUP:
            # The two streamed sums of _stream, then its KL/entropy backward.
            self._backward_into(loss, self._parts_adv)
            self._backward_into(loss, self._parts_one)
            if not (self.cfg.kl_coef or self.cfg.entropy_coef):
                return
        loss.backward()

    def _entry(self, group: Group, owned: bool) -> _Entry:
        n = len(group.responses)
        if not n == len(group.prompts) == len(group.rewards) == len(group.truncated):
            raise ValueError("prompts, responses, rewards and truncated flags differ in count")
        lengths = [len(r) for r in group.responses]
        rewards = list(group.rewards)
        if self.cfg.overlong_buffer:  # over whole responses: the budget counts observations
            rewards = advantages.shaped(rewards, lengths, self.shape.max_new_tokens,
                                        self.cfg.overlong_buffer,
                                        self.cfg.overlong_penalty_factor)
        if group.loss_masks is not None:
            if [len(m) for m in group.loss_masks] != lengths:
                raise ValueError(f"group {group.prompt_index}: loss mask lengths "
                                 f"{[len(m) for m in group.loss_masks]} differ from the "
                                 f"response lengths {lengths}")
            lengths = [sum(1 for m in mask if m) for mask in group.loss_masks]
        raw = advantages.raw_advantages(self.cfg.estimator,
                                        torch.tensor(rewards, dtype=torch.float64), lengths)
        silent = (self.cfg.scope is Scope.GROUP and self.cfg.kl_coef == 0.0
                  and self.cfg.entropy_coef == 0.0 and all(bool((a == 0).all()) for a in raw))
        entry = _Entry(group, lengths, raw, owned, silent or sum(lengths) == 0)
        if self.cfg.off_policy is not OffPolicy.NONE:
            entry.behaviour = trained_behaviour(group.responses, group.behaviour,
                                                group.loss_masks)
        return entry

    def _weights(self, entry: _Entry, old: list[torch.Tensor]) -> Weights | None:
        """The off-policy correction's weights of ``entry``'s tokens against ``old`` (the
        proximal policy); a response whose behaviour log-probs are unknown weighs 1."""
        if entry.behaviour is None:
            return None
        mu = [o.detach() if b is None else torch.tensor(b, dtype=o.dtype, device=o.device)
              for o, b in zip(old, entry.behaviour, strict=True)]
        return behaviour_weights(self.cfg.off_policy, self.cfg.off_policy_cap, old, mu)

    def _scores(self, entry: _Entry) -> logprobs.TokenScores:
        g = entry.group
        with logprobs.dropout_off(self.model):
            return logprobs.response_scores(self.model, g.prompts, g.responses, self.pad_id,
                                            temperature=self.shape.temperature, entropy=True,
                                            loss_masks=g.loss_masks)

    def _reference(self, entry: _Entry) -> list[torch.Tensor] | None:
        if self.reference is None:
            return None
        g = entry.group
        with torch.no_grad(), logprobs.dropout_off(self.reference):
            return logprobs.response_logprobs(self.reference, g.prompts, g.responses,
                                              self.pad_id, self.shape.temperature, g.loss_masks)

    def _stream(self, entry: _Entry) -> None:
        """The group's share of the first optimizer step, while the ratio is exactly 1."""
        scores = self._scores(entry)
        new = scores.logprobs
        old = [t.detach() for t in new]
        ref = self._reference(entry)
        weights = self._weights(entry, old)
        if self.cfg.scope is Scope.GROUP:
            obj = losses.objective(self.cfg, new, old, entry.raw, ref=ref, entropy=scores.entropy,
                                   weights=weights)
            obj.partial.backward()
            self._first.add(float(obj.partial.detach()), obj.stats)
        else:
            # The policy-gradient part waits for the whitening as two sums (module doc); the
            # KL and entropy terms do not involve the advantage and go into .grad now.
            p_adv, p_one = losses.first_pass_parts(new, entry.raw, self.cfg.loss_agg, weights)
            zeros = [torch.zeros_like(a) for a in entry.raw]
            obj = losses.objective(self.cfg, new, old, zeros, ref=ref, entropy=scores.entropy,
                                   weights=weights)
            self._backward_into(p_adv, self._parts_adv)
            self._backward_into(p_one, self._parts_one)
            pa, po = self._parts_value
            self._parts_value = (pa + float(p_adv.detach()), po + float(p_one.detach()))
            if obj.partial.requires_grad and (self.cfg.kl_coef or self.cfg.entropy_coef):
                obj.partial.backward()
            self._first.add(float(obj.partial.detach()), obj.stats)
        entry.streamed = True
        if self._passes > 1:
            entry.old, entry.ref = old, ref

    def _backward_into(self, loss: torch.Tensor, buffer: list[torch.Tensor | None]) -> None:
        """Backpropagate ``loss`` into ``buffer`` instead of ``.grad``, keeping the graph."""
        saved = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        loss.backward(retain_graph=True)
        for i, p in enumerate(self.params):
            if p.grad is not None:
                have = buffer[i]
                buffer[i] = p.grad if have is None else have + p.grad
            p.grad = saved[i]

    # --- at the barrier -----------------------------------------------------------------------

    def step(self, lr: float | None = None,
             max_grad_norm: float = DEFAULT_MAX_GRAD_NORM) -> dict[str, Any]:
        """Every optimizer step of the RL step; returns the step's statistics, then resets."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        entries = [self._entries[i] for i in sorted(self._entries)]
        passes = self.cfg.updates_per_step
        batches = self._batches(entries)
        if any(e.streamed for b in batches[1:] for e in b):
            raise RuntimeError("a streamed group is not in the first mini-batch; was a group "
                               "missing or outside prompts_per_step?")
        whitening = advantages.batch_whitening(self.cfg.estimator, [e.raw for e in entries])
        final = {e.group.prompt_index: [whitening.apply(a) for a in e.raw] for e in entries}
        self._combine_parts(whitening)
        norms: list[float] = []
        loss_values: list[float] = []
        loss_stats = TrainStats()
        for epoch in range(passes):
            for k, batch in enumerate(batches):
                done = self._first if (epoch, k) == (0, 0) else _Pass()
                for entry in batch:
                    if self._at_barrier(entry, epoch, k):
                        self._backward(entry, final[entry.group.prompt_index], done)
                    if entry.owned and entry.silent:  # counted once, by its owner
                        done.stats.loss_tokens += entry.tokens
                norm, reduced = self._optimizer_step(batch, done, max_grad_norm)
                if norm is not None:
                    norms.append(norm)
                loss_values.append(reduced.partial)
                loss_stats.merge(reduced.stats)
        out = self._summary(entries, final, loss_stats)
        out["loss"] = sum(loss_values) / len(loss_values) if loss_values else 0.0
        out["grad_norm"] = sum(norms) / len(norms) if norms else 0.0
        out["optimizer_steps"] = len(norms)
        self.reset()
        return out

    def _batches(self, entries: list[_Entry]) -> list[list[_Entry]]:
        m = self.cfg.minibatches
        batches: list[list[_Entry]] = [[] for _ in range(m)]
        for rank, entry in enumerate(entries):
            batches[rank * m // len(entries)].append(entry)
        return batches

    @staticmethod
    def _at_barrier(entry: _Entry, epoch: int, k: int) -> bool:
        """Whether this rank backpropagates ``entry`` in pass ``epoch``, mini-batch ``k``."""
        return entry.owned and not entry.silent and not (epoch == k == 0 and entry.streamed)

    def barrier_backwards(self) -> list[int]:
        """Per optimizer step :meth:`step` will take, the backwards this rank runs in it."""
        entries = [self._entries[i] for i in sorted(self._entries)]
        return [sum(self._at_barrier(e, epoch, k) for e in batch)
                for epoch in range(self.cfg.updates_per_step)
                for k, batch in enumerate(self._batches(entries))]

    def _combine_parts(self, w: advantages.Whitening) -> None:
        """``.grad += scale * (P_adv - mean * P_one)``: the streamed policy-gradient part."""
        pa, po = self._parts_value
        self._first.partial += w.scale * (pa - w.mean * po)
        for i, p in enumerate(self.params):
            a, one = self._parts_adv[i], self._parts_one[i]
            if a is None or one is None:
                continue
            part = (a - w.mean * one) * w.scale
            p.grad = part if p.grad is None else p.grad + part

    def _backward(self, entry: _Entry, adv: list[torch.Tensor], done: _Pass) -> None:
        if entry.old is None:
            raise RuntimeError(f"group {entry.group.prompt_index} was never scored")
        scores = self._scores(entry)
        obj = losses.objective(self.cfg, scores.logprobs, entry.old, adv, ref=entry.ref,
                               entropy=scores.entropy, weights=self._weights(entry, entry.old))
        obj.partial.backward()
        done.add(float(obj.partial.detach()), obj.stats)

    def _optimizer_step(self, batch: list[_Entry], done: _Pass,
                        max_grad_norm: float) -> tuple[float | None, _Pass]:
        """Reduce, divide by the mini-batch's denominator, clip, step.

        Returns the gradient norm (None: no step taken) and the reduced sums, ``partial``
        divided by the denominator: the mini-batch's loss.
        """
        reduced = _Pass.from_vector(self.reduce(self.params, done.vector()))
        counts = sum((losses.AggCounts.of(e.lengths) for e in batch), losses.AggCounts())
        denom = losses.denominator(self.cfg.loss_agg, counts, self.shape.max_new_tokens)
        params = [p for p in self.params if p.grad is not None]
        norm: float | None = None
        if params and counts.tokens:
            # Scaled after backward: HF's RMSNorm runs in float32 even in a float64 model, so
            # scaling the loss instead would differ at ~1e-7 for reasons unrelated to streaming.
            for p in params:
                assert p.grad is not None
                p.grad.mul_(1.0 / denom)
            norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
            self.optimizer.step()
        # No gradient, no step: AdamW would still move weights on its moments alone.
        self.optimizer.zero_grad(set_to_none=True)
        reduced.partial /= denom
        return norm, reduced

    def _summary(self, entries: list[_Entry], final: dict[int, list[torch.Tensor]],
                 loss_stats: TrainStats) -> dict[str, Any]:
        data = response_stats([len(r) for e in entries for r in e.group.responses],
                              [t for e in entries for t in e.group.truncated],
                              [a for e in entries for a in final[e.group.prompt_index]])
        out: dict[str, Any] = {**loss_stats.merge(data).summary()}
        tokens = sum(len(r) for e in entries for r in e.group.responses)  # all were scored
        backprop = self.cfg.updates_per_step * sum(e.tokens for e in entries if not e.silent)
        # Decided by the same rule on every rank, so no rank needs another's flags.
        streamed = sum(e.tokens for e in entries if not e.silent and self._would_stream(e))
        if backprop:
            out["streamed_fraction"] = streamed / backprop
        out.update(tokens=tokens, trained_tokens=sum(e.tokens for e in entries),
                   samples=sum(len(e.lengths) for e in entries), groups=len(entries),
                   reward_mean=sum(r for e in entries for r in e.group.rewards)
                   / max(1, sum(len(e.lengths) for e in entries)))
        return out

    def _would_stream(self, entry: _Entry) -> bool:
        """Whether the rank owning ``entry`` streamed it (the same rule, known everywhere)."""
        # One mini-batch holds every group, dynamic sampling's extra prompts included.
        m = self.cfg.minibatches
        return self._can_stream and (
            m == 1 or entry.group.prompt_index * m // self.shape.groups_per_step == 0)

