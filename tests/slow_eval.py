"""Run by tests/test_stopping.py, alone or under torchrun: train.py with each held-out span retrieval from the
SLOW_EVAL_FROM-th on (0: the start's) made SLOW_EVAL_SECONDS slower, its start said on stderr ("evaluation N"), so
that a SIGTERM can land inside an evaluation."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from support import retrieval as R  # noqa: E402

retrieval = R.span_retrieval
evaluations = []


def slow_retrieval(*args, **kwargs):
    print(f"evaluation {len(evaluations)}", file=sys.stderr, flush=True)
    if len(evaluations) >= int(os.environ.get("SLOW_EVAL_FROM", "0")):
        time.sleep(float(os.environ["SLOW_EVAL_SECONDS"]))
    evaluations.append(1)
    return retrieval(*args, **kwargs)


R.span_retrieval = slow_retrieval
train.main(sys.argv[1:])
