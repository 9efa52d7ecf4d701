"""Run by tests/test_gpu_path.py under torchrun: train.py, with the corpus's tokenisation made SLOW_PREPARE_SECONDS
slower, so that preparing the data takes longer than the run's --ddp-timeout (as OpenWebText's does NCCL's ten
minutes). The run must finish all the same: no collective may wait while the corpus is prepared."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from support import corpus  # noqa: E402

tokenise = corpus._tokenise


def slow_tokenise(*args, **kwargs):
    time.sleep(float(os.environ["SLOW_PREPARE_SECONDS"]))
    return tokenise(*args, **kwargs)


corpus._tokenise = slow_tokenise
train.main(sys.argv[1:])
