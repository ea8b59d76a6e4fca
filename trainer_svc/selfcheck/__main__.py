"""``python -m trainer_svc.selfcheck``: the arith self-check (:mod:`trainer_svc.selfcheck.arith`).

The chat self-check is ``python -m trainer_svc.selfcheck.chat``.
"""

from __future__ import annotations

import sys

from trainer_svc.selfcheck.arith import main

if __name__ == "__main__":
    sys.exit(main())
