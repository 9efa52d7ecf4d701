"""Run by tests/test_train.py under torchrun: train.py, and after training each rank writes its own step and
weights to $RANK_WEIGHTS/rank{R}.pt, so that a test can compare what every rank holds (train.py writes rank 0's).
$NUDGE_RANK: that rank's weights made to differ from the others' by one unit in the last place before training."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402

loop = train.train


def train_and_keep(run):
    if os.environ.get("NUDGE_RANK") == str(run.proc.rank):  # a replica that drifted: one weight a bit apart
        with torch.no_grad():
            w = run.encoder.embeddings.word.weight
            w.view(-1)[7] = torch.nextafter(w.view(-1)[7], torch.tensor(float("inf")))
    loop(run)
    state = {"step": run.step, "weights": run.encoder.state_dict()}
    torch.save(state, Path(os.environ["RANK_WEIGHTS"]) / f"rank{run.proc.rank}.pt")


train.train = train_and_keep
train.main(sys.argv[1:])
