"""
evaluate_sts.py: semantic textual similarity, the evaluation of the paper's Appendix C (via SentEval).

Each task gives sentence pairs with gold similarity scores; a model's score is the Spearman correlation x 100
between the gold scores and the cosine of the two sentences' mean-pooled embeddings (Pearson beside it).
Tasks are found under --data by their original file layouts: the STS Benchmark (sts-dev.csv, sts-test.csv),
SICK-R (SICK_trial.txt, SICK_test_annotated.txt, or SICK.txt) and SemEval STS12-16 (folders STS12 ... or
SentEval's STS12-en-test ..., with STS.input.NAME.txt beside STS.gs.NAME.txt). STS12-16 are reported two
ways: "all", every subset's pairs pooled (as SimCSE reports), and "mean", the mean over subsets (as SentEval
and the DeCLUTR paper report).

    python evaluate_sts.py --model sentence-transformers/all-MiniLM-L6-v2 --data sts/ --split dev
    python evaluate_sts.py --model runs/a/model --model runs/b/model --data SentEval/data/downstream/STS --json out.json
    python evaluate_sts.py --model runs/a/model --split test      # no --data: downloads the STS Benchmark once
    python evaluate_sts.py --model runs/a/model --split dev --output-dtype int8 binary    # what quantising costs
    python evaluate_sts.py --model runs/a/model --model roberta-base --docs my-held-out-docs/   # SPANS, beside BM25

On the user's own documents (--docs; train.py --holdout-docs or --eval-docs during a run), held-out span retrieval
(SPANS): query spans drawn as anchors are, each paired with a target drawn as a positive near it but sharing no text
(sampler.heldout_pairs), every target a candidate for every query, scored beside word overlap (BM25 and TF-IDF).
"""
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embed import encode, max_tokens
from model import load_config_and_tokenizer, load_pretrained
from sampler import SamplerConfig, heldout_pairs
from support import cpu_layers, hub
from support.cli import Progress, UserError, cli, flag, parse_config, say
from support.corpus import prepare_corpus, texts_of
from support.device import OnDevice, device_and_dtype
from support.files import write_json
from support.quantize import PRECISIONS, quantize, ranges_of, similarities
from support.retrieval import NAMES, alignment_uniformity, few_words, retrieval, target_ranks, word_overlap
from support.sts_files import FEW, no_nan, table, tasks_to_score
from support.threads import cpu_threads


@dataclass
class EvalConfig(OnDevice):  # --dtype, --device and --threads as embed.py's (support.device.OnDevice), then these
    model: list = flag(list, "one or more models (hub ids or local directories), side by side")
    data: str = flag("", "folder holding the task files (searched recursively); empty: download the STS Benchmark")
    tasks: list = flag(list, "subset of STSB SICKR STS12 STS13 STS14 STS15 STS16 (default: all found)")
    split: str = flag("test", "STS12-16 have only test data", choices=("test", "dev"))
    json: str = flag("", "also write the scores here")
    batch_tokens: int = flag(0, "embed.py's token budget per batch (0: its default)", low=0)
    output_dtype: list = flag(list, "also score the rows as embed.py --output-dtype writes them: int8 (ranges from "
                                    "the task's sentences; cosine), binary (Hamming similarity)")
    docs: list = flag(list, "also held-out span retrieval (task SPANS) on these documents (.txt/.jsonl/.parquet, "
                            "folders), beside word overlap (BM25, TF-IDF)")
    span_pairs: int = flag(4000, "SPANS: query-target pairs drawn from --docs, in the first model's tokens",
                           low=1, high=20000)
    text_field: str = flag("text", "SPANS: the field of a .jsonl line, the column of a .parquet file, with the text")
    cache_dir: str = flag("", "SPANS: --docs' tokens cache; default: $XDG_CACHE_HOME/declutr or ~/.cache/declutr")

    def validate(self):
        if unknown := [t for t in self.tasks if t not in TASKS]:
            raise UserError(f"--tasks {unknown[0]}: not a task (one of {', '.join(TASKS)})", code=2)
        if unknown := [p for p in self.output_dtype if p not in ("float32", *PRECISIONS)]:
            raise UserError(f"--output-dtype {unknown[0]}: not one of float32, {', '.join(PRECISIONS)}", code=2)


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
    """nan where it is undefined (fewer than two pairs, or a constant side), as a correlation should be."""
    x, y = np.asarray(x, float) - np.mean(x), np.asarray(y, float) - np.mean(y)
    den = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / den) if len(x) > 1 and den > 0 else float("nan")


