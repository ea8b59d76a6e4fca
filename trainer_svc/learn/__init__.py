"""The learning code: what one RL step computes, and the policies that hold the model.

* ``step_trainer`` -- :class:`StepTrainer`: one step of any algorithm, its groups streaming in
  before the barrier and the rest run after it.
* ``algorithms`` -- advantages, log-probs, losses and the step's statistics.
* ``schedule`` -- the learning-rate schedule (:func:`learning_rate_at`).
* ``policies`` -- what the trainer trains (torch in one process, data-parallel under torchrun,
  FSDP2, or emulated) and :func:`make_policy`, which picks one from a run spec.
* ``checkpoint``, ``sharded_checkpoint`` -- the weights on disk: the base model loaded, each
  version saved and published.
* ``step_meter`` -- each step's time and memory; ``compute_model`` -- what training costs on a
  GPU, for the emulation and the simulator.

May import ``shared`` and the packages beneath it: ``trainer_svc.embedded`` (the tiny models'
builders and the task's ids) and ``trainer_svc.errors`` (``inputs`` too, though nothing here
needs it); never the service loop or ``selfcheck``. This file imports nothing, so the
simulator's import of ``compute_model`` loads no torch.
"""
