"""Run by tests/test_gpu_path.py under torchrun: train.py twice in each rank, first eager DistributedDataParallel (the
arguments before `--then`), then with --compile inside it (those after), the compiler's backend $COMPILE_BACKEND
(aot_eager: dynamo and AOTAutograd as inductor gets them, without its code generation), and
torch._dynamo.config.optimize_ddp as train.py sets it. Each rank writes what dynamo built and its weights to
$RANK_WEIGHTS/{eager,compiled}/rank{R}.pt. Both runs in one launch: each launch spends about 5 s starting; the second
run's processes meet under a prefix of their own in torchrun's store, as a restart's do."""
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch._dynamo.backends.distributed import DDPOptimizer  # noqa: E402

import train  # noqa: E402
from support import processes  # noqa: E402
from support.device import compiled_graphs  # noqa: E402

torch.compile = functools.partial(torch.compile, backend=os.environ.get("COMPILE_BACKEND", "aot_eager"))
# DDP's buckets small enough that the tiny model's gradients fill several, as a real model's fill DDP's 25 MB ones:
# dynamo's DDPOptimizer then cuts the compiled graph at the buckets' edges
cap_mb = float(os.environ.get("BUCKET_CAP_MB", "0.05"))


class SmallBuckets(train.DDP):  # the DDP train.setup() builds, with those buckets
    def __init__(self, *args, **kwargs):
        super().__init__(*args, bucket_cap_mb=cap_mb, **kwargs)


train.DDP = SmallBuckets
torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = int(cap_mb * 2**20)  # DDPOptimizer's first bucket, DDP's 1 MiB
splits = []
compile_fn = DDPOptimizer.compile_fn


def counting_compile_fn(self, gm, example_inputs, **kw):
    out = compile_fn(self, gm, example_inputs, **kw)
    splits.append(len(self.buckets))
    return out


DDPOptimizer.compile_fn = counting_compile_fn
loop = train.train


def train_and_keep(run):
    import torch._dynamo as dynamo

    loop(run)
    graphs, gave_up = compiled_graphs()
    state = {"step": run.step, "weights": run.encoder.state_dict(), "graphs": graphs, "gave_up": gave_up,
             "graph_breaks": sum(dynamo.utils.counters["graph_break"].values()),
             "optimize_ddp": str(dynamo.config.optimize_ddp), "splits": splits}
    torch.save(state, KEPT / f"rank{run.proc.rank}.pt")


def own_prefix(rendezvous):
    return lambda rank, world: torch.distributed.PrefixStore("compiled", rendezvous(rank, world))


train.train = train_and_keep
cut = sys.argv.index("--then")
for KEPT, args in ((Path(os.environ["RANK_WEIGHTS"]) / "eager", sys.argv[1:cut]),
                   (Path(os.environ["RANK_WEIGHTS"]) / "compiled", sys.argv[cut + 1:])):
    KEPT.mkdir(parents=True, exist_ok=True)
    train.main(args)
    processes.rendezvous = own_prefix(processes.rendezvous)
