"""The trainer service: the RL loop on the reserved side, in packages by concern.

The modules at this level are the service loop: ``__main__`` (``python -m trainer_svc``) and
``torchrun`` (``python -m trainer_svc.torchrun``) start it; ``service`` runs the step loop;
``step_feed`` and ``manager_client`` talk to the manager; ``workload`` says what a run trains
on (each step's prompts, how responses score, the eval); ``dynamic_sampling`` decides which
groups a step keeps; ``trackers`` logs each step to experiment trackers; ``saved`` pins the
versions a run keeps; ``errors`` is the package's error tree. Beneath them:

* ``learn`` -- the learning code: the step trainer, the algorithms, the learning-rate
  schedule, the policies that hold the model, checkpoints, the step meter, the compute model.
* ``inputs`` -- what a run reads besides the model: prompt datasets, chat templates, reward
  functions and the worker processes that run them.
* ``embedded`` -- the models and tasks built here: the arith task and ``tiny``, the word
  problems and ``tiny-chat``.
* ``selfcheck`` -- in-process proofs that GRPO improves the embedded models; no production
  module imports it.

Imports point down: the self-checks, then the service loop, then ``learn``, then ``inputs``,
``embedded`` and ``errors`` (the contracts in pyproject.toml hold it). This file imports
nothing: a reward worker is a fresh process that imports ``trainer_svc.inputs.reward_worker``
and must not pull in torch on the way.
"""
