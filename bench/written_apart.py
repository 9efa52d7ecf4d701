"""
A second yardstick, pairs that no training view makes (issue 83): Python's library reference against the standard
library's docstrings of the same functions, classes and methods, each written apart from the other, never two pieces
of one document (how they are read and matched: bench/_written_apart.py). Held out by module: the modules whose name
hashes into the first --held-share are scored and never trained on. Each held-out reference entry is a query, its
docstring the target among every held-out docstring (and back: docstring -> entry); BM25 and TF-IDF beside the
encoders, as for held-out span retrieval.

The training documents are the rest of the same two sources: each other module's docstrings (one document a source
file, as the demo's corpus has them) and each other reference page (its reST as plain text); the held-out modules'
docstrings and pages are the documents of the first yardstick, held-out span retrieval. bench/domain.py trains the
arms on them over the seeds (`--domain-flags` more of its flags); then every run's model, the start, BM25 and TF-IDF
are scored here on the pairs, and OUT/written_apart.md holds the table of both yardsticks and STS-B dev.

    python bench/written_apart.py                                # pairs, 2 arms x 3 seeds: about 1.5 h on 2 cores
    python bench/written_apart.py --arms adjacent --seeds 0      # one run
    python bench/written_apart.py --pairs-only                   # the pairs and the word baselines alone

The reference comes from Debian's package registry: `apt-get download python3.11-doc` (12.6 MB, into OUT), or --deb.
The docstrings are the running Python's (3.11 matches the reference; another version is said).
"""
import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import _written_apart as W  # noqa: E402 (bench/_written_apart.py)
from _report import cell, delta  # noqa: E402 (bench/_report.py)

import embed as E  # noqa: E402
import model as M  # noqa: E402
from support import cpu_layers, demo, retrieval  # noqa: E402
from support.cli import UserError, bench, shared_assets  # noqa: E402

PACKAGE = "python3.11-doc"


def reference_deb(a, out: Path) -> Path:
    """--deb, or the package downloaded into OUT once."""
    if a.deb:
        return Path(a.deb)
    found = sorted(out.glob(f"{PACKAGE}_*.deb"))
    if not found:
        done = subprocess.run(["apt-get", "download", PACKAGE], cwd=out, capture_output=True, text=True)
        found = sorted(out.glob(f"{PACKAGE}_*.deb"))
        if not found:
            raise UserError(f"apt-get download {PACKAGE} gave no .deb ({(done.stderr or done.stdout).strip()[-200:]});"
                            f" pass --deb")
    return found[-1]


def held_out(modules, share: float) -> set[str]:
    """The modules whose name hashes below `share` (adding a module moves no other)."""
    return {m for m in modules if int(hashlib.sha256(m.encode()).hexdigest()[:8], 16) / 16**8 < share}


def documents(pages: dict[str, str], held: set[str], out: Path) -> dict[str, int]:
    """OUT/train-docs and OUT/held-docs: each standard-library source file's docstrings, one document a file (over
    2,000 characters, as the demo's corpus), and each reference page as plain text, in held-docs where its module is
    held out, in train-docs otherwise. A page's module is its first `.. module::`."""
    held_files = {str(f) for m in held if (f := W.source_path(m))}
    counts = {"train": 0, "held": 0}
    for name in ("train-docs", "held-docs"):
        (out / name).mkdir(parents=True, exist_ok=True)
    for f, text in demo.stdlib_docstrings():  # the demo's corpus's documents
        where = "held" if str(f) in held_files else "train"
        if len(text) > 2000:
            (out / f"{where}-docs" / ("doc-" + "-".join(f.with_suffix("").parts[-2:]) + ".txt")).write_text(text)
            counts[where] += 1
    for page, rst in pages.items():
        module = next((line.split("::", 1)[1].strip() for line in rst.split("\n")
                       if line.startswith(".. module::")), None)
        text = "\n\n".join(W.clean(p) for p in rst.split("\n\n"))
        where = "held" if module in held else "train"
        if len(text) > 2000:
            (out / f"{where}-docs" / f"ref-{page}.txt").write_text(text)
            counts[where] += 1
    return counts


def scores(model, tok, held: list, rest: list) -> dict:
    """Each held-out entry's docstring among every docstring (entry -> docstring: the held-out pairs' and the
    others', distractors from modules trained on), and back (docstring -> entry among every entry), by cosine."""
    entries, docstrings = [p.reference for p in held + rest], [p.docstring for p in held + rest]
    emb = E.encode(entries + docstrings, model, tok, normalize=True)
    e, d, n = emb[:len(entries)], emb[len(entries):], len(held)
    return {"forward": retrieval.retrieval(retrieval.target_ranks([e[:n] @ d.T])),
            "back": retrieval.retrieval(retrieval.target_ranks([d[:n] @ e.T]))}


