"""
The paper's other claims in miniature: SentEval's supervised STS-B (Table 2's STSB column) and three probing tasks
(Table 3's SentLen, WC, BShift), scored the way SentEval scores them (bench/_senteval.py), on the arms that
bench/ablation.py trains in the paper's setting: the MLM-pretrained start (stage 1), then DeCLUTR, contrastive only
and MLM only, 3 seeds each, beside the unsupervised STS-B dev that the ablation reports. all-MiniLM-L6-v2, trained
on NLI and other labelled pairs, is the supervised reference (the paper's sentence-transformers row).

The claim (§5, Table 3): DeCLUTR gains on the downstream tasks and keeps the probing accuracy of the model it
continues, while NLI-trained encoders lose some of theirs; the paper puts it down to the MLM term. So: does DeCLUTR
keep its start's probing accuracy within the seeds' spread, and does contrastive only lose more than the arms with
MLM?

    python bench/probing.py                   # the ablation with 40 books held out, then every score
    python bench/probing.py --tasks-only ../shared/data/corpus/gutenberg/Austen_*.txt   # the tasks alone
    python bench/probing.py --no-train        # score the runs that --out holds

Time, alone on 2 CPU cores (AMD EPYC Zen 4): an hour. The ablation 22 minutes (stage 1 14, the 9 runs of stage 2
8, two at a time), scoring the 11 models 14 (each model's embeddings, SentEval's regressor and three probes, one
thread: 43-76 s a tiny model, 288 s all-MiniLM-L6-v2), the check against scikit-learn 24 where it is installed
(measured when the check embedded its three models again and re-ran SentEval's probe; both now come from the
scoring).

The ablation runs as `bench/ablation.py --pretrain-steps 8000 --lr 5e-4 --fractions 100 --hold-out 40`: stage 1 on
80 of the 200 shared books, stage 2 (one pass) on 80 others, and the 40 left out (every 5th by name) give the
probing tasks' sentences (bench/_probing_tasks.py), so that no model has read them. Sentences are embedded in fp32
(the same on any CPU); each model's scores are kept in OUT/probing-scores.json, so a second run only adds what is
missing. The table goes to OUT/probing.md.
"""
import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import _probing_tasks as probing_tasks  # noqa: E402
import _senteval as senteval  # noqa: E402
from _report import cell, delta, held_out  # noqa: E402

import embed as E  # noqa: E402
import evaluate_sts  # noqa: E402
import model as M  # noqa: E402
from support import corpus, sts_files  # noqa: E402
from support.cli import UserError, bench, shared_assets  # noqa: E402

ARMS = {"mlm-only": "MLM only", "contrastive-only": "contrastive only", "both": "DeCLUTR (both)"}
COLUMNS = ["STS-B dev, cosine", "STS-B dev, supervised", "SentLen", "WC", "BShift"]


def models(out: Path, seeds: list[int], minilm: Path) -> dict[str, Path]:
    """Every model scored: the start, each arm and seed at 100% of stage 2's documents, the supervised reference."""
    found = {"start": out / "pretrain" / "model"}
    found |= {f"{arm}-seed{s}": out / f"{arm}-100pct-seed{s}" / "model" for arm in ARMS for s in seeds}
    if minilm.exists():
        found["all-MiniLM-L6-v2"] = minilm
    return found


def embed_all(folder: Path, texts: list[str]) -> dict[str, np.ndarray]:
    """Each distinct text's mean-pooled embedding (fp32, not normalised: SentEval's features are the raw vectors)."""
    encoder, tok = M.load_pretrained(str(folder), quiet=True)
    unique = list(dict.fromkeys(texts))
    return dict(zip(unique, E.encode(unique, encoder, tok), strict=True))


