"""
Is DeCLUTR better on your own documents? From a real encoder (all-MiniLM-L6-v2, the shared assets' one), continue
pretraining with DeCLUTR on books, and score held-out span retrieval on books of the same collection that training
never saw (train.py --eval-docs): each arm over several seeds, beside its start and word overlap (BM25, TF-IDF), and
STS-B dev at the start and the end (what the domain costs in general similarity). Finished runs are kept: running
the script again continues where it stopped. The table goes to OUT/domain.md; --analyse adds where the encoder wins
and loses against BM25 (queries whose target shares a rare word or a name with them, by length).

    python bench/domain.py --analyse     # the README's figure: 3 arms x 3 seeds, 16 min a run, 2 at a time on 2 cores
    python bench/domain.py --data my-docs/ --eval-docs my-held-out/ --model my-encoder --out runs/mine
    python bench/domain.py --data ~/.cache/declutr/demo-corpus --hold-every 3 --out runs/domain-python  # Python's docs

Without --eval-docs the files are split by name: every 10th (the 6th, 16th, ...; --hold-every) held out, the rest
trained on.
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import _jobs as jobs  # noqa: E402 (bench/_jobs.py)
from _report import cell, delta  # noqa: E402 (bench/_report.py)

import evaluate_sts as E  # noqa: E402
import model as M  # noqa: E402
from support import corpus, cpu_layers, retrieval  # noqa: E402
from support.cli import bench, shared_assets  # noqa: E402

# Each arm: the train.py flags that set it apart from the paper's settings, and what it is
ARMS = {
    "declutr": ([], "DeCLUTR as the paper has it: contrastive + MLM"),
    "contrastive": (["--no-mlm"], "contrastive only (--no-mlm)"),
    "adjacent": (["--no-mlm", "--positive-view", "adjacent"], "contrastive only, positives adjacent to their anchor"),
    "adjacent-A8": (["--no-mlm", "--positive-view", "adjacent", "--num-anchors", "8"],
                    "contrastive only, adjacent positives, 8 anchors a document"),
    # What CT and SimCSE have (issue 83): texts of a sentence or two, and more negatives: spans half as long, twice
    # as many (a quarter more tokens a step), on the same documents (2·A·max-span tokens at least: 512 either way)
    "adjacent-short": (["--no-mlm", "--positive-view", "adjacent", "--max-span", "64", "--num-anchors", "4"],
                       "contrastive only, adjacent positives, spans 32-64 tokens, 4 anchors a document"),
}


def split_books(books: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    """(trained on, held out): every `every`-th file by name held out (the 6th, 16th, ... for 10), so that the
    held-out books spread over the authors."""
    held = books[every // 2::every]
    return [b for b in books if b not in held], held


def train(a, out: Path, run: str, flags: list[str]) -> tuple[Path, subprocess.Popen]:
    """Start train.py for one run into out/run: its output in out/run.log, which it returns with the process."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--out", str(out / run), "--overwrite", "--model", a.model,
           "--data", *a.data, "--eval-docs", *a.eval_docs, "--eval-data", a.stsb, "--steps", str(a.steps),
           "--eval-every", str(a.eval_every), "--docs-per-step", str(a.docs_per_step), "--min-span", str(a.min_span),
           "--max-span", str(a.max_span), "--lr", str(a.lr), "--span-pairs", str(a.span_pairs),
           "--ckpt-every", "1000000", "--log-every", "25", "--cache-dir", str(out / "cache"),
           *(["--threads", "1"] if a.jobs > 1 else []), *flags]
    log = out / f"{run}.log"
    return log, subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def run_all(a, out: Path):
    """Every (arm, seed) not yet finished, --jobs at a time (bench/_jobs.py); a failed run stops the script with its
    last line."""
    flags = {f"{arm}-seed{s}": ["--seed", str(s), *ARMS[arm][0], *a.flags] for s in a.seeds for arm in a.arms}

    def finished(run: str, seconds: float):
        took = json.loads((out / "seconds.json").read_text()) if (out / "seconds.json").exists() else {}
        (out / "seconds.json").write_text(json.dumps(took | {run: round(seconds)}, indent=1))
        end = evaluations(out, run)[-1]
        print(f"{run}: span MRR {end['spans_mrr']:.2f}, STS-B dev {end['stsb_dev_spearman']:.2f} "
              f"({seconds:.0f}s)", flush=True)

    todo = [run for run in flags if not (out / run / "model").exists()]
    jobs.run_all(todo, lambda run: train(a, out, run, flags[run]), finished, a.jobs)


def evaluations(out: Path, run: str) -> list[dict]:
    """A run's evaluated records from its metrics.jsonl, the start's (step 0) first."""
    records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("spans_mrr") is not None]


