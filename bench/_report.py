"""
bench/_report.py: what bench/ablation.py and bench/probing.py both report with, not a script (no script imports
another): the books held out of both stages, and a figure over seeds with its paired difference.
"""
from pathlib import Path

import numpy as np


def held_out(books: list[Path], k: int) -> list[Path]:
    """--hold-out: k books kept out of both stages, whose sentences bench/probing.py probes: every (n // k)-th of the
    books sorted by name (the 5th, 10th, ... of 200 for k = 40), so that they spread over the authors."""
    if k <= 0:
        return []
    step = len(books) // k
    return books[step - 1::step][:k]


ONE_SEED = "(1 seed: no spread)"  # one seed measures no spread: not "± 0.00", which would claim one


def cell(xs) -> str:
    """The mean over the seeds ± their standard deviation."""
    return f"{np.mean(xs):.2f} ± {np.std(xs, ddof=1):.2f}" if len(xs) > 1 else f"{np.mean(xs):.2f} {ONE_SEED}"


def delta(xs, ref) -> str:
    """The paired difference xs - ref: a finding only when it is larger than its spread over the seeds and than
    either side's (a start shared by every seed has none); never with one seed."""
    d = np.subtract(xs, ref)
    if len(xs) < 2:
        return f"{np.mean(d):+.2f} {ONE_SEED}"
    spread = max(np.std(d, ddof=1), np.std(xs, ddof=1), np.std(ref, ddof=1))
    text = f"{np.mean(d):+.2f} ± {np.std(d, ddof=1):.2f}"
    return f"**{text}**" if abs(np.mean(d)) > spread else text
