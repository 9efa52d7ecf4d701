"""
support/stopping.py: how a training run stops, which train.py calls and a reader of the method can skip. Ctrl-C,
SIGTERM (a scheduler's notice: the step under way ends and is checkpointed, on every rank alike), out of memory, a
rank gone, a loss that is not finite: each ends the run with one line from the rank that knows, naming the
checkpoint to go on from and the command that does.
"""
import contextlib
import gc
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from support.cli import UserError, first_line, say
from support.runs import last_checkpoint, layout, release_run_folders, resume_command


class Terminated(Exception):
    """SIGTERM: what SLURM, Kubernetes and `timeout` send a job they are about to stop."""


class StopOnSigterm:
    """SIGTERM handled as Ctrl-C is, but using the grace period a scheduler gives: in training, the step under way
    ends, every rank agrees to stop after it, and it is checkpointed; before training and during an evaluation, the
    run stops at once (an evaluation can take longer than a scheduler's grace, and changes no weight)."""

    def __init__(self):
        self.asked = self.training = False

    def __call__(self, signum, frame):
        if not self.training:
            raise Terminated
        self.asked = True

    @contextlib.contextmanager
    def at_once(self):
        """An evaluation: a SIGTERM stops it where it is, on every rank (each is sent one; one that waits inside a
        collective for another is ended by watch_set_up's thread within its grace), the last checkpoint as it was."""
        if self.asked:  # the signal came during the step before: the run stops now
            raise Terminated
        training, self.training = self.training, False
        try:
            yield
        finally:
            self.training = training


class Life:
    """The SIGTERM handler lifetime() installs, and the run it stops once watch() hands the handler to it."""

    def __init__(self):
        self.run, self.stop, self.ending = None, StopOnSigterm(), False

    def watch(self, run):
        self.run, run.stop = run, self.stop
        return run


@contextlib.contextmanager
def lifetime():
    """What train.py's main runs inside: SIGTERM handled as StopOnSigterm says, Ctrl-C and SIGTERM made their one
    line, and on the way out, however it goes, the run folder released and the process group destroyed. Yields the
    Life whose watch() main hands its run to."""
    life = Life()
    handled = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
    previous = signal.signal(signal.SIGTERM, life.stop) if handled else None
    watching = watch_set_up(life) if handled else None
    try:
        yield life
    except (KeyboardInterrupt, Terminated) as e:  # Ctrl-C, SIGTERM: one line, the checkpoint to resume from
        life.ending = True
        raise stopped(life.run, isinstance(e, Terminated)) from None
    except RuntimeError as e:  # a collective outside a step (setup, the last barrier) whose peer is gone
        if not peer_gone(e):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise UserError(f"rank {rank}: another rank stopped ({first_line(e)}); last checkpoint: "
                        f"{last_checkpoint(life.run) if life.run else 'none yet'}", alone=True) from None
    finally:
        life.ending = True
        if life.run is not None:  # its workers ended now, in a bounded time, and DDP let go of (below)
            life.run.close()
        if handled:  # torchrun's SIGTERM to the others when one rank fails must not end this one before its line
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        release_run_folders()
        if dist.is_initialized():
            gc.collect()  # the DDP that run.close() let go of, which holds the process group (freed at exit, it aborts)
            dist.destroy_process_group()
        if handled:
            signal.signal(signal.SIGTERM, previous)
            watching()


def watch_set_up(life: Life, grace: float = 3.0):
    """Ctrl-C or SIGTERM before training while the main thread waits inside a C call (the process group's set-up
    waiting for a rank that died, torchrun's store): Python runs a handler only between the main thread's bytecodes,
    so the process would sit there, deaf, until torchrun kills it 30 s later. The C handler writes the signal to
    Python's wakeup fd at once, where a thread of ours reads it; if the main thread has not begun to end `grace` seconds
    later, the thread says the run's one line and ends the process, as the signal's default would (before training
    there is nothing to save). Returns what puts things back."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    before = signal.set_wakeup_fd(write, warn_on_full_buffer=False)

    def watch():
        while data := os.read(read, 64):  # empty once the write end is closed
            if (signal.SIGINT in data or signal.SIGTERM in data) and not life.stop.training:
                deadline = time.time() + grace
                while not life.ending and time.time() < deadline:
                    time.sleep(0.05)
                if not life.ending:
                    e = stopped(life.run, signal.SIGTERM in data)
                    say(f"error: {e}", file=sys.stderr, every_machine=True)
                    os._exit(e.code)
        os.close(read)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()

    def put_back():
        signal.set_wakeup_fd(before)
        os.close(write)
        thread.join(timeout=5)  # ended before the interpreter is: a thread it stops midway can abort the process

    return put_back


def stopped(run, sigterm: bool) -> UserError:
    """Ctrl-C (exit 130) or SIGTERM (exit 143, as a shell reports them; the step it came in was finished and
    checkpointed): where the run stopped, and how to go on."""
    what, code = ("terminated (SIGTERM)", 143) if sigterm else ("interrupted", 130)
    if run is None:
        return UserError(f"{what} before training began", code)
    go_on = resume_command(run.out, **layout(run.proc.world))
    hint = f" (continue with: {go_on})" if run.latest_checkpoint else ""
    return UserError(f"{what} after step {run.step}; last checkpoint: {last_checkpoint(run)}{hint}", code)


@contextlib.contextmanager
def failures_are_one_line(run):
    """A step that does not fit on the GPU stops the run with the way out, the last checkpoint as it was; a rank that
    is gone (killed, or out of memory) stops the others at their next collective. Each said by the rank that meets it,
    whichever that is."""
    try:
        yield
    except torch.OutOfMemoryError:
        cfg = run.cfg
        fix = f"--chunk-tokens {max(512, cfg.chunk_tokens // 4)}" if cfg.grad_cache else \
            "--grad-cache --chunk-tokens 4096"
        per_rank = cfg.docs_per_step // run.proc.world
        raise UserError(f"out of memory on {run.proc.device} in step {run.step + 1} ({per_rank} documents on this "
                        f"rank): pass {fix} (the same gradient, less memory), or give each GPU fewer "
                        f"documents (more GPUs, or a smaller --docs-per-step); last checkpoint: "
                        f"{last_checkpoint(run)}", alone=True) from None
    except RuntimeError as e:
        if run.proc.world == 1 or not peer_gone(e):
            raise
        raise UserError(f"rank {run.proc.rank}: another rank stopped after step {run.step} ({first_line(e)}); "
                        f"last checkpoint: {last_checkpoint(run)}", alone=True) from None


def peer_gone(e: RuntimeError) -> bool:
    """Whether a collective failed because another rank is gone: NCCL's errors are DistErrors, gloo's plain
    RuntimeErrors that name gloo's source."""
    return dist.is_available() and (isinstance(e, dist.DistError) or "gloo" in str(e))


def check_finite(run, loss: float, step: int):
    if not math.isfinite(loss):
        raise UserError(f"loss is {loss} at step {step}; last good checkpoint: {last_checkpoint(run)}")


def agreed_stop(run, device) -> torch.Tensor:
    """1 where any rank was sent SIGTERM during this step, on every rank: all of them stop after the same step."""
    stop = torch.full((), float(run.stop.asked), device=device)
    if run.proc.world > 1:
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    return stop
