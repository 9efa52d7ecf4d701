"""
The paper's ablations in miniature, with error bars, in two settings. From scratch: Fig. 3 (which objective: MLM,
contrastive, both) and Fig. 2 (which positive view: all, overlap, adjacent, subsumed; how many anchors A and
positives P), each arm trained from the same scratch model on the same batches for each of several seeds. And the
paper's own setting (--pretrain-steps): a model pretrained with MLM first (stage 1), then continued with each
objective of Fig. 3 on books stage 1 never saw, one pass over 25, 50 or 100% of them (Fig. 3's train-set axis).
Every run is scored on STS-B dev (and SICK-R) and reported as mean ± standard deviation over the seeds, with its
paired differences, beside its start and the lexical floor (the mean of random word vectors, on the same pairs).

    python bench/ablation.py                                   # CPU: tiny scratch models, 3 seeds, all arms, ~1.7 h
    python bench/ablation.py --pretrain-steps 8000 --lr 5e-4   # CPU: stage 1 (24 min), then 27 runs of Fig. 3 (30 min)
    python bench/ablation.py --pretrain-steps 8000 --lr 5e-4 --plot bench/ablation-pretrained.png   # the docs' figure
    python bench/ablation.py --arms both mlm-only contrastive-only --seeds 5
    python bench/ablation.py --model distilroberta-base --steps 3000 --max-span 512 --min-span 32 --lr 5e-5 \\
        --eval-every 500 --jobs 1 --data openwebtext/          # the paper's scale, on a GPU

From scratch, each seed has one initial model (the seed's weights, one BPE tokenizer for all), or with --model the
same pretrained encoder serves every seed, and every arm of that seed starts from it with that seed's batches
(train.py --seed), so that arms differ only in what they ablate. With --pretrain-steps, every other book (sorted by
name) trains stage 1: a scratch model and its BPE, MLM alone on full-length sequences of l_max tokens, as RoBERTa
is pretrained on whole 512-token sequences, DeCLUTR's l_max. The other books, cut at paragraph ends into documents
of at least --doc-chars characters and shuffled once, are stage 2's: every arm, share and seed starts from the one
stage-1 model, the seeds differing in batches, masks and dropout. The tables go to OUT/ablation.md and, with
matplotlib installed, the curves to --plot. Finished runs are kept (and their times, in OUT/seconds.json): running
the script again continues where it stopped.
"""
import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from _report import cell, delta, held_out  # noqa: E402 (bench/_report.py: probing.py's too)

import evaluate_sts as E  # noqa: E402
import model as M  # noqa: E402
from support import corpus, demo, sts_files  # noqa: E402
from support.cli import bench, shared_assets  # noqa: E402
from support.files import write_atomic  # noqa: E402
from support.sts_files import load_stsb_dev  # noqa: E402

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
    tok = demo.scratch_tokenizer(a.shape, corpus.document_texts(a.data))
    for s, d in inits.items():
        M.save_pretrained(M.scratch_encoder(a.shape, tok.get_vocab_size(), seed=s), tok, d)
    return inits


# -----------------------------------------------------------------------------------------------
# The paper's setting: stage 1 pretrains with MLM on half the books; stage 2 continues on the other half.


def pretrain(a, out: Path, books: list[Path]) -> Path:
    """Stage 1, the "pretrained" encoder (the paper's Transformer-* rows): scratch weights and BPE, MLM alone on
    sequences of l_max tokens (--min-span = --max-span: every anchor a whole l_max block, none of them
    contrasted), seed 0, STS-B dev scored at most 8 times along the way (every stage1_eval_every steps, and at the
    end)."""
    model = out / "pretrain" / "model"
    if not (model / "model.safetensors").exists():
        cmd = ["--model", f"scratch:{a.shape}", "--data", *map(str, books), "--seed", "0",
               "--steps", str(a.pretrain_steps), "--min-span", str(a.max_span), "--lr", str(a.pretrain_lr),
               "--no-contrastive", "--eval-every", str(stage1_eval_every(a.pretrain_steps)),
               "--threads", str(len(os.sched_getaffinity(0)))]  # alone: every core
        train(a, out, "pretrain", cmd, wait=True)
    return model



def stage1_eval_every(steps: int) -> int:
    """Steps between stage 1's scores: 8 of them over the run (and train.py's own at the end), fewer for a run of
    fewer steps than that, never one a step."""
    return max(1, math.ceil(steps / 8))