def task_features(vectors: dict, task: dict) -> dict:
    """{split: (X, y)} of one probing task, X standardised with the train split's mean and deviation per dimension.
    Not SentEval's: its probe (Adam at 1e-3, at most 200 passes, early stopping) leaves these small models' features
    (deviations of 0.2-0.5) 2-4 points short of a converged logistic regression, by how much depending on each
    model's scale, which the arms change; standardised, it is within a point of scikit-learn on every task of the
    tiny models (docs/ablation.md)."""
    labels = sorted(set(task["train"][1]))
    split = {s: (np.stack([vectors[t] for t in texts]), np.array([labels.index(y) for y in ys]))
             for s, (texts, ys) in task.items()}
    mean, deviation = split["train"][0].mean(0), split["train"][0].std(0) + 1e-8
    return {s: ((X - mean) / deviation, y) for s, (X, y) in split.items()}


def sentences(tasks: dict, stsb: dict) -> list[str]:
    """Every sentence a model's scores need: the probing tasks' and STS-B's."""
    texts = [t for task in tasks.values() for split in task.values() for t in split[0]]
    return texts + [s for a, b, _ in stsb.values() for s in a + b]


def score(vectors: dict, tasks: dict, stsb: dict) -> dict[str, float]:
    """One model's row: STS-B dev by cosine and by SentEval's regressor, and the probes' test accuracies."""
    pairs = {split: (np.stack([vectors[s] for s in a]), np.stack([vectors[s] for s in b]), np.asarray(gold))
             for split, (a, b, gold) in stsb.items()}
    u, v, gold = pairs["dev"]
    cosine = (u * v).sum(1) / np.linalg.norm(u, axis=1) / np.linalg.norm(v, axis=1)
    row = {"STS-B dev, cosine": 100 * evaluate_sts.spearman(cosine, gold),
           # SentEval's STS-B: trained on sts-train, stopped on sts-dev; STS-B's test split is not here, so dev it is
           "STS-B dev, supervised": senteval.relatedness(pairs["train"], pairs["dev"], pairs["dev"])["spearman"]}
    for name, task in tasks.items():
        split = task_features(vectors, task)
        row[name] = senteval.probe(split["train"], split["dev"], split["test"], len(set(task["train"][1])))[1]
    return row


def against_sklearn(vectors: dict, tasks: dict, row: dict) -> dict[str, tuple[float, float, float]]:
    """Test accuracy on each probing task, on the same features: (SentEval's probe, from the model's row, the same
    probe trained for 1,000 passes without early stopping, scikit-learn's LogisticRegression with C chosen on the
    same validation split over SentEval's grid for it, 2^-2 ... 2^3, and fitted to convergence)."""
    from sklearn.linear_model import LogisticRegression

    out = {}
    for name, task in tasks.items():
        split = task_features(vectors, task)
        fits = [LogisticRegression(C=2.0 ** t, max_iter=2000).fit(*split["train"]) for t in range(-2, 4)]
        best = max(fits, key=lambda clf: clf.score(*split["dev"]))
        classes = len(set(task["train"][1]))
        longer = senteval.probe_without_stopping(split["train"], split["dev"], split["test"], classes)
        out[name] = (row[name], longer, round(100 * best.score(*split["test"]), 2))
    return out


