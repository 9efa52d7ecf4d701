"""
support/threads.py: torch's CPU threads. How many a process takes (the cores free when it starts, its share of them
under torchrun), and batches run several at once, a thread each, where the cores do more that way than by sharing
every operation (embed.py on a CPU).
"""
import collections
import concurrent.futures
import contextlib
import os
import time

import torch


def _cpus() -> list[int]:
    """The CPUs this process may run on: its affinity (a container's or taskset's share, not the machine's)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """How many CPUs this process may run on. More threads than these only wait on each other, and an absurd count
    (100,000) crashes OpenMP."""
    return len(_cpus())


def default_threads() -> int:
    """This rank's share of the cores that are free when it starts, at least one. torch's threads meet at a barrier
    after every operation, so one that shares its core with a busy process makes the others wait for it: on 2 cores
    beside one busy process, 2 threads ran at 0.4 of their idle speed and 1 thread at 0.6 of it; alone, 2 threads are
    1.9x 1 (all-MiniLM-L6-v2 in bf16, docs/measurements.md). A core counts as free when it was idle at least 3/4 of
    the moment measured."""
    return max(1, int(free_cores(_cpus()) + 0.25) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def free_cores(cpus, seconds: float = 0.1) -> float:
    """How many of these CPUs sat idle over the next `seconds` (this process sleeps meanwhile), by /proc/stat; all
    of them where that cannot be read (not Linux)."""
    try:
        before = _cpu_times(cpus)
        time.sleep(seconds)
        after = _cpu_times(cpus)
    except (OSError, ValueError, KeyError):
        return float(len(cpus))
    free = 0.0
    for cpu in cpus:
        idle, total = (a - b for a, b in zip(after[cpu], before[cpu], strict=True))
        free += idle / total if total > 0 else 1.0
    return free


def _cpu_times(cpus) -> dict[int, tuple[int, int]]:
    """{cpu: (idle ticks, all ticks)} since boot: /proc/stat's cpuN lines (user, nice, system, idle, iowait, irq,
    softirq, steal, ...)."""
    times = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(t) for t in ticks[:8]]
                times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return {cpu: times[cpu] for cpu in cpus}


@contextlib.contextmanager
def cpu_threads(n: int):
    """torch's CPU threads while a script runs: n, or default_threads(); as they were afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or default_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


# A batch's Python holds the GIL between its operations: a forward of 9 tokens, all Python and dispatch, is 1.7% of
# one of 2,048 on a thread (Zen 4, bf16), a few % where the products are faster. Unmeasured beyond 2 cores, so at most
# 8 items at once, well short of waiting on each other; the threads beyond go to each item's operations
AT_ONCE = 8


def across_cores(items: list, work, cpu: bool = True):
    """work(item) for each item, in order; on a CPU min(torch's threads, items, AT_ONCE) of them at once, each in a
    thread of its own with an equal share of torch's threads and the caller's grad mode, elsewhere (a GPU takes them
    one after another) or where that is one, in the caller's thread. Threads that share each operation meet at a
    barrier after it, and a layer's operations are short: on 2 cores of a Zen 4 two batches on a thread each embed
    about 5% faster than one batch on both (docs/measurements.md). torch releases the GIL inside each operation."""
    before = torch.get_num_threads()
    workers = min(before, len(items), AT_ONCE) if cpu else 1
    if workers <= 1:
        yield from map(work, items)
        return
    share, grad = max(1, before // workers), torch.is_grad_enabled()

    def run(item):
        torch.set_num_threads(share)  # a thread's own count (MKL's is the process's: put back below)
        with torch.set_grad_enabled(grad):
            return work(item)

    pool, running = concurrent.futures.ThreadPoolExecutor(workers), collections.deque()
    torch.set_num_threads(share)  # the caller's own operations on the results too: no thread waits on a busy core
    try:
        for item in items:
            running.append(pool.submit(run, item))
            if len(running) > workers:  # one waiting for each thread, no more: memory stays bounded
                yield running.popleft().result()
        while running:
            yield running.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)  # after an error or a stop: what has not started never does
        torch.set_num_threads(before)
