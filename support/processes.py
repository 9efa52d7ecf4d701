"""
support/processes.py: the processes of a run, as torchrun starts them or one plain process. They meet in torchrun's
key-value store before any process group exists, so that what can take hours (training a tokenizer, tokenising the
corpus) is made once while the others wait without a time limit; the process group comes after, its collectives
waiting at most --ddp-timeout.
"""
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from support.cli import UserError, first_line, say
from support.corpus import Corpus, also_in, held_out, prepare_corpus
from support.device import pick_device


@dataclass
class Process:
    """This process among torchrun's: its ranks, its device, and the store where the processes meet."""
    rank: int
    local: int  # rank on this machine
    world: int
    device: torch.device
    store: object = None  # None for one process
    node: str = "0"  # torchrun's GROUP_RANK: which machine

    @property
    def device_ids(self) -> list[int] | None:
        """DDP's device_ids: this rank's GPU by its index (NCCL wants one), or None on a CPU."""
        return [self.device.index] if self.device.type == "cuda" else None


def processes() -> Process:
    """This process as torchrun started it, or one plain process. One GPU per process; no process group yet."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world, device = int(os.environ.get("WORLD_SIZE", "1")), torch.device("cpu")
    if torch.cuda.is_available():
        gpus, here = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if here > gpus:  # every rank of the machine says so; its first process prints it
            raise UserError(f"{here} processes on this machine but {gpus} GPU(s): start one process per GPU "
                            f"(torchrun --nproc_per_node={gpus})", code=2)
        device = pick_device(f"cuda:{local}")
        torch.cuda.set_device(device)
    return Process(rank, local, world, device, rendezvous(rank, world), os.environ.get("GROUP_RANK", "0"))


def rendezvous(rank: int, world: int):
    """The key-value store where torchrun's processes meet, before any process group exists; None for one process."""
    if world == 1:
        return None
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(minutes=10)))
    # torchrun's agent keeps its store across --max-restarts rounds: a prefix per round keeps restarted workers from
    # reading what the workers before them published
    return dist.PrefixStore(f"declutr/round-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_process_group(proc: Process, timeout_s: int):
    """NCCL on GPUs, gloo on CPUs, for processes that met in a store (torchrun's; none for one plain process); a
    collective that waits longer than timeout_s for another rank stops the job. The GPU is named with its index, as
    NCCL's process group must be bound to one device (processes() sets it)."""
    if proc.store is not None:
        cuda = proc.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=proc.store, rank=proc.rank, world_size=proc.world,
                                timeout=timedelta(seconds=timeout_s), device_id=proc.device if cuda else None)


def made_once(proc: Process, key: str, make, per_machine: bool = False) -> str:
    """make() (a string) by rank 0, or with per_machine by the first process of each machine; the others wait for
    it in the store, however long it takes: training a tokenizer or tokenising a corpus can take hours, longer than
    any collective may wait, so no process group exists yet. The maker's UserError is raised on every process that
    waits."""
    key, maker = (f"{key}/{proc.node}", proc.local == 0) if per_machine else (key, proc.rank == 0)
    if proc.store is None:
        return make()
    if maker:
        try:
            value = make()
        except UserError as e:
            proc.store.set(key, f"error:{e.code}:{e}")
            raise
        proc.store.set(key, "value:" + value)
        return value
    kind, value = _wait(proc.store, key).split(":", 1)
    if kind == "error":
        code, message = value.split(":", 1)
        raise UserError(message, int(code))
    return value


def every_rank_says(proc: Process, key: str, what: str) -> list[str]:
    """Every rank's `what`, in rank order, on every rank: each waits until all have said theirs."""
    if proc.store is None:
        return [what]
    proc.store.set(f"{key}/{proc.rank}", what)
    return [_wait(proc.store, f"{key}/{r}", f"rank {r}, saying its {key},") for r in range(proc.world)]


def _wait(store, key: str, who: str = "") -> str:
    try:
        store.wait([key], timedelta(days=7))
    except dist.DistError as e:
        raise UserError(f"{who or f'the process preparing {key}'} stopped before it was done "
                        f"({first_line(e)})") from None
    return store.get(key).decode()


def corpus_for_run(cfg, tok, proc: Process, paths=None, key: str = "corpus") -> Corpus:
    """The run's documents (or `paths`, tokenised alike: --eval-docs), tokenised by one process per machine into its
    cache; the others then read it."""
    clean = not cfg.keep_whitespace
    return Corpus(Path(made_once(proc, key, lambda: str(prepare_corpus(
        paths or cfg.data, tok, cfg.cache_dir, clean=clean, field=cfg.text_field).dir), per_machine=True)))


