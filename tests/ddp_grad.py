"""Run by tests/test_train.py under torchrun: each rank takes its share of the documents of one batch and runs
train_step through DistributedDataParallel, as train.py does; rank 0 writes the resulting gradient of every
configuration, which must equal that of one process holding the whole batch. Each configuration runs two steps:
DDP reports a parameter left out of a step's reduction (or hangs) only at the next one."""
import gc
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # the repo, tests/
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import train as T  # noqa: E402
from conftest import DDP_BATCH, DDP_CONFIGS, half_batch, synthetic_batch, tiny_encoder  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
batch = half_batch(synthetic_batch(**DDP_BATCH), rank, world)
out = {}
for name, kw in DDP_CONFIGS.items():
    model = tiny_encoder()
    cfg = T.TrainConfig(chunk_tokens=120, **kw)
    net = DDP(T.ChunkedEncoder(model), find_unused_parameters=not cfg.mlm)  # as train.setup() builds it
    for step in range(2):
        model.zero_grad(set_to_none=True)
        T.train_step(net, batch, cfg, world)
        out[name, step] = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                           for n, p in model.named_parameters()}
if rank == 0:
    torch.save(out, os.environ["DDP_GRAD_OUT"])
del net  # DDP holds the process group: freed at exit, after Python's teardown, it aborts the process
gc.collect()
dist.barrier()
dist.destroy_process_group()
