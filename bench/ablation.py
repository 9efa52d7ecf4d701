"""
The paper's ablations in miniature, with error bars: Fig. 3 (which objective: MLM, contrastive, both) and Fig. 2
(which positive view: all, overlap, adjacent, subsumed; how many anchors A and positives P), each arm trained from
the same scratch model on the same batches for each of several seeds, scored on STS-B dev, and reported as
mean ± standard deviation over the seeds beside the untrained model and the lexical floor (the mean of random word
vectors, scored on the same pairs).

    python bench/ablation.py                                   # CPU: tiny shape, 3 seeds, all arms, ~1.7 h on 2 cores
    python bench/ablation.py --arms both mlm-only contrastive-only --seeds 5
    python bench/ablation.py --model distilroberta-base --steps 3000 --max-span 512 --min-span 32 --lr 5e-5 \\
        --eval-every 500 --jobs 1 --data openwebtext/          # the paper's scale, on a GPU

For each seed, one initial model (the seed's weights, one BPE tokenizer for all) is saved, or with --model the same
pretrained encoder serves every seed, and every arm of that seed starts from it with that seed's batches (train.py
--seed), so that arms differ only in what they ablate. The tables go to OUT/ablation.md and, with matplotlib
installed, STS-B dev against steps to bench/ablation.png. Finished runs are kept (and their times, in
OUT/seconds.json): running the script again continues where it stopped.
"""
import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import common  # noqa: E402
import evaluate_sts as E  # noqa: E402
import hub as H  # noqa: E402
import model as M  # noqa: E402

# Each arm: the train.py flags that set it apart from "both" (the paper's DeCLUTR: both objectives, every view,
# A = P = 2), and the figure whose table it belongs to.
ARMS = {
    "both": ([], "all"),
    "mlm-only": (["--no-contrastive"], "Fig. 3: objective"),
    "contrastive-only": (["--no-mlm"], "Fig. 3: objective"),
    "view-overlap": (["--positive-view", "overlap"], "Fig. 2: positive view"),
    "view-adjacent": (["--positive-view", "adjacent"], "Fig. 2: positive view"),
    "view-subsumed": (["--positive-view", "subsumed"], "Fig. 2: positive view"),
    "A1": (["--num-anchors", "1"], "Fig. 2: anchors A"),
    "A4": (["--num-anchors", "4"], "Fig. 2: anchors A"),
    "P1": (["--num-positives", "1"], "Fig. 2: positives P"),
    "P4": (["--num-positives", "4"], "Fig. 2: positives P"),
}
TABLES = {"Fig. 3: objective": ["mlm-only", "contrastive-only", "both"],
          "Fig. 2: positive view": ["both", "view-overlap", "view-adjacent", "view-subsumed"],
          "Fig. 2: anchors A": ["A1", "both", "A4"],
          "Fig. 2: positives P": ["P1", "both", "P4"]}
LABELS = {"both": "both (DeCLUTR: all views, A = P = 2)", "view-overlap": "overlap", "view-adjacent": "adjacent",
          "view-subsumed": "subsumed", "A1": "A = 1", "A4": "A = 4", "P1": "P = 1", "P4": "P = 4",
          "mlm-only": "MLM only", "contrastive-only": "contrastive only"}


def lexical_floor(pairs, seed: int, dim: int = 300) -> float:
    """STS-B dev Spearman of the mean of random word vectors: what word overlap alone scores."""
    a, b, gold = pairs
    rng, vectors = np.random.default_rng(seed), {}

    def embed(sentence):
        words = re.findall(r"\w+", sentence.lower()) or [""]
        for w in words:
            if w not in vectors:
                vectors[w] = rng.standard_normal(dim)
        v = np.mean([vectors[w] for w in words], axis=0)
        return v / np.linalg.norm(v)

    cos = (np.array([embed(x) for x in a]) * np.array([embed(y) for y in b])).sum(1)
    return 100 * E.spearman(cos, gold)


def initial_models(a, out: Path) -> dict[int, str]:
    """--model for every seed (a pretrained encoder: seeds differ in batches, masks and dropout), else one saved
    scratch model per seed, all with one byte-level BPE trained on the documents."""
    if a.model:
        return {s: a.model for s in a.seeds}
    inits = {s: out / f"init-seed{s}" for s in a.seeds}
    if all((d / "model.safetensors").exists() for d in inits.values()):
        return inits
    tok = H.train_tokenizer(common.document_texts(a.data), M.SHAPES[a.shape]["vocab_size"])
    for s, d in inits.items():
        M.save_pretrained(M.scratch_encoder(a.shape, tok.get_vocab_size(), seed=s), tok, d)
    return inits


