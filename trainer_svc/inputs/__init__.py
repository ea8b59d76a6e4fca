"""What a run reads besides the model: prompt datasets, chat templates and reward functions.

* ``data`` -- prompt datasets (local JSONL/JSON/Parquet/CSV through HF ``datasets``), drawn
  per step from the run seed.
* ``chat`` -- prompts rendered through a tokenizer's chat template; responses decoded.
* ``rewards`` -- reward functions by name: the built-in ``"math"`` and ``"exact"``, user
  ``python:`` ones.
* ``scorer`` -- :class:`RewardScorer`: rewards run in worker processes, with a timeout per call.
* ``reward_worker`` -- one worker process (the scorer starts it by module path).
* ``user_code`` -- ``python:<module>:<attr>`` specs, found through the reward path only.
* ``workers`` -- killable worker processes with a scrubbed environment (rewards, envs).
* ``envs`` -- agentic runs' environment contract and loading; ``calculator`` and
  ``python_env`` the built-ins; ``env_worker`` and ``tool_pool`` run their steps with a
  timeout per call.
* ``sandbox`` -- untrusted Python in a limited subprocess; ``code_reward`` scores code on it.

May import ``shared`` and each other only, nothing else of the trainer's. This file imports
nothing: a reward worker imports ``reward_worker`` in a fresh process and stays free of torch.
"""
