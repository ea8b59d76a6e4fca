"""In-process self-checks: GRPO improves the embedded models, with no services and no network.

* ``arith`` -- the tiny model on the arith task: ``python -m trainer_svc.selfcheck``
  (``__main__``).
* ``chat`` -- tiny-chat on the word problems with the ``math`` reward: ``python -m
  trainer_svc.selfcheck.chat``.
* ``grpo`` -- what both share: GRPO's tuned defaults, one step of groups through the trainer's
  own :class:`~trainer_svc.learn.step_trainer.StepTrainer`, and the reward curve a check is
  judged on.

May import any of the trainer's packages and ``shared``. No production module imports it (an
import contract in pyproject.toml): the trainer never runs test code.
"""
