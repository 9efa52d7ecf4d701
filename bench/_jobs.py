"""
bench/_jobs.py: a bench script's runs a few at a time, each a process of its own (bench/domain.py's arms and seeds,
bench/peers.py's peers and seeds). What a run leaves once it ends well is the script's to read; a run that fails
ends the script with its log's last line.
"""
import time
from pathlib import Path

from support.cli import UserError


def run_all(todo: list[str], start, finished, jobs: int):
    """Each run named in `todo`, `jobs` at a time, in that order: start(name) -> (its log: Path, its Popen);
    finished(name, seconds) once it ended well. A failed run raises a UserError with its log's last line; the runs
    still going are then left to end on their own, as a finished run is kept either way."""
    todo, running = list(todo), []
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            running.append((name, time.time(), *start(name)))
        time.sleep(2)
        for job in [j for j in running if j[3].poll() is not None]:
            running.remove(job)
            name, t0, log, proc = job
            if proc.returncode:
                lines = Path(log).read_text(errors="replace").strip().splitlines() or ["no output"]
                raise UserError(f"{name} failed: {lines[-1]} (the whole log: {log})")
            finished(name, time.time() - t0)