def spearman(x, y) -> float:
    return pearson(rankdata(np.asarray(x, float)), rankdata(np.asarray(y, float)))


def cosines(model, tok, a, b, batch_tokens=0, progress=None, dtype=None, precision="float32", cache=None) -> np.ndarray:
    """Each pair's cosine; for int8 and binary, of the rows embed.py --output-dtype would write (support/quantize.py;
    int8's ranges from these sentences), Hamming similarity for binary. cache: the embeddings, kept for another
    precision's turn."""
    uniq = list(dict.fromkeys(a + b))  # each sentence embedded once
    done = [0]

    def report(texts: int, windows: int):
        done[0] += texts
        progress(f"{done[0]:,}/{len(uniq):,} sentences")

    emb = (cache or {}).get(key := (id(model), tuple(uniq)))
    if emb is None:
        emb = encode(uniq, model, tok, batch_tokens=batch_tokens, normalize=True, dtype=dtype,
                     progress=report if progress else None)
        if cache is not None:
            cache[key] = emb
    where = {s: i for i, s in enumerate(uniq)}
    ia, ib = [where[s] for s in a], [where[s] for s in b]
    if precision == "float32":
        return (emb[ia] * emb[ib]).sum(1)
    rows = quantize(emb, precision, ranges_of(emb) if precision == "int8" else None)
    return similarities(rows[ia], rows[ib], precision)


def _mean(values) -> float:
    """Mean over the subsets that have a score (a subset of one scored pair has none)."""
    v = [x for x in values if not np.isnan(x)]
    return float(np.mean(v)) if v else float("nan")


def score(model, tok, tasks, batch_tokens=0, progress=None, dtype=None, precision="float32", cache=None) -> dict:
    """{task: scores} for tasks of {subset: (a, b, gold)}; a task or subset of fewer than FEW pairs carries few_pairs:
    true. STS-B and SICK-R are one set of pairs each; STS12-16 are reported two ways, every subset's pairs pooled
    ("all", as SimCSE) and the mean over subsets (as SentEval and the paper)."""
    out = {}
    for task, subsets in tasks.items():
        cos, per = {}, {}
        for name, (a, b, gold) in subsets.items():
            if progress:
                progress.note(f"{task}{'' if task in ONE_SET else ' ' + name}, {len(gold):,} pairs")
            cos[name] = cosines(model, tok, a, b, batch_tokens, progress, dtype, precision, cache)
            per[name] = correlations(cos[name], gold)
        pooled = correlations(np.concatenate(list(cos.values())), np.concatenate([g for *_, g in subsets.values()]))
        out[task] = pooled if task in ONE_SET else {
            "all": pooled["spearman"], "mean": _mean(p["spearman"] for p in per.values()),
            "pearson_all": pooled["pearson"], "pearson_mean": _mean(p["pearson"] for p in per.values()),
            "subsets": per} | {k: v for k, v in pooled.items() if k in ("n", "few_pairs")}
    return out


def correlations(cos: np.ndarray, gold: np.ndarray) -> dict:
    return dict(spearman=100 * spearman(cos, gold), pearson=100 * pearson(cos, gold), n=len(gold),
                **({"few_pairs": True} if len(gold) < FEW else {}))


def spearman_of(model, tok, pairs, dtype=None) -> float:
    a, b, gold = pairs
    return 100 * spearman(cosines(model, tok, a, b, dtype=dtype), gold)


# -----------------------------------------------------------------------------------------------
# Held-out span retrieval: on the user's own documents, does each query span find the span that lay near it
# (sampler.heldout_pairs) among every target? Word overlap's answers (BM25, TF-IDF) beside it: the figures to beat.