def report(a, out: Path) -> str:
    """The Markdown table: the start, BM25 and TF-IDF, then each arm's end over the seeds, its paired difference to
    the start and to BM25 (bold where it is larger than the seeds' spread), and MRR at each evaluation."""
    first = evaluations(out, f"{a.arms[0]}-seed{a.seeds[0]}")[0]
    n, took = first["spans_n"], json.loads((out / "seconds.json").read_text())
    files = [len(corpus.list_files(paths)) for paths in (a.data, a.eval_docs)]
    lines = [f"{Path(a.model).name} continued on {files[0]} files, held-out span retrieval on {files[1]} others "
             f"({n:,} pairs of the paper's span lengths, up to what the model reads; every target a candidate); "
             f"{a.steps} steps of {a.docs_per_step} documents, training spans {a.min_span}-{a.max_span} tokens, lr "
             f"{a.lr}{' ' + ' '.join(a.flags) if a.flags else ''}; seeds "
             f"{', '.join(map(str, a.seeds))}. × 100, mean ± standard deviation over the seeds; Δ: the paired "
             f"difference, **bold** where it is larger than its spread over the seeds and either side's"
             f"{'' if len(a.seeds) > 1 else ' (one seed here: no spread is measured, and no difference is a finding)'}"
             f".", "",
             "| arm | MRR | Δ start | Δ BM25 | per seed | R@1 | R@10 | STS-B dev | Δ STS-B | MRR at each evaluation "
             "| minutes a run |", "|---" * 11 + "|"]

    def fixed(prefix, label, stsb="–"):
        return (f"| {label} | {first[prefix + 'mrr']:.2f} | – | – | – | {first[prefix + 'recall_at_1']:.2f} | "
                f"{first[prefix + 'recall_at_10']:.2f} | {stsb} | – | – | – |")

    lines += [fixed("spans_", "the start", f"{first['stsb_dev_spearman']:.2f}"),
              fixed("bm25_spans_", "BM25 (words)"), fixed("tfidf_spans_", "TF-IDF (words)")]
    bm25 = [first["bm25_spans_mrr"]] * len(a.seeds)
    for arm in a.arms:
        runs = [evaluations(out, f"{arm}-seed{s}") for s in a.seeds]
        end = [r[-1] for r in runs]
        mrr, stsb = [e["spans_mrr"] for e in end], [e["stsb_dev_spearman"] for e in end]
        along = " → ".join(f"{np.mean([r[k]['spans_mrr'] for r in runs]):.2f}" for k in range(min(map(len, runs))))
        minutes = np.mean([took.get(f"{arm}-seed{s}", 0) for s in a.seeds]) / 60
        lines.append(f"| {ARMS[arm][1]} | {cell(mrr)} | {delta(mrr, [first['spans_mrr']] * len(mrr))} | "
                     f"{delta(mrr, bm25)} | {' / '.join(f'{x:.2f}' for x in mrr)} | "
                     f"{cell([e['spans_recall_at_1'] for e in end])} | {cell([e['spans_recall_at_10'] for e in end])} "
                     f"| {cell(stsb)} | {delta(stsb, [first['stsb_dev_spearman']] * len(stsb))} | {along} | "
                     f"{minutes:.0f} |")
    return "\n".join(lines) + "\n"


# -----------------------------------------------------------------------------------------------
# --analyse: which queries the encoder finds and BM25 does not, and the other way round


def pairs_of(a, out: Path, tok) -> tuple[list[str], list[str]]:
    """The held-out pairs every run scored (train.py's draw: the same documents, lengths and seed)."""
    held = corpus.prepare_corpus(a.eval_docs, tok, str(out / "cache"))
    window = retrieval.model_window(a.model, M.load_config_and_tokenizer)
    return retrieval.span_texts(held, np.arange(len(held)), tok, a.span_pairs, E.span_lengths(window))


def ranks_of(model_path: str, tok, queries: list[str], targets: list[str]) -> np.ndarray:
    model = cpu_layers.short_rows(M.load_pretrained(model_path, quiet=True)[0])  # as evaluate_sts.py runs it
    emb = E.encode(queries + targets, model, tok, normalize=True)
    q, t = emb[:len(queries)], emb[len(queries):]
    return retrieval.target_ranks(q[i:i + 1024] @ t.T for i in range(0, len(q), 1024))


NAME = re.compile(r"\b[A-Z][a-z]{2,}\b")


def groups(queries: list[str], targets: list[str]) -> dict[str, np.ndarray]:
    """Masks over the pairs: the target shares a rare word with its query (one in at most 1% of the targets, or in
    its own alone), a name (a capitalised word that is never lowercase in either span, nor the word after a full
    stop), or neither; the query in the shortest or longest third (by characters)."""
    words_t = [set(retrieval.words(t)) for t in targets]
    df = collections.Counter(w for ws in words_t for w in ws)
    most = max(1.0, 0.01 * len(targets))
    rare = np.array([any(df[w] <= most for w in set(retrieval.words(q)) & wt)
                     for q, wt in zip(queries, words_t, strict=True)])

    def names(text):
        lower = set(re.findall(r"\b[a-z]+\b", text))
        after_stop = set(re.findall(r"[.!?\"”’]\s+([A-Z][a-z]+)", text))
        return {w for w in NAME.findall(text) if w.lower() not in lower and w not in after_stop}

    name = np.array([bool(names(q) & names(t)) for q, t in zip(queries, targets, strict=True)])
    length = np.array([len(q) for q in queries])
    short, long = np.quantile(length, [1 / 3, 2 / 3])
    return {"shares a rare word": rare, "shares a name": name, "shares neither": ~rare & ~name,
            "query in the shortest third": length <= short, "query in the longest third": length >= long}


