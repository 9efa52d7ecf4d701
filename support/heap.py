"""
support/heap.py: a CPU training run's memory held near what a step needs, where tcmalloc is the process's malloc.

A step's spans differ in length from step to step (sampler.py), so its activations come in new sizes each time.
tcmalloc (LD_PRELOAD=libtcmalloc_minimal.so.4, as the README's CPU commands start train.py) keeps a freed block for the
next request of its size, which holds a run near flat where glibc's heap grows step by step, but its free spans still
fragment: now and then a request none of them fits takes pages anew, and over 1,000 steps a run came to hold 1.27x what
its step needed on its own (1.21x with the hand-backs below: docs/measurements.md#memory). Handing tcmalloc's free
pages back to the kernel after every step costs 46% a step (each step takes its pages afresh); after a step that leaves
the process holding more than MARGIN times what it held after the first step since the last hand-back, it costs one
step's first touches now and then. Nothing is done on glibc's or jemalloc's malloc, or on a GPU.
"""
import ctypes
from pathlib import Path

MARGIN = 1.1  # a hand-back after a step that leaves more than this times what a fresh step left


def tcmalloc_release():
    """tcmalloc's MallocExtension_ReleaseFreeMemory where tcmalloc is this process's malloc (LD_PRELOAD'ed), else
    None."""
    try:
        return ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory
    except (AttributeError, OSError):
        return None


def anonymous_bytes(status_file: str = "/proc/self/status") -> int:
    """The process's resident anonymous memory (its heap, not the files it maps), 0 where /proc can't tell."""
    try:
        with open(status_file) as f:
            return next((int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


class HeldNearStep:
    """After each step: what the process holds, against what it held after the first step since the last hand-back
    (`fresh`); past MARGIN times that, tcmalloc's free pages go back to the kernel and the next step measures afresh.
    `release` None: nothing to do (not tcmalloc)."""

    def __init__(self, release=None, margin: float = MARGIN, measure=None):
        self.release, self.margin, self.measure = release, margin, measure or anonymous_bytes
        self.fresh = 0  # bytes held after the first step since the start or the last hand-back; 0: not measured yet
        self.releases = 0

    @classmethod
    def for_device(cls, device):
        return cls(tcmalloc_release() if device.type == "cpu" and Path("/proc/self/status").exists() else None)

    def after_step(self):
        if self.release is None:
            return
        held = self.measure()
        if not self.fresh:
            self.fresh = held
        elif held > self.margin * self.fresh:
            self.release()
            self.fresh, self.releases = 0, self.releases + 1