def word_scores(held: list, rest: list) -> dict:
    """BM25 and TF-IDF on the same candidates (each side's collection: every docstring, every entry)."""
    out = {"bm25": {}, "tfidf": {}}
    for way, ask, find in (("forward", "reference", "docstring"), ("back", "docstring", "reference")):
        queries = [getattr(p, ask) for p in held]
        candidates = [getattr(p, find) for p in held + rest]
        bm25 = retrieval.bm25_scores([retrieval.words(q) for q in queries], [retrieval.words(c) for c in candidates])
        rows = retrieval.tfidf_rows(queries + candidates)
        tfidf = retrieval.similarity_blocks(rows.index_select(0, torch.arange(len(queries))),
                                            rows.index_select(0, torch.arange(len(queries), rows.shape[0])))
        out["bm25"][way] = retrieval.retrieval(retrieval.target_ranks([bm25]))
        out["tfidf"][way] = retrieval.retrieval(retrieval.target_ranks([tfidf]))
    return out


def scored(path: str, held: list, rest: list, cache: Path) -> dict:
    """A model's scores on the pairs, kept in `cache` (a JSON file) once computed."""
    if cache.exists():
        return json.loads(cache.read_text())
    model, tok = M.load_pretrained(path, quiet=True)
    found = scores(cpu_layers.short_rows(model), tok, held, rest)  # as evaluate_sts.py runs it
    cache.write_text(json.dumps(found))
    return found


def train_runs(a, out: Path):
    """bench/domain.py's arms on train-docs, scored on held-docs' spans, each run kept in OUT/runs."""
    cmd = [sys.executable, str(ROOT / "bench" / "domain.py"), "--data", str(out / "train-docs"), "--eval-docs",
           str(out / "held-docs"), "--out", str(out / "runs"), "--arms", *a.arms, "--seeds", *map(str, a.seeds),
           "--steps", str(a.steps), "--span-pairs", str(a.span_pairs), "--shared", a.shared, *a.domain_flags]
    if subprocess.run(cmd).returncode:
        raise UserError(f"bench/domain.py failed: {' '.join(cmd)}")


def train_peers(a, out: Path):
    """bench/peers.py's runs on the same train-docs, each for as many minutes as the first arm's runs trained (the
    mean over its seeds), kept in OUT/peers."""
    minutes = a.peer_minutes or float(np.mean([training_minutes(out, f"{a.arms[0]}-seed{s}")[0] for s in a.seeds]))
    cmd = [sys.executable, str(ROOT / "bench" / "peers.py"), "--out", str(out), "--model", a.model, "--peers",
           *a.peers, "--seeds", *map(str, a.seeds), "--minutes", f"{minutes:.2f}"]
    if subprocess.run(cmd).returncode:
        raise UserError(f"bench/peers.py failed: {' '.join(cmd)}")