def analyse(a, out: Path) -> str:
    """MRR of the start, each arm's seed-0 end and BM25 on each group of pairs, and how often each is right where the
    other is wrong."""
    _, tok = M.load_config_and_tokenizer(a.model)
    queries, targets = pairs_of(a, out, tok)
    scores = retrieval.bm25_scores([retrieval.words(q) for q in queries], [retrieval.words(t) for t in targets])
    ranks = {"BM25": retrieval.target_ranks([scores]), "the start": ranks_of(a.model, tok, queries, targets)}
    for arm in a.arms:
        ranks[ARMS[arm][1]] = ranks_of(str(out / f"{arm}-seed{a.seeds[0]}" / "model"), tok, queries, targets)
    masks = {"all": np.ones(len(queries), bool)} | groups(queries, targets)
    lines = ["", f"**Where each finds the target** ({len(queries):,} pairs; the arms' seed {a.seeds[0]}): MRR × 100 "
             "in each group of pairs", "", "| pairs | n | " + " | ".join(ranks) + " |", "|---" * (len(ranks) + 2) + "|"]
    for label, mask in masks.items():
        lines.append(f"| {label} | {mask.sum():,} | " + " | ".join(f"{100 * np.mean(1 / r[mask]):.2f}" if mask.any()
                                                                  else "–" for r in ranks.values()) + " |")
    lines.append("")
    bm25_first = ranks["BM25"] == 1
    for who, r in list(ranks.items())[1:]:
        mine = r == 1
        lines.append(f"- {who}: first where BM25 is not on {np.sum(mine & ~bm25_first):,} pairs; BM25 first where "
                     f"it is not on {np.sum(bm25_first & ~mine):,}; both on {np.sum(mine & bm25_first):,}")
    return "\n".join(lines) + "\n"


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=shared_assets(ROOT), help="the shared assets folder")
    ap.add_argument("--model", default=None, help="the encoder to continue (default: the shared all-MiniLM-L6-v2)")
    ap.add_argument("--data", nargs="+", default=None, help="documents to train on (default: the shared books not "
                    "held out)")
    ap.add_argument("--eval-docs", nargs="+", default=None, help="held-out documents (default: every --hold-every-th "
                    "file of --data, by name, not trained on)")
    ap.add_argument("--hold-every", type=int, default=10, help="without --eval-docs: every n-th file held out")
    ap.add_argument("--stsb", default=None, help="sts-dev.csv (default: the shared copy)")
    ap.add_argument("--out", default="runs/domain", help="where the runs and the report go")
    ap.add_argument("--arms", nargs="+", default=["declutr", "contrastive", "adjacent"],
                    choices=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="batches, masks and dropout each")
    ap.add_argument("--steps", type=int, default=100, help="optimiser steps a run")
    ap.add_argument("--eval-every", type=int, default=50, help="steps between evaluations")
    ap.add_argument("--docs-per-step", type=int, default=16, help="N")
    ap.add_argument("--min-span", type=int, default=32, help="l_min")
    ap.add_argument("--max-span", type=int, default=128, help="l_max of the training spans (the held-out "
                    "spans are the paper's 32-512, up to what the model reads, whatever the run's)")
    ap.add_argument("--lr", type=float, default=5e-5, help="peak lr")
    ap.add_argument("--span-pairs", type=int, default=2000, help="held-out query-target pairs")
    ap.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more train.py flags for every run, last")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (on a CPU: its cores, one thread each)")
    ap.add_argument("--analyse", action="store_true", help="also where the encoder and BM25 each find the target")
    a = ap.parse_args()
    shared = Path(a.shared)
    a.model = a.model or str(shared / "models/all-MiniLM-L6-v2")
    a.stsb = a.stsb or str(shared / "data/sts/stsbenchmark/sts-dev.csv")
    if not a.eval_docs:  # the books (or --data) split by name
        trained, held = split_books(corpus.list_files(a.data or [str(shared / "data/corpus/gutenberg")]), a.hold_every)
        a.data, a.eval_docs = list(map(str, trained)), list(map(str, held))
    a.data = a.data or [str(shared / "data/corpus/gutenberg")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    run_all(a, out)
    text = report(a, out) + (analyse(a, out) if a.analyse else "")
    (out / "domain.md").write_text(text)
    print(f"\n{text}\n{len(a.arms) * len(a.seeds)} runs; {(time.time() - t0) / 60:.0f} minutes in this invocation; "
          f"{os.cpu_count()} cores")


if __name__ == "__main__":
    main()