class EvalDocuments(NamedTuple):
    """Held-out span retrieval's documents (train.py --holdout-docs, --eval-docs)."""
    corpus: Corpus
    docs: np.ndarray  # which of its documents the pairs are drawn from
    held_out: np.ndarray  # which of the run's documents are kept out of training
    flag: str  # the flag that gave them, to start a line about them
    below: float | None = None  # --holdout-docs: the point the held-out documents lie below (corpus.held_out)


def eval_documents(cfg, tok, proc: Process, corpus: Corpus, resumed: dict | None = None) -> EvalDocuments | None:
    """--holdout-docs: a share of the run's own documents, chosen by their content, the same on every rank and on
    resume (`resumed`: the checkpoint's state; a run begun before issue 81 holds out what lay below the share, one
    begun before issue 78 the documents it chose by their place); --eval-docs: other files, tokenised as the run's
    are, a document that is also a training document said, counted and left out."""
    if cfg.holdout_docs:
        by_place = resumed is not None and resumed.get("held_out_by") != "content"
        below = resumed.get("held_out_below", cfg.holdout_docs) if resumed and not by_place else None
        docs, below = held_out(corpus, cfg.holdout_docs, by_place=by_place, below=below)
        return EvalDocuments(corpus, docs, docs, f"--holdout-docs {cfg.holdout_docs}", below)
    if not cfg.eval_docs:
        return None
    other = corpus_for_run(cfg, tok, proc, cfg.eval_docs, "eval-docs")
    if len(other) == 0:
        raise UserError(f"--eval-docs {' '.join(cfg.eval_docs)}: no documents in them ({other.meta['summary']})")
    shared = also_in(other, corpus)
    if len(shared) == len(other):
        raise UserError(f"--eval-docs {' '.join(cfg.eval_docs)}: every one of its {len(other):,} documents is also a "
                        f"training document (--data), and held-out retrieval needs documents the run never trains "
                        f"on: name others, or keep a share of --data out with --holdout-docs")
    if len(shared) and proc.rank == 0:
        say(f"--eval-docs: {len(shared):,} of its {len(other):,} documents are also training documents; left out of "
            f"the evaluation", file=sys.stderr)
    return EvalDocuments(other, np.setdiff1d(np.arange(len(other)), shared), np.zeros(0, dtype=np.int64),
                         f"--eval-docs {' '.join(cfg.eval_docs)}")


def gather_rows(rows: np.ndarray) -> np.ndarray:
    """Every rank's rows, in rank order, on every rank (an evaluation each process did a part of)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, rows)
    return np.concatenate(parts)


def same_weights(model, opt, step: int) -> list[str]:
    """DDP assumes every rank holds the same weights and never checks: on a CPU a rank's update can round otherwise
    (issue 78 saw one rank's word embeddings a unit in the last place off another's after a step from equal states).
    A checksum of each parameter on each rank, exact (its bits summed as integers), gathered in one collective; the
    ranks that differ from rank 0 said in one line, and rank 0's weights and optimizer state broadcast to every rank,
    so that a long run cannot drift. Returns the names of the parameters that differed (on every rank alike)."""
    params = list(model.named_parameters())
    sums = torch.stack([bits_sum(p.detach()) for _, p in params])  # (parameters,)
    every = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(every, sums)
    apart = [r for r in range(1, len(every)) if not torch.equal(every[r], every[0])]
    if not apart:
        return []
    differ = sorted({params[i][0] for r in apart for i in torch.nonzero(every[r] != every[0]).flatten().tolist()})
    say(f"warning: step {step}: rank(s) {', '.join(map(str, apart))} held weights that differed from rank 0's "
        f"({len(differ)} parameter(s), the first {differ[0]}); rank 0's weights and optimizer state now on every rank",
        file=sys.stderr)
    with torch.no_grad():
        for _, p in params:
            dist.broadcast(p.data, src=0)
            for value in opt.state.get(p, {}).values():
                if torch.is_tensor(value):
                    dist.broadcast(value, src=0)
    return differ


def bits_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of a tensor's bits read as integers (int64, wrapping): equal tensors give equal sums, whatever order
    the sum runs in; one bit apart, unequal."""
    flat = t.contiguous().flatten()
    ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    return ints.to(torch.int64).sum()
