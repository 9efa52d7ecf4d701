"""
The paper's Fig. 3 ablation at a size this machine can run: from one scratch model and one budget of training
tokens on the Gutenberg books, train with MLM only, contrastive only, and both, and score each (and the untrained
model) on STS-B dev.

    python bench/ablation.py                        # CPU, ~20 minutes on 2 cores: tiny shape, 1,500 steps per arm
    python bench/ablation.py --shape distilroberta-base --steps 3000 --max-span 512 --docs-per-step 16   # a GPU

Every arm starts from the same saved initial weights and tokenizer and sees the same batches (same seed), so the
arms differ only in which loss they train.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import evaluate_sts as E  # noqa: E402
import model as M  # noqa: E402
import sampler as S  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"), help="the shared assets folder")
    ap.add_argument("--out", default="runs/ablation", help="where the arms' runs go")
    ap.add_argument("--shape", default="tiny", help="scratch shape (model.py SHAPES)")
    ap.add_argument("--steps", type=int, default=1500, help="optimiser steps per arm")
    ap.add_argument("--docs-per-step", type=int, default=16, help="N")
    ap.add_argument("--min-span", type=int, default=16, help="l_min")
    ap.add_argument("--max-span", type=int, default=128, help="l_max")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr (a scratch model needs more than the paper's 5e-5)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    shared, out = Path(a.shared), Path(a.out)
    books = shared / "data/corpus/gutenberg"
    stsb = shared / "data/sts/stsbenchmark/sts-dev.csv"
    init = out / "init"
    if not (init / "model.safetensors").exists():
        texts = S.read_documents(S.list_files([books]), dict(empty=0, binary=0, malformed=0, files_repaired=0,
                                                                bytes_replaced=0))
        model, tok = M.from_scratch(a.shape, texts, seed=a.seed)
        M.save_pretrained(model, tok, init)
    pairs = E.load_stsb_dev(stsb)
    model, tok = M.load_pretrained(str(init), verbose=False)
    rows = [("untrained", "-", E.spearman_of(model, tok, pairs), 0.0)]
    print(f"untrained {a.shape}: STS-B dev Spearman {rows[0][2]:.2f}", flush=True)
    for arm, flags in [("MLM only", ["--no-contrastive"]), ("contrastive only", ["--no-mlm"]), ("both", [])]:
        run = out / arm.replace(" ", "-")
        t = time.time()
        cmd = [sys.executable, str(ROOT / "train.py"), "--model", str(init), "--data", str(books), "--out", str(run),
               "--overwrite", "--steps", str(a.steps), "--docs-per-step", str(a.docs_per_step), "--min-span",
               str(a.min_span), "--max-span", str(a.max_span), "--lr", str(a.lr), "--seed", str(a.seed),
               "--ckpt-every", str(a.steps), "--log-every", str(max(1, a.steps // 5)), *flags]
        subprocess.run(cmd, check=True)
        model, tok = M.load_pretrained(str(run / "model"), verbose=False)
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rows.append((arm, f"{recs[-1]['contrastive']:.3f} / {recs[-1]['mlm']:.3f}", E.spearman_of(model, tok, pairs),
                     time.time() - t))
        print(f"{arm}: STS-B dev Spearman {rows[-1][2]:.2f} ({rows[-1][3]:.0f}s)", flush=True)
    print(f"\n{a.shape} scratch model, {a.steps} steps of N={a.docs_per_step} Gutenberg documents, spans "
          f"{a.min_span}-{a.max_span} tokens, lr {a.lr}, seed {a.seed}\n")
    print("| training | final contrastive / MLM loss | STS-B dev Spearman x 100 | minutes |")
    print("|---|---|---|---|")
    for arm, losses, sp, sec in rows:
        print(f"| {arm} | {losses} | {sp:.2f} | {sec / 60:.1f} |")


if __name__ == "__main__":
    main()