def table(scores: dict, seeds: list[int]) -> str:
    lines = ["| model | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    start = scores["start"]
    lines.append("| stage 1, MLM-pretrained (the start) | " + " | ".join(f"{start[c]:.2f}" for c in COLUMNS) + " |")
    for arm, label in ARMS.items():
        cells = []
        for c in COLUMNS:
            xs = [scores[f"{arm}-seed{s}"][c] for s in seeds]
            cells.append(f"{cell(xs)} ({delta(xs, [start[c]] * len(xs))})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "all-MiniLM-L6-v2" in scores:
        ref = scores["all-MiniLM-L6-v2"]
        lines.append("| all-MiniLM-L6-v2 (supervised reference) | " + " | ".join(f"{ref[c]:.2f}" for c in COLUMNS)
                     + " |")
    return "\n".join(lines)


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT), help="the shared assets folder")
    ap.add_argument("--out", default="runs/probing", help="the ablation's runs and this bench's scores")
    ap.add_argument("--hold-out", type=int, default=40, help="books kept out of training for the probing tasks")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--no-train", action="store_true", help="score the runs --out holds; train nothing")
    ap.add_argument("--tasks-only", nargs="+", metavar="BOOK", help="only build the probing tasks from these books "
                    "and print their sizes and balance (bench/_probing_tasks.py)")
    a = ap.parse_args()
    if a.tasks_only:
        for name, task in probing_tasks.build(a.tasks_only, seed=0).items():
            print(probing_tasks.describe(name, task))
        return
    shared, out, t0 = Path(a.shared), Path(a.out), time.time()
    books = corpus.list_files([str(shared / "data/corpus/gutenberg")])
    if not a.no_train:  # the ablation in the paper's setting; it keeps what is finished and continues
        subprocess.run([sys.executable, str(ROOT / "bench/ablation.py"), "--pretrain-steps", "8000", "--lr", "5e-4",
                        "--fractions", "100", "--hold-out", str(a.hold_out), "--out", str(out), "--seeds",
                        *map(str, a.seeds), "--plot", str(out / "ablation.png")], check=True)
        print(f"training: {(time.time() - t0) / 60:.0f} minutes", flush=True)
    if missing := [str(m) for m in models(out, a.seeds, shared / "models/all-MiniLM-L6-v2").values() if not m.is_dir()]:
        raise UserError(f"--out {out}: no trained model at {missing[0]} ({len(missing)} missing); "
                        f"run without --no-train to train them, or name the --out that holds them")
    held = held_out(books, a.hold_out)
    tasks = probing_tasks.build(held, seed=0)
    for name, task in tasks.items():
        print(probing_tasks.describe(name, task), flush=True)
    sts = shared / "data/sts/stsbenchmark"
    stsb = {split: sts_files.read_stsb(sts / f"sts-{split}.csv") for split in ("train", "dev")}
    cache = out / "probing-scores.json"
    scores = json.loads(cache.read_text()) if cache.exists() else {}
    # The probe against scikit-learn on the same features, where it is installed: two tiny models (the start,
    # DeCLUTR seed 0) and the reference, the one model well above chance on every task
    checked = ("start", "both-seed0", "all-MiniLM-L6-v2") if importlib.util.find_spec("sklearn") else ()
    texts = sentences(tasks, stsb)
    for name, folder in models(out, a.seeds, shared / "models/all-MiniLM-L6-v2").items():
        check = name in checked and name not in scores.setdefault("sklearn", {})
        if name in scores and not check:
            continue
        t1, vectors = time.time(), embed_all(folder, texts)  # once a model, for its row and its check
        if name not in scores:
            scores[name] = score(vectors, tasks, stsb)
            print(f"{name}: " + ", ".join(f"{c} {scores[name][c]:.2f}" for c in COLUMNS)
                  + f" ({time.time() - t1:.0f}s)", flush=True)
        if check:
            scores["sklearn"][name] = against_sklearn(vectors, tasks, scores[name])
        cache.write_text(json.dumps(scores, indent=1))
    sizes = "\n".join(f"- {probing_tasks.describe(n, t)}" for n, t in tasks.items())
    checks = "\n".join(f"- {model}, {task}: SentEval's probe {ours:.2f}, without its early stopping {longer:.2f}, "
                       f"scikit-learn {theirs:.2f}" for model, by_task in scores.get("sklearn", {}).items()
                       for task, (ours, longer, theirs) in by_task.items())
    report = (f"{table(scores, a.seeds)}\n\nThe tasks, from {len(held)} held-out books:\n{sizes}\n\n"
              f"The probe against scikit-learn on the same features (test accuracy):\n{checks}\n")
    (out / "probing.md").write_text(report)
    print(f"\n{report}\n{(time.time() - t0) / 60:.0f} minutes in all")


if __name__ == "__main__":
    main()