def run_arms(a, out: Path, inits: dict[int, Path]):
    """Every (arm, seed) not yet finished, --jobs at a time, one CPU thread each when several run together."""
    todo = [(arm, s) for s in a.seeds for arm in a.arms if not (out / f"{arm}-seed{s}" / "model").exists()]
    running = []
    while todo or running:
        while todo and len(running) < a.jobs:
            arm, s = todo.pop(0)
            cmd = [sys.executable, str(ROOT / "train.py"), "--model", str(inits[s]), "--data", *a.data,
                   "--out", str(out / f"{arm}-seed{s}"), "--overwrite", "--seed", str(s), "--steps", str(a.steps),
                   "--docs-per-step", str(a.docs_per_step), "--min-span", str(a.min_span),
                   "--max-span", str(a.max_span), "--lr", str(a.lr), "--eval-data", a.stsb,
                   "--eval-every", str(a.eval_every), "--ckpt-every", str(a.steps), "--log-every", str(a.steps),
                   "--cache-dir", str(out / "cache"), *(["--threads", "1"] if a.jobs > 1 else []), *ARMS[arm][0]]
            log = open(out / f"{arm}-seed{s}.log", "w")
            running.append((arm, s, time.time(), subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        time.sleep(1)
        for job in [j for j in running if j[3].poll() is not None]:
            running.remove(job)
            arm, s, t0, p = job
            if p.returncode:
                sys.exit(f"{arm} seed {s} failed; see {out / f'{arm}-seed{s}.log'}")
            took = {**run_seconds(out), f"{arm}-seed{s}": round(time.time() - t0)}
            (out / "seconds.json").write_text(json.dumps(took, indent=1))  # the total, over every invocation
            print(f"{arm} seed {s}: STS-B dev {curve(out, arm, s)[-1][1]:.2f} ({time.time() - t0:.0f}s)", flush=True)


def run_seconds(out: Path) -> dict[str, int]:
    """How long each finished run took, over every invocation of the script."""
    return json.loads((out / "seconds.json").read_text()) if (out / "seconds.json").exists() else {}


def curve(out: Path, arm: str, seed: int) -> list[tuple[int, float]]:
    """(step, STS-B dev Spearman) of one run, from its metrics.jsonl."""
    recs = [json.loads(line) for line in (out / f"{arm}-seed{seed}" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["stsb_dev_spearman"]) for r in recs if r.get("stsb_dev_spearman") is not None]


def panels(a) -> dict[str, list[str]]:
    """The figures this run's arms fill: each with its arms that ran, and none where "both" would be alone."""
    filled = {title: [arm for arm in arms if arm in a.arms] for title, arms in TABLES.items()}
    filled = {title: arms for title, arms in filled.items() if set(arms) - {"both"}}
    return filled or {"DeCLUTR": ["both"]}


def tables(a, out: Path, untrained: list[float], floor: list[float]) -> str:
    """The Markdown report: one table per figure with each arm's mean ± std over seeds, its paired differences (same
    seed, so same initial weights and batches) to the untrained model and to "both", and the seeds' own scores."""
    def cell(xs):
        return f"{np.mean(xs):.2f} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0:.2f}"

    def delta(xs, ref):
        # A difference is a finding only when it is larger than its spread over the seeds and than either arm's.
        d = np.subtract(xs, ref)
        spread = max(np.std(d, ddof=1), np.std(xs, ddof=1), np.std(ref, ddof=1)) if len(xs) > 1 else np.inf
        text = f"{np.mean(d):+.2f} ± {np.std(d, ddof=1) if len(xs) > 1 else 0:.2f}"
        return f"**{text}**" if abs(np.mean(d)) > spread else text

    both = [curve(out, "both", s)[-1][1] for s in a.seeds] if "both" in a.arms else None
    start = a.model if a.model else f"{a.shape} scratch model"
    lines = [f"{start}, {a.steps} steps of N={a.docs_per_step} documents, spans {a.min_span}-"
             f"{a.max_span} tokens, lr {a.lr}, seeds {', '.join(map(str, a.seeds))}; STS-B dev Spearman x 100, "
             f"mean ± standard deviation over the seeds. Δ: the paired difference (same seed, so same initial "
             f"weights and batches); **bold** where it is larger than its own spread over the seeds and than both "
             f"arms' standard deviations: nothing else can be told apart from seed noise (and with few seeds a bold "
             f"one is a lead, not proof).", "",
             f"- lexical floor (mean of random word vectors): {cell(floor)}",
             f"- untrained model: {cell(untrained)} ({' / '.join(f'{x:.2f}' for x in untrained)})"]
    for title, arms in panels(a).items():
        lines += ["", f"**{title}**", "", "| arm | STS-B dev | Δ untrained | Δ both | per seed |",
                  "|---|---|---|---|---|"]
        for arm in arms:
            finals = [curve(out, arm, s)[-1][1] for s in a.seeds]
            vs_both = delta(finals, both) if both is not None and arm != "both" else "–"
            lines.append(f"| {LABELS[arm]} | {cell(finals)} | {delta(finals, untrained)} | {vs_both} | "
                         f"{' / '.join(f'{x:.2f}' for x in finals)} |")
    return "\n".join(lines) + "\n"


def plot(a, out: Path, path: Path, untrained: list[float], floor: list[float]):
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = panels(a)
    cols = min(2, len(tables))
    fig, axes = plt.subplots((len(tables) + cols - 1) // cols, cols, figsize=(6 * cols, 4 * ((len(tables) + 1) // 2)),
                             sharey=True, squeeze=False)
    for ax, (title, arms) in zip(axes.flat, tables.items(), strict=False):  # an odd count leaves one empty
        others = iter(["tab:blue", "tab:orange", "tab:red"])
        for arm in arms:
            curves = [[(0, u)] + curve(out, arm, s) for s, u in zip(a.seeds, untrained, strict=True)]
            steps = [st for st, _ in curves[0]]
            ys = np.array([[y for _, y in c] for c in curves])
            color = "black" if arm == "both" else next(others)  # DeCLUTR itself looks the same in every panel
            ax.plot(steps, ys.mean(0), marker="o", color=color, label=LABELS[arm])
            ax.fill_between(steps, ys.mean(0) - ys.std(0, ddof=1), ys.mean(0) + ys.std(0, ddof=1), color=color,
                            alpha=0.15)
        ax.axhline(np.mean(floor), color="gray", linestyle="--", linewidth=1, label="lexical floor")
        ax.set_title(title)
        ax.set_xlabel("steps")
        ax.legend(fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("STS-B dev Spearman x 100\n(mean ± std over seeds)")
    for ax in axes.flat[len(tables):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"), help="the shared assets folder")
    ap.add_argument("--data", nargs="+", default=None, help="documents (default: the shared Gutenberg books)")
    ap.add_argument("--stsb", default=None, help="sts-dev.csv (default: the shared copy)")
    ap.add_argument("--out", default="runs/ablation", help="where the runs and the report go")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="which arms to train")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one initial model and batches each")
    ap.add_argument("--model", default=None, help="start every arm from this pretrained encoder (a hub id or a "
                    "folder) instead of a scratch model")
    ap.add_argument("--shape", default="tiny", choices=list(M.SHAPES), help="scratch shape (without --model)")
    ap.add_argument("--steps", type=int, default=1200, help="optimiser steps per arm")
    ap.add_argument("--eval-every", type=int, default=200, help="steps between STS-B dev scores (the plot)")
    ap.add_argument("--docs-per-step", type=int, default=16, help="N")
    ap.add_argument("--min-span", type=int, default=16, help="l_min")
    ap.add_argument("--max-span", type=int, default=128, help="l_max")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr (a scratch model needs more than the paper's 5e-5)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (on a CPU: its cores, one thread each)")
    ap.add_argument("--plot", default=str(ROOT / "bench" / "ablation.png"), help="where the plot goes")
    a = ap.parse_args()
    shared, out = Path(a.shared), Path(a.out)
    a.data = a.data or [str(shared / "data/corpus/gutenberg")]
    a.stsb = a.stsb or str(shared / "data/sts/stsbenchmark/sts-dev.csv")
    out.mkdir(parents=True, exist_ok=True)
    inits = initial_models(a, out)
    pairs = E.load_stsb_dev(a.stsb)
    untrained = [E.spearman_of(*M.load_pretrained(str(inits[s]), quiet=True), pairs) for s in a.seeds]
    floor = [lexical_floor(pairs, s) for s in a.seeds]
    t0 = time.time()
    run_arms(a, out, inits)
    report = tables(a, out, untrained, floor)
    (out / "ablation.md").write_text(report)
    total = sum(run_seconds(out).get(f"{arm}-seed{s}", 0) for arm in a.arms for s in a.seeds) / 60
    print(f"\n{report}\n{len(a.arms) * len(a.seeds)} runs: {total:.0f} minutes of training in all ({a.jobs} at "
          f"a time), {(time.time() - t0) / 60:.0f} of them in this invocation")
    plot(a, out, Path(a.plot), untrained, floor)


if __name__ == "__main__":
    main()
