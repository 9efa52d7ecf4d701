"""
support/workers.py: the DataLoader worker processes that prepare a run's batches ahead of its steps, made so that
they can never outlive the run nor keep it from ending, however it ends. support/training.py calls it; a reader of
the method can skip it.

A worker is a fork of the training process, so it holds copies of everything that process had open: the run
folder's lock, the process group's sockets, the pipe its own batches go through. Three rules follow:
- Ctrl-C and SIGTERM reach every process of the group (a terminal, SLURM and torchrun all signal the group): the
  workers ignore both, and the training process, which decides how the run ends, stops them itself.
- A worker dies with the process that made it (Linux: the kernel's parent-death signal; elsewhere a thread that
  watches for it): after kill -9 of the training process, or of one rank, no worker is left holding its lock or
  its sockets, so the folder can be resumed at once and the other ranks see the connection reset.
- Stopping them is bounded: DataLoader's own shutdown first, then SIGKILL for any still there after a few seconds
  (a worker whose batch is stuck in a full pipe cannot be joined).
"""
import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time

import torch

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def prefetched_batches(dataset, indices: range, workers: int, ahead: int = 4):
    """dataset[i] for each i of `indices`, in order: in this process (workers=0), or prepared by `workers` processes,
    `ahead` batches each in advance. Iterate it; close() it when the run ends, whichever way."""
    if not workers:
        return (batch for batch in torch.utils.data.DataLoader(dataset, batch_size=None, sampler=indices))
    return Workers(dataset, indices, workers, ahead)


class Workers:
    """The batches of worker processes. A batch comes over as numpy copies through the pipe: a tensor would go as a
    file descriptor served by a thread of the worker, which prints a traceback when the training process is cut
    off in the middle of taking it."""

    def __init__(self, dataset, indices: range, workers: int, ahead: int):
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=indices, num_workers=workers,
                                             prefetch_factor=ahead, collate_fn=_arrays,
                                             worker_init_fn=functools.partial(_start_worker, os.getpid()))
        self.iterator = iter(loader)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return {k: torch.from_numpy(v) for k, v in next(self.iterator).items()}

    def close(self, wait_s: float = 5.0):
        """Every worker ended within about wait_s seconds. The DataLoader's own shutdown asks each to stop and
        forgets its pid (its SIGCHLD handler would otherwise call a killed worker a failure); any still alive is
        killed."""
        iterator, self.iterator = self.iterator, None
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        end_children(wait_s)


def end_children(wait_s: float):
    """The multiprocessing children of this process joined, each killed that is still alive after wait_s in all."""
    deadline = time.monotonic() + wait_s
    for child in multiprocessing.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            child.kill()
            child.join()


def _arrays(batch: dict) -> dict:
    return {k: v.numpy() for k, v in batch.items()}


def _start_worker(parent: int, worker_id: int):
    """A worker's first act: leave Ctrl-C and SIGTERM to the training process, and die when it does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with(parent)


def die_with(parent: int):
    """End this process the moment `parent` (the process that forked it) ends. On Linux the kernel sends SIGKILL
    (prctl's PR_SET_PDEATHSIG, which no blocked pipe or held lock can delay); elsewhere a thread checks twice a
    second. If the parent is gone already, the process ends now."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the kernel was told
        os._exit(1)


def _watch(parent: int):
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
