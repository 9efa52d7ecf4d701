"""Run by tests/test_stopping.py under torchrun: train.py, with rank 1 killed (SIGKILL, as the OOM killer does) at
the point $DIE_AT names, so that rank 0 meets it in the collective it waits in there:
  setup       before the process group is up: rank 0 waits inside its set-up, in a C call, where torchrun's SIGTERM
              finds it
  step        before rank 1's third step: rank 0 waits in the step's all-reduces
  agreement   after rank 1's third optimizer step: rank 0 waits in the SIGTERM agreement
  checkpoint  at the first checkpoint, once the ranks' weights are compared: rank 0 writes it, then waits in the
              barrier after it
  evaluation  as rank 0 scores STS-B dev after step 2: its next step's all-reduces find rank 1 gone
  end         after rank 1's last step: rank 0 hands the model over, then waits in the last barrier"""
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from support import runs, stopping, training  # noqa: E402
from support.training import Run  # noqa: E402

POINT, RANK = os.environ["DIE_AT"], int(os.environ["RANK"])
steps = []


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner, name, before=None, after=None):
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before and before():
            die()
        out = real(*args, **kwargs)
        if after and after():
            die()
        return out

    setattr(owner, name, wrapped)


if RANK == 1:
    wrap(runs, "begin", before=lambda: POINT == "setup")
    wrap(train, "train_step", before=lambda: steps.append(1) or (POINT == "step" and len(steps) == 3))
    wrap(stopping, "agreed_stop", before=lambda: POINT == "agreement" and len(steps) == 3)
    wrap(training, "same_weights", after=lambda: POINT == "checkpoint")  # save_checkpoint's first collective
    wrap(Run, "score_and_keep_best", before=lambda: POINT == "evaluation")
    wrap(train, "train", after=lambda: POINT == "end")
train.main(sys.argv[1:])