def stage1_summary(s1: list[dict]) -> str:
    """Stage 1's MLM loss at its start and its end, over windows that say what they cover (the first 50 steps and
    the last 500, or as many as the run has)."""
    first, last = s1[:min(50, len(s1))], s1[-min(500, len(s1)):]
    return (f"MLM loss {np.mean([r['mlm'] for r in first]):.2f} over its first {len(first)} steps, "
            f"{np.mean([r['mlm'] for r in last]):.2f} over its last {len(last)}")


def failure(log: Path) -> str:
    """What a failed run said: its last `error: ` line, else its last line."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] if log.exists() else []
    errors = [line for line in lines if line.startswith("error: ")]
    return (errors or lines or ["no output"])[-1].removeprefix("error: ")


def stage2_documents(a, out: Path, books: list[Path]) -> dict[int, Path]:
    """The books stage 1 did not see, cut at paragraph ends into documents of at least --doc-chars characters
    (the paper's documents are web pages, not books: one pass over 100 books would be 6 steps), shuffled once with
    a fixed seed; share p% is the first p% of them, so a larger share holds every smaller one."""
    files = {p: out / f"documents-{p}pct.jsonl" for p in a.fractions}
    if all(f.exists() for f in files.values()):
        return files
    docs = []
    for text in corpus.read_documents(books, collections.Counter(), clean=False):
        mine, piece = [], ""
        for paragraph in re.split(r"\n\s*\n", text.replace("\r\n", "\n").strip()):
            piece = f"{piece}\n\n{paragraph}" if piece else paragraph
            if len(piece) >= a.doc_chars:
                mine.append(piece)
                piece = ""
        if mine and piece:  # the book's tail joins its last document rather than being lost
            mine[-1] += "\n\n" + piece
        docs += mine or [piece]  # a book shorter than --doc-chars is one document (the sampler may skip it)
    order = np.random.default_rng(0).permutation(len(docs))
    for p, f in files.items():
        lines = "".join(json.dumps({"text": docs[i]}) + "\n" for i in order[:round(len(docs) * p / 100)])
        write_atomic(f, lambda tmp, lines=lines: Path(tmp).write_text(lines))
    return files


# -----------------------------------------------------------------------------------------------
# Running the arms, one train.py each, and reading back what they logged.


def runs(a) -> list[tuple[str, int | None, int]]:
    """(arm, share of stage 2's documents or None, seed) of every run asked for."""
    return [(arm, p, s) for s in a.seeds for p in (a.fractions if a.pretrain_steps else [None]) for arm in a.arms]


def name(arm: str, share: int | None, seed: int) -> str:
    return f"{arm}-seed{seed}" if share is None else f"{arm}-{share}pct-seed{seed}"


def train(a, out: Path, run: str, flags: list[str], wait: bool = False):
    """Start train.py for one run into out/run, its output in out/run.log; wait=True: block until it ends."""
    cmd = [sys.executable, str(ROOT / "train.py"), "--out", str(out / run), "--overwrite",
           "--docs-per-step", str(a.docs_per_step), "--max-span", str(a.max_span), "--eval-data", a.stsb,
           "--ckpt-every", "1000000", "--log-every", "1000000", "--cache-dir", str(out / "cache"), *flags]
    job = (run, time.time(), subprocess.Popen(cmd, stdout=open(out / f"{run}.log", "w"), stderr=subprocess.STDOUT))
    if wait:
        job[2].wait()
        finished(out, job)
    return job


def finished(out: Path, job):
    """Record one ended run's time (over every invocation of the script), or stop if it failed."""
    run, t0, proc = job
    if proc.returncode:
        sys.exit(f"{run} failed: {failure(out / f'{run}.log')} (the whole log: {out / f'{run}.log'})")
    (out / "seconds.json").write_text(json.dumps({**run_seconds(out), run: round(time.time() - t0)}, indent=1))
    print(f"{run}: STS-B dev {curve(out, run)[-1][1]:.2f} ({time.time() - t0:.0f}s)", flush=True)


def run_arms(a, out: Path, inits: dict[int, Path], documents: dict[int, Path]):
    """Every (arm, share, seed) not yet finished, --jobs at a time, one CPU thread each when several run together."""
    todo = [r for r in runs(a) if not (out / name(*r) / "model").exists()]
    running = []
    while todo or running:
        while todo and len(running) < a.jobs:
            arm, share, s = todo.pop(0)
            length = ["--data", str(documents[share]), "--epochs", "1"] if share else ["--data", *a.data,
                                                                                     "--steps", str(a.steps)]
            running.append(train(a, out, name(arm, share, s), [
                "--model", str(inits[s]), "--seed", str(s), *length, "--min-span", str(a.min_span),
                "--lr", str(a.lr), "--eval-every", str(a.eval_every), *(["--threads", "1"] if a.jobs > 1 else []),
                *(["--holdout-docs", str(a.holdout_docs)] if a.holdout_docs else []), *ARMS[arm][0]]))
        time.sleep(1)
        for job in [j for j in running if j[2].poll() is not None]:
            running.remove(job)
            finished(out, job)


def run_seconds(out: Path) -> dict[str, int]:
    """How long each finished run took, over every invocation of the script."""
    return json.loads((out / "seconds.json").read_text()) if (out / "seconds.json").exists() else {}


def metrics(out: Path, run: str) -> list[dict]:
    """A run's steps from its metrics.jsonl (not the line train.py writes first, the start's score at step 0)."""
    records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] > 0]


