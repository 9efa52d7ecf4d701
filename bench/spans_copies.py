"""
bench/spans_copies.py: how long support/chunks.py's `Spans` (train.Spans, as train.py imports it) takes to work out
a step's chunks on the host, in two trees side by side (before and after a change to it): 16-document batches of
the paper's span lengths, a tiny encoder, the CPU.

    git worktree add /tmp/old 848ebc5 && python bench/spans_copies.py /tmp/old .
"""
import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import bench  # noqa: E402

ONE_TREE = """
import sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch
import train as T
from conftest import synthetic_batch, tiny_encoder
torch.set_num_threads(1)
enc, cfg = tiny_encoder(), T.TrainConfig()
batches = [synthetic_batch(16, seed=s, anchor_len=(150, 511), positive_len=(32, 300)) for s in range(20)]
if not hasattr(T, "Spans"):  # after: support.chunks.Chunks, built as train_step builds it
    from conftest import step_chunks
    make = lambda b: step_chunks(b, enc, cfg)  # noqa: E731
elif "world" in T.Spans.__init__.__code__.co_varnames:  # before: Spans(batch, cfg, encoder, world)
    make = lambda b: T.Spans(b, cfg, enc, world=1)  # noqa: E731
else:
    make = lambda b: T.Spans(b, cfg, enc)  # noqa: E731
[make(b) for b in batches]
t = time.perf_counter()
for _ in range(10):
    [make(b) for b in batches]
print((time.perf_counter() - t) / 200 * 1e3)
"""


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, help="two trees of this repository: before and after")
    trees = ap.parse_args().trees
    times = {t: [] for t in trees}
    for _ in range(4):  # alternating, so that both trees see the same machine
        for tree in trees:
            out = subprocess.run([sys.executable, "-c", ONE_TREE, str(Path(tree).resolve()), str(ROOT / "tests")],
                                 capture_output=True, text=True, check=True).stdout
            times[tree].append(float(out))
    for tree, ms in times.items():
        print(f"{tree}: {statistics.median(ms):.2f} ms a step (range {min(ms):.2f}-{max(ms):.2f}, 4 runs)")


if __name__ == "__main__":
    main()
