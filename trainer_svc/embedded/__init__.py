"""The models and tasks the trainer builds itself, so a run needs no download.

* ``task`` -- the ``arith-seq`` task: vocabulary, prompts and reward, in pure Python.
* ``tiny`` -- the ``"tiny"`` Qwen2 for that task, built and warmed up locally.
* ``word_problems`` -- the word-problem generator (the text of ``examples/data/``; ``python -m
  trainer_svc.embedded.word_problems --out examples/data`` rewrites it).
* ``tiny_chat`` -- the ``"tiny-chat"`` Qwen2 with a byte-level BPE tokenizer and a chat
  template, warmed up on the word problems.
* ``tiny_chat_tools`` -- ``"tiny-chat-tools"``: tiny-chat warmed up to call the ``calculator``
  environment on some of the problems.
* ``model_dir`` -- a model directory built once per key, atomically.

May import ``shared`` and each other only; never the learning code, the service loop or the
self-checks.
"""
