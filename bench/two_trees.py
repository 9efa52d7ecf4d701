"""
Two trees of this repository side by side on this machine (before and after a change that must keep the speed):
train.py's step on spans of the paper's lengths, and embed.encode's sentences/s in fp32 and in the default dtype.
Each measurement is a process of its own importing one tree; the trees alternate, so both see the same machine.

    git worktree add /tmp/old ddf7acf && python bench/two_trees.py /tmp/old . --rounds 3
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import bench  # noqa: E402

ONE_TREE = """
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import torch
import embed, model as M, train as T
from conftest import stsb_sentences, synthetic_batch
out = {}
torch.manual_seed(0)
enc = M.Encoder(M.ModelConfig(vocab_size=1000, num_hidden_layers=6))  # distilroberta-base's shape
enc.init_weights(torch.Generator().manual_seed(0))
enc.train()
cfg, steps = T.TrainConfig(), T.ChunkedEncoder(enc)
batches = [synthetic_batch(2, vocab=1000, seed=s, anchor_len=(150, 511), positive_len=(32, 300)) for s in range(4)]
T.train_step(steps, batches[0], cfg)  # warm-up
t = time.perf_counter()
for b in batches[1:]:
    enc.zero_grad()
    T.train_step(steps, b, cfg)
out["train_step_s"] = (time.perf_counter() - t) / 3
minilm, tok = M.load_pretrained(sys.argv[3], quiet=True)
texts = stsb_sentences()
for name, dtype in (("fp32", None), ("auto", torch.bfloat16 if torch.cpu._is_avx512_bf16_supported()
                                        or torch.cpu._is_amx_tile_supported() else None)):
    embed.encode(texts[:200], minilm, tok, dtype=dtype)
    t = time.perf_counter()
    embed.encode(texts, minilm, tok, dtype=dtype)
    out[f"embed_{name}_per_s"] = len(texts) / (time.perf_counter() - t)
print(json.dumps(out))
"""


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=str(ROOT.parent / "shared/models/all-MiniLM-L6-v2"))
    a = ap.parse_args()
    results = {t: [] for t in a.trees}
    for _ in range(a.rounds):
        for tree in a.trees:
            out = subprocess.run([sys.executable, "-c", ONE_TREE, str(Path(tree).resolve()), str(ROOT / "tests"),
                                  a.model], capture_output=True, text=True, check=True).stdout
            results[tree].append(json.loads(out.splitlines()[-1]))
    print(f"| measure | {' | '.join(a.trees)} | ratio (2nd / 1st) |\n|---|---|---|---|")
    for key in results[a.trees[0]][0]:
        cells = [[r[key] for r in results[t]] for t in a.trees]
        shown = [f"{statistics.median(v):.3g} ({min(v):.3g}-{max(v):.3g})" for v in cells]
        ratio = statistics.median(cells[1]) / statistics.median(cells[0])
        print(f"| {key} | {' | '.join(shown)} | {ratio:.3f} |")
    print(f"\nmedian (range) of {a.rounds} alternating rounds, each one process per tree")


if __name__ == "__main__":
    main()
