"""Run by tests/test_train.py under torchrun: each rank takes half the documents of one batch, and rank 0
writes the averaged gradient, which must equal that of one process holding the whole batch."""
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # the repo, tests/
import train as T  # noqa: E402
from conftest import half_batch, synthetic_batch, tiny_encoder  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = {}
for grad_cache in (False, True):
    model = tiny_encoder()
    cfg = T.TrainConfig(grad_cache=grad_cache, chunk_tokens=120)
    T.train_step(model, half_batch(synthetic_batch(8), rank, world), cfg, world)
    T.average_gradients(model, world)
    out[grad_cache] = {n: p.grad.clone() for n, p in model.named_parameters()}
if rank == 0:
    torch.save(out, os.environ["DDP_GRAD_OUT"])
dist.destroy_process_group()