SPAN_GAP = 8  # tokens at least between a query and its target: the target's text is nowhere in its query


def span_lengths(window: int) -> tuple[int, int]:
    """The spans' shortest and longest, in tokens: the paper's 32 and 512, no longer than a model embeds a text whole
    (its window less <s> and </s>: all-MiniLM-L6-v2's 254), whatever a run trains on, so that runs compare."""
    longest = min(SamplerConfig.max_span, window - 2)
    return min(SamplerConfig.min_span, longest), longest


def span_texts(corpus, docs, tok, count: int, min_span: int, max_span: int, where: str = "held-out span retrieval",
               clean: bool = True, field: str = "text") -> tuple[list[str], list[str]]:
    """Queries and their targets as text, drawn once (a fixed seed) from the corpus's documents `docs` in `tok`'s
    tokens, each span's text cut from its document (the tokenizer's character offsets), not decoded from its tokens:
    every model and both word baselines read the same text, as the document has it. One line, that starts with
    `where`, if the documents hold no pair."""
    pairs = heldout_pairs(corpus.lengths[docs], count, min_span, max_span, SPAN_GAP)  # (n, 5)
    if len(pairs) == 0:
        raise UserError(f"{where}: none of its {len(docs):,} documents holds two spans of "
                        f"{min_span} tokens {SPAN_GAP} apart ({2 * min_span + SPAN_GAP} tokens)")
    doc = np.asarray(docs)[pairs[:, 0]]
    offsets, texts = {}, texts_of(corpus, np.unique(doc), clean, field)
    for d, text in texts.items():
        found = tok.encode(text, add_special_tokens=False)
        if not np.array_equal(found.ids, corpus.tokens[corpus.offsets[d]:corpus.offsets[d + 1]]):
            raise UserError(f"{where}: its document {d + 1:,} is not the text it was tokenised from; was a file "
                            f"changed during the run? ({corpus.dir})")
        offsets[d] = found.offsets  # each token's (first character, one past its last)

    def cut(d, i, j):  # tokens i to j - 1 of document d, as its text has them
        return texts[d][offsets[d][i][0]:offsets[d][j - 1][1]]

    queries = [cut(d, q0, q1) for d, (_, q0, q1, _, _) in zip(doc, pairs, strict=True)]
    targets = [cut(d, t0, t1) for d, (_, _, _, t0, t1) in zip(doc, pairs, strict=True)]
    q_len, t_len = pairs[:, 2] - pairs[:, 1], pairs[:, 4] - pairs[:, 3]
    say(f"{where}: {len(pairs):,} pairs from {len(texts):,} documents; queries {q_len.min()}-{q_len.max()} tokens "
        f"(mean {q_len.mean():.0f}), targets {t_len.min()}-{t_len.max()} (mean {t_len.mean():.0f}), at least "
        f"{SPAN_GAP} apart", file=sys.stderr)
    return queries, targets