def curve(out: Path, run: str) -> list[tuple[int, float]]:
    """(step, STS-B dev Spearman) of one run, from its metrics.jsonl."""
    return [(r["step"], r["stsb_dev_spearman"]) for r in metrics(out, run) if r.get("stsb_dev_spearman") is not None]


def sick_scores(a, models: dict[str, Path]) -> dict[str, float]:
    """SICK-R (the shared trial split, 500 pairs) Spearman of each model; none where the file is not there."""
    if not Path(a.sick).exists():
        return {}
    pairs = sts_files.read_sick(Path(a.sick), "dev")
    return {run: E.spearman_of(*M.load_pretrained(str(model), quiet=True), pairs) for run, model in models.items()}


# -----------------------------------------------------------------------------------------------
# The report: tables and plots.


def panels(a) -> dict[str, list[str]]:
    """The figures this run's arms fill: each with its arms that ran, and none where "both" would be alone."""
    filled = {title: [arm for arm in arms if arm in a.arms] for title, arms in TABLES.items()}
    filled = {title: arms for title, arms in filled.items() if set(arms) - {"both"}}
    return filled or {"DeCLUTR": ["both"]}




def tables(a, out: Path, start: dict, floor: list[float], sick: dict) -> str:
    """The Markdown report: one table per figure with each arm's mean ± std over seeds, its paired differences (same
    seed, so same initial weights and batches) to the start (untrained, or stage 1) and to "both", and the seeds'
    own scores; SICK-R beside STS-B where the shared trial split is there."""
    final = {name(*r): curve(out, name(*r))[-1][1] for r in runs(a)}
    what = "stage 1" if a.pretrain_steps else "untrained"
    if a.pretrain_steps:
        s1 = metrics(out, "pretrain")
        kept = f" of those not held out ({a.hold_out})" if a.hold_out else ""
        lines = [f"Stage 1: {a.shape} scratch model and BPE, {a.pretrain_steps} steps of MLM alone on 2 x "
                 f"{a.docs_per_step} sequences of {a.max_span} tokens from every other book{kept}, lr {a.pretrain_lr}; "
                 f"{stage1_summary(s1)}. Stage 2: from it, one pass over "
                 f"a share of the other books' documents, spans {a.min_span}-{a.max_span} tokens, lr {a.lr}"]
    else:
        lines = [f"{a.model or f'{a.shape} scratch model'}, {a.steps} steps, spans {a.min_span}-{a.max_span} "
                 f"tokens, lr {a.lr}"]
    lines[0] += (f"; N={a.docs_per_step}, seeds {', '.join(map(str, a.seeds))}. Spearman x 100, mean ± standard "
                 f"deviation over the seeds. Δ: the paired difference (same seed, so same start and batches); "
                 f"**bold** where it is larger than its own spread over the seeds and than both sides' standard "
                 f"deviations: nothing else can be told apart from seed noise (and with few seeds a bold one is a "
                 f"lead, not proof).")
    lines += ["", f"- lexical floor (mean of random word vectors): STS-B {cell(floor)}"]
    if a.pretrain_steps:  # one model, the start of every seed
        lines += [f"- stage 1 model: STS-B {start['stsb'][0]:.2f}" + (f", SICK-R {start['sick'][0]:.2f}" if sick
                  else "") + f"; before stage 1 (its random weights): STS-B {start['before stage 1']:.2f}"]
    else:
        lines += [f"- untrained model: STS-B {cell(start['stsb'])} ({' / '.join(f'{x:.2f}' for x in start['stsb'])})"
                  + (f", SICK-R {cell(start['sick'])}" if sick else "")]
    head = ["share"] * (a.pretrain_steps > 0) + ["arm", "steps", "STS-B dev", f"Δ {what}", "Δ both", "per seed"]
    head += ["SICK-R", f"Δ {what}", "Δ both"] if sick else []
    for title, arms in panels(a).items():
        lines += ["", f"**{title}**", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for share in a.fractions if a.pretrain_steps else [None]:
            for arm in arms:
                row = [name(arm, share, s) for s in a.seeds]
                both = [name("both", share, s) for s in a.seeds] if "both" in a.arms and arm != "both" else None
                cols = [f"{share}%"] * (share is not None) + [LABELS[arm], f"{metrics(out, row[0])[-1]['step']:,}"]
                for scores, ref in [(final, start["stsb"])] + ([(sick, start["sick"])] if sick else []):
                    xs = [scores[r] for r in row]
                    cols += [cell(xs), delta(xs, ref), delta(xs, [scores[r] for r in both]) if both else "–"]
                    cols += [" / ".join(f"{x:.2f}" for x in xs)] if scores is final else []
                lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines) + "\n"