def spans_end(out: Path, run: str) -> list[dict]:
    """A DeCLUTR run's evaluated records (train.py --eval-docs and --eval-data), the start's (step 0) first."""
    records = [json.loads(x) for x in (out / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("spans_mrr") is not None]


def training_minutes(out: Path, run: str) -> tuple[float, int, int]:
    """A DeCLUTR run's minutes in its steps, its steps and the tokens it read: the tokens over the median of the
    steps' tokens a second (each a mean over the last 20 steps, which an evaluation between them slows: the
    median leaves those out, as a peer's budget leaves out its own evaluation)."""
    records = [json.loads(x) for x in (out / "runs" / run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    tokens = sum(r["tokens"] for r in steps)
    return tokens / float(np.median([r["tokens_per_s"] for r in steps])) / 60, len(steps), tokens


def peer_runs(out: Path) -> dict[str, list[str]]:
    """OUT/peers' finished runs (bench/peers.py), by peer (its name and tag): {"simcse": ["simcse-seed0", ...]}."""
    found = {}
    for run in sorted((out / "peers").glob("*-seed*/run.json")):
        found.setdefault(run.parent.name.rsplit("-seed", 1)[0], []).append(run.parent.name)
    return found


def peer_end(a, out: Path, model: Path, path: Path) -> dict:
    """A peer's held-out spans and STS-B dev as train.py's evaluation scores DeCLUTR's runs: evaluate_sts.py
    --docs on held-docs with as many pairs (the same draw: the same documents, tokenizer, lengths and seed), kept
    in `path` (JSON)."""
    if not path.exists():
        cmd = [sys.executable, str(ROOT / "evaluate_sts.py"), "--model", str(model),
               "--data", str(Path(a.shared) / "data/sts/stsbenchmark"), "--split", "dev", "--tasks", "STSB",
               "--docs", str(out / "held-docs"), "--span-pairs", str(a.span_pairs), "--cache-dir",
               str(out / "runs" / "cache"), "--json", str(path)]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode:
            raise UserError(f"evaluate_sts.py failed: {' '.join(cmd)}")
    found = json.loads(path.read_text())[str(model)]
    return {"spans_mrr": found["SPANS"]["mrr"], "stsb_dev_spearman": found["STSB"]["spearman"]}


def report(a, out: Path, n_pairs: tuple, left: dict, start: dict, words: dict) -> str:
    """Both yardsticks and STS-B dev: the start, the word baselines, each DeCLUTR arm's and each peer's end over the
    seeds with its paired difference to the start, and what each run trained for."""
    lines = [f"Pairs written apart: {n_pairs[0]:,} held-out reference entries, each to find its docstring among "
             f"{n_pairs[1]:,} (and back); left out: {left}. x 100, mean ± standard deviation over the seeds, Δ the "
             "paired difference to the start (**bold** beyond the seeds' spread); minutes in training steps "
             "(evaluations left out), steps and tokens read a run.", "",
             "| model | entry → docstring MRR | R@1 | R@10 | docstring → entry MRR | held-out spans MRR | STS-B dev |"
             " Δ entry → docstring | Δ spans | Δ STS-B | minutes, steps, tokens |", "|---" * 11 + "|"]

    def row(label, f, spans="–", stsb="–", deltas=("–", "–", "–"), took="–"):
        return (f"| {label} | {f['forward']['mrr']:.2f} | {f['forward']['recall_at_1']:.2f} | "
                f"{f['forward']['recall_at_10']:.2f} | {f['back']['mrr']:.2f} | {spans} | {stsb} | "
                f"{' | '.join(deltas)} | {took} |")
    runs = {arm: [f"{arm}-seed{s}" for s in a.seeds] for arm in a.arms}
    first = spans_end(out, runs[a.arms[0]][0])[0] if a.arms else None
    lines.append(row("the start", start, f"{first['spans_mrr']:.2f}" if first else "–",
                     f"{first['stsb_dev_spearman']:.2f}" if first else "–"))
    lines += [row(f"{retrieval.NAMES[k]} (words)", words[k],
                  f"{first[k + '_spans_mrr']:.2f}" if first else "–") for k in ("bm25", "tfidf")]
    groups = [(f"DeCLUTR, {arm}", names, [spans_end(out, r)[-1] for r in names],
               [training_minutes(out, r) for r in names], "scores-") for arm, names in runs.items()]
    for peer, names in peer_runs(out).items() if first else ():
        done = [json.loads((out / "peers" / r / "run.json").read_text()) for r in names]
        groups.append((peer, names, [peer_end(a, out, out / "peers" / r / "model", out / "peers" / r / "eval.json")
                                     for r in names],
                       [(d["minutes"], d["steps"], d["tokens"]) for d in done], "peers/"))
    if len(groups) > len(runs):  # the peers' way of scoring, checked on the start against train.py's step 0
        again = peer_end(a, out, Path(a.model), out / "peers" / "start-eval.json")
        lines[0] += (f" The start scored as the peers are (evaluate_sts.py): spans {again['spans_mrr']:.2f}, STS-B "
                     f"dev {again['stsb_dev_spearman']:.2f}; as DeCLUTR's runs are (train.py's step 0): "
                     f"{first['spans_mrr']:.2f}, {first['stsb_dev_spearman']:.2f}.")
    by_seed = {}
    for label, names, ends, took, where in groups:
        found = [json.loads((out / f"{where}{r}{'.json' if where == 'scores-' else '/scores.json'}").read_text())
                 for r in names]
        mrr = [f["forward"]["mrr"] for f in found]
        spans, stsb = [e["spans_mrr"] for e in ends], [e["stsb_dev_spearman"] for e in ends]
        mean = {d: {k: float(np.mean([f[d][k] for f in found])) for k in found[0][d]} for d in ("forward", "back")}
        minutes, steps, tokens = (np.mean(x) for x in zip(*took, strict=True))
        lines.append(row(f"{label} ({len(names)} seed{'s' if len(names) > 1 else ''})", mean, cell(spans), cell(stsb),
                         (delta(mrr, [start["forward"]["mrr"]] * len(mrr)),
                          delta(spans, [first["spans_mrr"]] * len(spans)),
                          delta(stsb, [first["stsb_dev_spearman"]] * len(stsb))),
                         f"{minutes:.1f}, {steps:.0f}, {tokens / 1e6:.2f}M"))
        by_seed[label] = {int(r.rsplit("-seed", 1)[1]): v for r, *v in zip(names, mrr, spans, stsb, strict=True)}
    return "\n".join(lines + against_best_peer(by_seed, [g[0] for g in groups[:len(runs)]])) + "\n"


def against_best_peer(by_seed: dict, arms: list[str]) -> list[str]:
    """Each DeCLUTR arm's paired difference (seed s against seed s) to the peer with the highest mean entry ->
    docstring MRR, on the three figures."""
    peers = {k: v for k, v in by_seed.items() if k not in arms}
    if not peers:
        return []
    best = max(peers, key=lambda k: np.mean([v[0] for v in peers[k].values()]))
    lines = [""]
    for arm in arms:
        seeds = sorted(set(by_seed[arm]) & set(peers[best]))
        ours, theirs = ([by_seed[k][s] for s in seeds] for k in (arm, best))
        lines.append(f"{arm} against the best peer, {best}, paired over seeds {', '.join(map(str, seeds))}: "
                     + "; ".join(f"{what} {delta([o[i] for o in ours], [t[i] for t in theirs])}" for i, what in
                                 enumerate(("entry → docstring MRR", "held-out spans MRR", "STS-B dev"))))
    return lines


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=shared_assets(ROOT), help="the shared assets folder")
    ap.add_argument("--model", default=None, help="the start (default: the shared all-MiniLM-L6-v2)")
    ap.add_argument("--deb", default="", help=f"{PACKAGE}'s .deb (default: apt-get download into --out)")
    ap.add_argument("--out", default="runs/written-apart")
    ap.add_argument("--held-share", type=float, default=0.25, help="the modules held out, by their names' hashes")
    ap.add_argument("--arms", nargs="*", default=["adjacent", "declutr"], help="bench/domain.py's arms")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--span-pairs", type=int, default=2000, help="held-out spans' pairs (bench/domain.py's)")
    ap.add_argument("--peers", nargs="*", default=["simcse", "ct", "tsdae"], help="bench/peers.py's, as long as "
                    "the first arm's runs")
    ap.add_argument("--peer-minutes", type=float, default=0, help="each peer's run instead (minutes)")
    ap.add_argument("--domain-flags", nargs=argparse.REMAINDER, default=[], help="more bench/domain.py flags, last")
    ap.add_argument("--pairs-only", action="store_true", help="the pairs, the word baselines and the start alone")
    a = ap.parse_args()
    a.model = a.model or str(Path(a.shared) / "models/all-MiniLM-L6-v2")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if sys.version_info[:2] != (3, 11):
        print(f"note: the docstrings are Python {sys.version.split()[0]}'s, the reference 3.11's", file=sys.stderr)
    pages = W.reference_sources(reference_deb(a, out))
    every, left = W.pairs(pages)
    held = held_out({p.module for p in every}, a.held_share)
    pairs, rest = [p for p in every if p.module in held], [p for p in every if p.module not in held]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p.__dict__ | {"held_out": p.module in held}) + "\n"
                                             for p in pairs + rest))
    if not (out / "train-docs").exists():
        print(f"documents: {documents(pages, held, out)}", flush=True)
    print(f"{len(every):,} pairs from {len({p.module for p in every})} modules; {len(pairs):,} held out, from "
          f"{len(held)} modules ({len(pages)} reference pages)", flush=True)
    words = word_scores(pairs, rest)
    start = scored(a.model, pairs, rest, out / "scores-start.json")
    if not a.pairs_only and a.arms:
        train_runs(a, out)
        if a.peers:
            train_peers(a, out)
        for arm in a.arms:
            for s in a.seeds:
                run = f"{arm}-seed{s}"
                scored(str(out / "runs" / run / "model"), pairs, rest, out / f"scores-{run}.json")
        for names in peer_runs(out).values():  # bench/peers.py's, where it has run
            for run in names:
                scored(str(out / "peers" / run / "model"), pairs, rest, out / "peers" / run / "scores.json")
    else:
        a.arms = []
    text = report(a, out, (len(pairs), len(every)), left, start, words)
    (out / "written_apart.md").write_text(text)
    print(f"\n{text}\n{(time.time() - t0) / 60:.0f} minutes")


if __name__ == "__main__":
    main()