def span_retrieval(model, tok, queries, targets, dtype=None, batch_tokens=0, share=(0, 1, None)) -> dict:
    """The encoder's figures on the pairs: each query's target among every target, by the cosine of mean-pooled
    embeddings in the precision embed.py writes them; then their alignment and uniformity. share: (rank, world,
    gather) under torchrun, each process embedding its part (gather: its rows -> everyone's, in rank order)."""
    rank, world, gather = share
    texts = queries + targets
    part = -(-len(texts) // world)
    emb = encode(texts[rank * part:(rank + 1) * part], model, tok, batch_tokens=batch_tokens, normalize=True,
                 dtype=dtype)
    emb = gather(emb) if world > 1 else emb  # (2n, H)
    q, t = emb[:len(queries)], emb[len(queries):]
    ranks = target_ranks(q[i:i + 1024] @ t.T for i in range(0, len(q), 1024))
    return retrieval(ranks) | alignment_uniformity(q, t)


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
    # no --data: the STS Benchmark, downloaded once; with --docs and no --data or --tasks: SPANS alone
    tasks = {} if cfg.docs and not (cfg.data or cfg.tasks) else tasks_to_score(cfg.data, cfg.split, cfg.tasks)
    spans = held_out_spans(cfg) if cfg.docs else None
    device, dtype = device_and_dtype(cfg.device, cfg.dtype)
    results = {}
    for name in cfg.model:
        progress = Progress("evaluate", f"{name} on {', '.join([*tasks, *['SPANS'] * bool(spans)])}")
        model, tok, cache = *load_pretrained(name, quiet=True), {}
        model.to(device)
        if cfg.onednn:  # on a CPU, the layers' products as oneDNN's, weights laid out once (support/cpu_layers.py)
            model = cpu_layers.swap_in(model, dtype)
        for precision in dict.fromkeys(["float32", *cfg.output_dtype]):  # each embedded once, then quantised
            label = name if precision == "float32" else f"{name} {precision}"
            results[label] = score(model, tok, tasks, cfg.batch_tokens, progress, dtype, precision, cache)
        if spans:
            progress.note(f"SPANS, {len(spans[0]):,} pairs")
            results[name]["SPANS"] = span_retrieval(model, tok, *spans, dtype, cfg.batch_tokens)
            results[name]["SPANS"]["cut"] = longer_than(tok, spans[0] + spans[1], max_tokens(model) - 2)
        progress.note(f"{name}: {len(tasks) + bool(spans)} tasks in {time.time() - progress.t0:.0f}s")
    if spans:
        words = word_overlap(*spans)
        results |= {f"{NAMES[k]} (words)": {"SPANS": words[k]} for k in ("bm25", "tfidf")}
    print(table(results) + ("\n(binary: of Hamming similarity)" if "binary" in cfg.output_dtype else ""))
    if spans:
        print(spans_said(results, cfg.model, words))
    if cfg.json:
        write_json(Path(cfg.json), no_nan(results if len(results) > 1 else results[cfg.model[0]]))


def held_out_spans(cfg: EvalConfig) -> tuple[list[str], list[str]]:
    """--docs' query and target texts, drawn in the first model's tokens with the paper's span lengths, up to the
    longest span every model reads whole (its window less <s> and </s>: all-MiniLM-L6-v2 reads 254), the same text
    for every model."""
    config, tok = load_config_and_tokenizer(cfg.model[0])
    shortest, longest = span_lengths(min(window(name) for name in cfg.model))
    corpus = prepare_corpus(cfg.docs, tok, cfg.cache_dir, field=cfg.text_field)
    say(f"SPANS: spans drawn in {cfg.model[0]}'s tokens, up to {longest} (what every --model reads whole)",
        file=sys.stderr)
    return span_texts(corpus, np.arange(len(corpus)), tok, cfg.span_pairs, shortest, longest,
                      where=f"--docs {' '.join(cfg.docs)}", field=cfg.text_field)


def window(name: str) -> int:
    """The most tokens a model embeds a text in, <s> and </s> included (embed.max_tokens), without its weights."""
    config, _ = load_config_and_tokenizer(name)
    limit = hub.read_sentence_transformers(hub.resolve(name, weights=False)).get("max_seq_length", config.max_tokens)
    return min(config.max_tokens, limit)


def longer_than(tok, texts: list[str], most: int) -> int:
    """How many of the texts are more than `most` tokens long in `tok`'s tokens (a model reads only their start)."""
    return sum(len(e.ids) > most for e in tok.encode_batch(texts, add_special_tokens=False))


def spans_said(results: dict, models: list[str], words: dict) -> str:
    """What the SPANS rows say: which word baseline is the bar, how many spans a model read cut, and whether the
    word baselines could split the text into words at all."""
    bar = words[words["bar"]]
    lines = [f"SPANS: the bar to beat is {NAMES[words['bar']]}, MRR {bar['mrr']:.2f} (the word baselines see "
             f"{words['words']:.0f} words a span)"]
    lines += [f"SPANS: {m} read only the start of {results[m]['SPANS']['cut']:,} of the spans (longer than it reads)"
              for m in models if results[m]["SPANS"]["cut"]]
    return "\n".join(lines + [few_words(words["words"])] * bool(few_words(words["words"])))


if __name__ == "__main__":
    main()