def span_tables(a, out: Path) -> str:
    """--holdout-docs: each arm's held-out span retrieval at its end against the start and against word overlap
    (BM25, TF-IDF), as the STS tables are; then, for each run, the Spearman correlation over its evaluations (the
    start's included) of span MRR with STS-B dev: does the figure a user can have on their own documents rank the
    checkpoints as STS-B does?"""
    first = metrics_with_start(out, name(*runs(a)[0]))[0]  # the start: one model and the same pairs for every run
    words = "; ".join(f"word overlap ({name}): MRR {first[f'{w}_spans_mrr']:.2f}, R@1 "
                      f"{first[f'{w}_spans_recall_at_1']:.2f}, R@10 {first[f'{w}_spans_recall_at_10']:.2f}"
                      for w, name in (("bm25", "BM25"), ("tfidf", "TF-IDF")) if f"{w}_spans_mrr" in first)
    lines = ["", f"**Held-out span retrieval** (`--holdout-docs {a.holdout_docs}`: {first['spans_n']:,} pairs from the "
             f"held-out documents, every target a candidate), × 100, mean ± standard deviation over the seeds; Δ as "
             f"above. The start: MRR {first['spans_mrr']:.2f}, R@1 {first['spans_recall_at_1']:.2f}, R@10 "
             f"{first['spans_recall_at_10']:.2f}; {words}.", ""]
    head = ["share", "arm", "MRR", "Δ start", "Δ both", "per seed", "R@1", "R@10", "alignment", "uniformity",
            "Spearman(MRR, STS-B) over evaluations"]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for share in a.fractions if a.pretrain_steps else [None]:
        for arm in a.arms:
            row = [name(arm, share, s) for s in a.seeds]
            end = [metrics_with_start(out, r)[-1] for r in row]
            both = [metrics_with_start(out, name("both", share, s))[-1]["spans_mrr"] for s in a.seeds]
            mrr = [e["spans_mrr"] for e in end]
            lines.append("| " + " | ".join([
                f"{share}%" if share else "–", LABELS[arm], cell(mrr), delta(mrr, [first["spans_mrr"]] * len(mrr)),
                delta(mrr, both) if arm != "both" and "both" in a.arms else "–", " / ".join(f"{x:.2f}" for x in mrr),
                *(cell([e[f"spans_{k}"] for e in end]) for k in ("recall_at_1", "recall_at_10", "alignment",
                                                                  "uniformity")),
                cell([tracking(metrics_with_start(out, r)) for r in row])]) + " |")
    every = [tracking(metrics_with_start(out, name(*r))) for r in runs(a)]
    lines += ["", f"Over all {len(every)} runs, the Spearman correlation of span MRR with STS-B dev over each run's "
              f"evaluations: {cell(every)} (lowest {min(every):.2f}, highest {max(every):.2f})."]
    return "\n".join(lines) + "\n"


def metrics_with_start(out: Path, run: str) -> list[dict]:
    """A run's evaluated records, the start's (step 0) first."""
    records = [json.loads(line) for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("spans_mrr") is not None and r.get("stsb_dev_spearman") is not None]


def tracking(records: list[dict]) -> float:
    """Spearman x 100, over a run's evaluations, of span MRR with STS-B dev."""
    return 100 * E.spearman([r["spans_mrr"] for r in records], [r["stsb_dev_spearman"] for r in records])


