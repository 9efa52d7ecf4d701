"""
evaluate_sts.py: semantic textual similarity, the paper's Appendix C (via SentEval), and held-out
span retrieval on a user's own documents, this project's check.

Each STS task gives sentence pairs with gold similarity scores; a model's score is the Spearman
correlation x 100 between the gold scores and the cosine of the two sentences' mean-pooled
embeddings (Pearson beside it). Tasks are found under --data by their original file layouts: the
STS Benchmark (sts-dev.csv, sts-test.csv), SICK-R (SICK_trial.txt, SICK_test_annotated.txt, or
SICK.txt) and SemEval STS12-16 (folders STS12 ... or SentEval's STS12-en-test ..., with
STS.input.NAME.txt beside STS.gs.NAME.txt). STS12-16 are reported two ways: "all", every subset's
pairs pooled (as SimCSE reports), and "mean", the mean over subsets (as SentEval and the DeCLUTR
paper report).

    python evaluate_sts.py --model sentence-transformers/all-MiniLM-L6-v2 --data sts/ --split dev
    python evaluate_sts.py --model runs/a/model --model runs/b/model --data SentEval/data/STS
    python evaluate_sts.py --model runs/a/model --split test   # no --data: downloads STS-B once
    python evaluate_sts.py --model runs/a/model --split dev --output-dtype int8 binary
    python evaluate_sts.py --model runs/a/model --model roberta-base --docs my-held-out-docs/

On the user's own documents (--docs; train.py --holdout-docs or --eval-docs during a run), held-out
span retrieval (SPANS): query spans drawn as anchors are, each paired with a target drawn as a
positive near it but sharing no text (support/retrieval.py), every target a candidate for every
query, scored beside word overlap (BM25 and TF-IDF).
"""
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embed import encode, max_seq_length
from model import load_config_and_tokenizer, load_pretrained
from sampler import SamplerConfig
from support import cpu_layers, retrieval
from support.cli import Progress, UserError, cli, flag, parse_config
from support.device import OnDevice, device_and_dtype
from support.files import write_json
from support.quantize import PRECISIONS, quantize, ranges_of, similarities
from support.sts_files import FEW, no_nan, table, tasks_to_score
from support.threads import cpu_threads


@dataclass
class EvalConfig(retrieval.SpansConfig, OnDevice):  # these, --docs', embed.py's --dtype ...
    model: list = flag(list, "one or more models (hub ids or local directories), side by side")
    data: str = flag("", "folder the task files are found in; empty: STS Benchmark, downloaded")
    tasks: list = flag(list, "of STSB SICKR STS12 STS13 STS14 STS15 STS16; default: all found")
    split: str = flag("test", "STS12-16 have only test data", choices=("test", "dev"))
    json: str = flag("", "also write the scores here")
    batch_tokens: int = flag(0, "embed.py's token budget per batch (0: its default)", low=0)
    output_dtype: list = flag(list, "also score rows as embed.py --output-dtype writes them: "
                                    "int8 (cosine; ranges per task or subset), binary (Hamming)")

    def validate(self):
        if unknown := [t for t in self.tasks if t not in TASKS]:
            raise UserError(f"--tasks {unknown[0]}: not a task (one of {', '.join(TASKS)})", code=2)
        if unknown := [p for p in self.output_dtype if p not in ("float32", *PRECISIONS)]:
            raise UserError(f"--output-dtype {unknown[0]}: not one of float32, "
                            f"{', '.join(PRECISIONS)}", code=2)


TASKS = ("STSB", "SICKR", "STS12", "STS13", "STS14", "STS15", "STS16")
ONE_SET = ("STSB", "SICKR")  # one set of pairs each; STS12-16 have several subsets


# -----------------------------------------------------------------------------------------------
# Scoring: Spearman of cosine similarities against the gold scores


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks from 1; tied values share the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    xs, ranks = x[order], np.empty(len(x))
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    ends = np.r_[starts[1:], len(x)]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2
    return ranks


def pearson(x, y) -> float:
    """nan where it is undefined (fewer than two pairs, or a constant side), as a correlation should
    be."""
    x, y = np.asarray(x, float) - np.mean(x), np.asarray(y, float) - np.mean(y)
    den = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if len(x) > 1 and den > 0 else float("nan")


def spearman(x, y) -> float:
    return pearson(rankdata(np.asarray(x, float)), rankdata(np.asarray(y, float)))


def cosines(model, tok, a, b, *, batch_tokens=0, progress=None, dtype=None, precision="float32",
            cache=None) -> np.ndarray:
    """Each pair's cosine; for int8 and binary, of the rows embed.py --output-dtype would write
    (support/quantize.py; int8's ranges from these sentences), Hamming similarity for binary. cache:
    the embeddings, kept for another precision's turn."""
    sentences = list(dict.fromkeys(a + b))  # each sentence embedded once
    key = (id(model), tuple(sentences))
    emb = cache.get(key) if cache is not None else None
    if emb is None:
        done = 0

        def report(texts: int, windows: int):  # embed.py's progress, after each batch
            nonlocal done
            done += texts
            progress(f"{done:,}/{len(sentences):,} sentences")

        emb = encode(sentences, model, tok, batch_tokens=batch_tokens, normalize=True, dtype=dtype,
                     progress=report if progress else None)
        if cache is not None:
            cache[key] = emb
    where = {s: i for i, s in enumerate(sentences)}
    ia, ib = [where[s] for s in a], [where[s] for s in b]
    if precision == "float32":
        return (emb[ia] * emb[ib]).sum(1)
    ranges = ranges_of(emb) if precision == "int8" else None
    rows = quantize(emb, precision, ranges)
    return similarities(rows[ia], rows[ib], precision)