def plot(a, out: Path, path: Path, start: dict, floor: list[float]):
    """STS-B dev against steps, one panel per figure (from scratch), or stage 1's MLM loss and STS-B dev, then
    stage 2's final score against the share of documents and its curves on all of them (--pretrain-steps)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {"stage 1: MLM": [], "stage 2: one pass over a share of the documents": a.arms,
               f"stage 2: all {a.fractions[-1]}%, along the pass": a.arms} if a.pretrain_steps else panels(a)
    cols = 3 if a.pretrain_steps else min(2, len(figures))
    rows = (len(figures) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), sharey=not a.pretrain_steps, squeeze=False)
    for i, (ax, (title, arms)) in enumerate(zip(axes.flat, figures.items(), strict=False)):  # odd: one left empty
        if a.pretrain_steps and i == 0:
            stage1(ax, out, start["before stage 1"])
            continue
        others = iter(["tab:blue", "tab:orange", "tab:red"])
        for arm in arms:
            color = "black" if arm == "both" else next(others)  # DeCLUTR itself looks the same in every panel
            if a.pretrain_steps and i == 1:
                xs = a.fractions
                ys = np.array([[curve(out, name(arm, p, s))[-1][1] for p in xs] for s in a.seeds])
            else:
                share = a.fractions[-1] if a.pretrain_steps else None
                curves = [[(0, u)] + curve(out, name(arm, share, s))
                          for s, u in zip(a.seeds, start["stsb"], strict=True)]
                xs = [st for st, _ in curves[0]]
                ys = np.array([[y for _, y in c] for c in curves])
            ax.plot(xs, ys.mean(0), marker="o", color=color, label=LABELS[arm])
            ax.fill_between(xs, ys.mean(0) - ys.std(0, ddof=1), ys.mean(0) + ys.std(0, ddof=1), color=color,
                            alpha=0.15)
        if a.pretrain_steps:
            ax.axhline(start["stsb"][0], color="tab:green", linestyle=":", label="stage 1 (the start)")
        ax.axhline(np.mean(floor), color="gray", linestyle="--", linewidth=1, label="lexical floor")
        ax.set_title(title)
        ax.set_xlabel("share of stage 2's documents (%)" if a.pretrain_steps and i == 1 else "steps")
        ax.set_ylabel("STS-B dev Spearman x 100\n(mean ± std over seeds)")
        ax.legend(fontsize=8)
    for ax in axes.flat[len(figures):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def running_mean(xs, most: int = 50) -> tuple[np.ndarray, np.ndarray, int]:
    """(steps, means, window): the mean of each `window` steps ending at a step (numbered from 1), over 50 steps, or
    a quarter of a shorter run (a run of 10 steps has no 50-step window)."""
    window = min(most, max(1, len(xs) // 4))
    return np.arange(window, len(xs) + 1), np.convolve(xs, np.ones(window) / window, "valid"), window


def stage1(ax, out: Path, before: float):
    """Stage 1's MLM loss (a running mean) and, on a second axis, its STS-B dev along the way."""
    steps, means, window = running_mean(np.array([r["mlm"] for r in metrics(out, "pretrain")]))
    ax.plot(steps, means, color="tab:purple")
    ax.set(title="stage 1: MLM alone, from scratch", xlabel="steps", ylabel=f"MLM loss ({window}-step mean)")
    sts = ax.twinx()
    steps, scores = zip(*[(0, before)] + curve(out, "pretrain"), strict=True)
    sts.plot(steps, scores, marker="o", color="tab:green")
    sts.set_ylabel("STS-B dev Spearman x 100", color="tab:green")


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=shared_assets(ROOT), help="the shared assets folder")
    ap.add_argument("--data", nargs="+", default=None, help="documents (default: the shared Gutenberg books)")
    ap.add_argument("--stsb", default=None, help="sts-dev.csv (default: the shared copy)")
    ap.add_argument("--sick", default=None, help="SICK_trial.txt, a second score if it is there (default: shared)")
    ap.add_argument("--out", default=None, help="where the runs and the report go (default: runs/ablation, or "
                    "runs/pretrained with --pretrain-steps)")
    ap.add_argument("--arms", nargs="+", default=None, choices=list(ARMS),
                    help="which arms to train (default: all, or Fig. 3's with --pretrain-steps)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="one initial model and batches each")
    ap.add_argument("--model", default=None, help="start every arm from this pretrained encoder (a hub id or a "
                    "folder) instead of a scratch model")
    ap.add_argument("--shape", default="tiny", choices=list(demo.SHAPES), help="scratch shape (without --model)")
    ap.add_argument("--steps", type=int, default=1200, help="optimiser steps per arm (from scratch)")
    ap.add_argument("--pretrain-steps", type=int, default=0, help="stage 1's MLM steps; 0: arms start from scratch")
    ap.add_argument("--pretrain-lr", type=float, default=1e-3, help="stage 1's peak lr")
    ap.add_argument("--fractions", nargs="+", type=int, default=[25, 50, 100],
                    help="stage 2: the shares (%%) of its documents, one pass over each")
    ap.add_argument("--doc-chars", type=int, default=2400, help="stage 2: the least characters of a document")
    ap.add_argument("--hold-out", type=int, default=0, help="books kept out of both stages, for bench/probing.py")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between STS-B dev scores (the plot; "
                    "default: 200, or 100 with --pretrain-steps)")
    ap.add_argument("--docs-per-step", type=int, default=16, help="N")
    ap.add_argument("--min-span", type=int, default=16, help="l_min")
    ap.add_argument("--max-span", type=int, default=128, help="l_max")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak lr (a scratch model needs more than the paper's 5e-5)")
    ap.add_argument("--holdout-docs", type=float, default=0.0, help="every arm also scored by held-out span "
                    "retrieval (train.py --holdout-docs: this share of its documents kept out of training, the same "
                    "for every arm and seed), and its own table: the arms, and how well it tracks STS-B dev")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (on a CPU: its cores, one thread each)")
    ap.add_argument("--plot", default=None, help="where the plot goes (default: OUT/ablation.png; the figures the "
                    "docs show, bench/ablation*.png, change only when named here)")
    a = ap.parse_args()
    shared, staged = Path(a.shared), a.pretrain_steps > 0
    a.data = a.data or [str(shared / "data/corpus/gutenberg")]
    a.stsb = a.stsb or str(shared / "data/sts/stsbenchmark/sts-dev.csv")
    a.sick = a.sick or str(shared / "data/sts/sick/SICK_trial.txt")
    a.arms = a.arms or (TABLES["Fig. 3: objective"] if staged else list(ARMS))
    a.eval_every = a.eval_every or (100 if staged else 200)
    a.fractions = sorted(a.fractions)
    out = Path(a.out or ("runs/pretrained" if staged else "runs/ablation"))
    plot_path = Path(a.plot) if a.plot else out / "ablation.png"  # under --out: nothing committed is written over
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    documents = {}
    if staged:
        books = corpus.list_files(a.data)  # sorted
        books = [b for b in books if b not in held_out(books, a.hold_out)]
        stage1 = pretrain(a, out, books[0::2])
        inits = {s: stage1 for s in a.seeds}
        documents = stage2_documents(a, out, books[1::2])
    else:
        inits = initial_models(a, out)
    pairs = load_stsb_dev(a.stsb)
    starts = {str(m): M.load_pretrained(str(m), quiet=True) for m in inits.values()}  # one, with stage 1
    scores = {m: E.spearman_of(*model_tok, pairs) for m, model_tok in starts.items()}
    start = {"stsb": [scores[str(inits[s])] for s in a.seeds]}
    if staged:  # where stage 1 itself began: train.py's scratch weights for seed 0, with the BPE it trained
        tok = starts[str(stage1)][1]
        start["before stage 1"] = E.spearman_of(M.scratch_encoder(a.shape, tok.get_vocab_size(), seed=0), tok, pairs)
    floor = [lexical_floor(pairs, s) for s in a.seeds]
    run_arms(a, out, inits, documents)
    sick = sick_scores(a, {name(*r): out / name(*r) / "model" for r in runs(a)} | {f"start {m}": m for m in starts})
    start["sick"] = [sick[f"start {inits[s]}"] for s in a.seeds] if sick else []
    report = tables(a, out, start, floor, sick) + (span_tables(a, out) if a.holdout_docs else "")
    (out / "ablation.md").write_text(report)
    took = run_seconds(out)
    total = sum(took.get(name(*r), 0) for r in runs(a)) / 60
    print(f"\n{report}\n{len(runs(a))} runs: {total:.0f} minutes of training in all ({a.jobs} at a time)"
          + (f", after stage 1's {took.get('pretrain', 0) / 60:.0f}" if staged else "")
          + f"; {(time.time() - t0) / 60:.0f} minutes in this invocation")
    plot(a, out, plot_path, start, floor)


if __name__ == "__main__":
    main()