def _mean(values) -> float:
    """Mean over the subsets that have a score (a subset of one scored pair has none)."""
    v = [x for x in values if not np.isnan(x)]
    return float(np.mean(v)) if v else float("nan")


def score(model, tok, tasks, *, batch_tokens=0, progress=None, dtype=None, precision="float32",
          cache=None) -> dict:
    """{task: scores} for tasks of {subset: (a, b, gold)}; a task or subset of fewer than FEW pairs
    carries few_pairs: true. STS-B and SICK-R are one set of pairs each; STS12-16 are reported two
    ways, every subset's pairs pooled ("all", as SimCSE) and the mean over subsets (as SentEval and
    the paper)."""
    out = {}
    for task, subsets in tasks.items():
        cos, per = {}, {}
        for name, (a, b, gold) in subsets.items():
            if progress:
                subset = "" if task in ONE_SET else f" {name}"
                progress.note(f"{task}{subset}, {len(gold):,} pairs")
            cos[name] = cosines(model, tok, a, b, batch_tokens=batch_tokens, progress=progress,
                                dtype=dtype, precision=precision, cache=cache)
            per[name] = correlations(cos[name], gold)
        every_cos = np.concatenate(list(cos.values()))
        every_gold = np.concatenate([gold for *_, gold in subsets.values()])
        pooled = correlations(every_cos, every_gold)
        if task in ONE_SET:
            out[task] = pooled
            continue
        out[task] = {"all": pooled["spearman"], "mean": _mean(p["spearman"] for p in per.values()),
                     "pearson_all": pooled["pearson"],
                     "pearson_mean": _mean(p["pearson"] for p in per.values()), "subsets": per}
        out[task] |= {k: v for k, v in pooled.items() if k in ("n", "few_pairs")}
    return out


def correlations(cos: np.ndarray, gold: np.ndarray) -> dict:
    few = {"few_pairs": True} if len(gold) < FEW else {}
    return dict(spearman=100 * spearman(cos, gold), pearson=100 * pearson(cos, gold), n=len(gold),
                **few)


def spearman_of(model, tok, pairs, dtype=None) -> float:
    a, b, gold = pairs
    return 100 * spearman(cosines(model, tok, a, b, dtype=dtype), gold)


@cli
def main(argv=None):
    cfg = parse_config(EvalConfig, argv, __doc__.split("\n\n")[0])
    with cpu_threads(cfg.threads):
        evaluate(cfg)


def evaluate(cfg: EvalConfig):
    """`python evaluate_sts.py`: every model on every task found, side by side."""
    if not cfg.model:
        raise UserError("no --model given")
    if cfg.json and not Path(cfg.json).resolve().parent.is_dir():
        raise UserError(f"--json {cfg.json}: no folder {Path(cfg.json).parent} to write it into")
    # No --data: the STS Benchmark, downloaded once; --docs without --data or --tasks: SPANS alone
    spans_alone = cfg.docs and not (cfg.data or cfg.tasks)
    tasks = {} if spans_alone else tasks_to_score(cfg.data, cfg.split, cfg.tasks)
    # --docs: held-out span retrieval's pairs, drawn once, the same text for every model
    spans = cfg.docs and retrieval.held_out_spans(cfg, span_lengths, load_config_and_tokenizer)
    device, dtype = device_and_dtype(cfg.device, cfg.dtype)
    results = {}
    for name in cfg.model:
        t0 = time.time()
        model, tok = load_pretrained(name, quiet=True)
        # On a CPU, short rows' attention written out and, in bf16 where this processor runs them,
        # the layers' products as oneDNN's (support/cpu_layers.py); `runs` says so in the first line
        model, runs = cpu_layers.for_inference(model.to(device), device, dtype, cfg)
        scored = ", ".join([*tasks, *(["SPANS"] if spans else [])])
        progress = Progress("evaluate", f"{name} on {scored}, {runs}")
        cache = {}  # each sentence embedded once, then quantised for each --output-dtype
        for precision in dict.fromkeys(["float32", *cfg.output_dtype]):
            label = name if precision == "float32" else f"{name} {precision}"
            results[label] = score(model, tok, tasks, batch_tokens=cfg.batch_tokens,
                                   progress=progress, dtype=dtype, precision=precision, cache=cache)
        if spans:  # each query's target among all targets (support/retrieval.py)
            results[name]["SPANS"] = retrieval.scored(
                encode, model, tok, spans, max_seq_length(model), dtype=dtype,
                batch_tokens=cfg.batch_tokens, progress=progress)
        progress.note(f"{name}: {len(tasks) + bool(spans)} tasks in {time.time() - t0:.0f}s")
    if spans:
        words = retrieval.word_overlap(*spans)
        results |= {f"{retrieval.NAMES[k]} (words)": {"SPANS": words[k]} for k in ("bm25", "tfidf")}
    binary = "\n(binary: of Hamming similarity)" if "binary" in cfg.output_dtype else ""
    print(table(results) + binary)
    if spans:
        print(retrieval.said(results, cfg.model, words))
    if cfg.json:
        write_json(Path(cfg.json), no_nan(results if len(results) > 1 else results[cfg.model[0]]))


def span_lengths(most_tokens: int) -> tuple[int, int]:
    """Held-out spans' shortest and longest: the paper's 32 and 512 (§3.2), whatever a run trains
    on, no longer than a model embeds a text whole (support.retrieval.span_lengths)."""
    return retrieval.span_lengths(most_tokens, SamplerConfig.min_span, SamplerConfig.max_span)


if __name__ == "__main__":
    main()
