"""
support/retrieval.py: held-out span retrieval (evaluate_sts.py --docs, train.py --holdout-docs and --eval-docs), this
project's check on a user's own documents, not the paper's, which a reader of the method can skip: its pairs of
spans, drawn once; each query's target ranked among every target, recall and MRR; Wang & Isola's alignment and
uniformity; and word overlap's answers on the same pairs, the figures an encoder must beat: Okapi BM25 (the word
baseline of retrieval work, as Lucene and bm25s score it) and the TF-IDF cosine.
"""
import math
import re
import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from support import hub
from support.cli import UserError, flag, say
from support.corpus import prepare_corpus, texts_of

# Han, Hiragana and Katakana: scripts written without spaces, where \w+ would take a whole clause for one word
CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
WORD = re.compile(rf"[{CJK}]+|(?:(?![{CJK}])\w)+")


@dataclass
class SpansConfig:  # evaluate_sts.py's flags for held-out span retrieval, the task SPANS
    docs: list = flag(list, "also held-out span retrieval (task SPANS) on these documents (.txt/.jsonl/.parquet, "
                            "folders), beside word overlap (BM25, TF-IDF)")
    span_pairs: int = flag(4000, "SPANS: query-target pairs drawn from --docs, in the first model's tokens", low=1,
                           high=20000)
    text_field: str = flag("text", "SPANS: the field of a .jsonl line, the column of a .parquet file, with the text")
    cache_dir: str = flag("", "SPANS: --docs' tokens cache; default: $XDG_CACHE_HOME/declutr or ~/.cache/declutr")


def held_out_spans(cfg, span_lengths, load_config_and_tokenizer) -> tuple[list[str], list[str]]:
    """evaluate_sts.py --docs' query and target texts, drawn in the first model's tokens with the paper's span
    lengths (span_lengths: evaluate_sts's), up to the longest span every model reads whole (its window less <s> and
    </s>: all-MiniLM-L6-v2 reads 254), the same text for every model."""
    _, tok = load_config_and_tokenizer(cfg.model[0])
    shortest, longest = span_lengths(min(model_window(name, load_config_and_tokenizer) for name in cfg.model))
    corpus = prepare_corpus(cfg.docs, tok, cfg.cache_dir, field=cfg.text_field)
    say(f"SPANS: spans drawn in {cfg.model[0]}'s tokens, up to {longest} (what every --model reads whole)",
        file=sys.stderr)
    return span_texts(corpus, np.arange(len(corpus)), tok, cfg.span_pairs, (shortest, longest),
                      where=f"--docs {' '.join(cfg.docs)}", field=cfg.text_field)


def model_window(name: str, load_config_and_tokenizer) -> int:
    """The most tokens a model embeds a text in, <s> and </s> included (embed.max_seq_length), without its weights: its
    positions, or sentence-transformers' max_seq_length where that is less (model.load_config_and_tokenizer's config;
    the settings file comes without the weights, support.hub.resolve)."""
    folder = hub.resolve(name, weights=False)  # once: the config is read from the folder it fetched
    config, _ = load_config_and_tokenizer(str(folder))
    settings = hub.read_sentence_transformers(folder)
    return min(config.max_tokens, settings.get("max_seq_length", config.max_tokens))


# The pairs: does each query span find the span that lay near it, among every target? A query is
# drawn as an anchor is, its target as a positive is (DeCLUTR §3.2), near it in the same document;
# but never sharing a token with it, or retrieval would be a string match.

SPAN_GAP = 8  # tokens at least between a query and its target: no text of one is in the other
# The pairs' own random stream, apart from --seed, so that runs of every seed score the same pairs
# (70: the issue that brought held-out retrieval; any fixed number would do)
PAIRS_SEED = 70


class Span(NamedTuple):
    start: int  # its first token in its document
    end: int  # one past its last


class Pair(NamedTuple):
    doc: int  # the document it lies in, by its place among those the pairs were drawn from
    query: Span
    target: Span


def span_lengths(window: int, shortest: int, longest: int) -> tuple[int, int]:
    """The spans' shortest and longest, in tokens: the paper's (shortest, longest), no longer than a
    model embeds a text whole (its window less <s> and </s>: all-MiniLM-L6-v2's 254), whatever a run
    trains on, so that runs compare."""
    longest = min(longest, window - 2)
    return min(shortest, longest), longest


def span_length(rng, alpha: float, beta: float, min_span: int, max_span: int) -> int:
    """floor(p * (l_max - l_min) + l_min), p ~ Beta(alpha, beta): sampler.span_length's draw
    (§3.2), the same numbers from the same generator; written again as support/ imports no method
    file."""
    return int(rng.beta(alpha, beta) * (max_span - min_span) + min_span)


def heldout_pair(rng, n_tokens: int, min_span: int, max_span: int, gap: int) -> tuple[Span, Span]:
    """(query, target) in a stretch of n_tokens: the query's length as an anchor's (Beta(4, 2)), the
    target's as a positive's (Beta(2, 4)), at least `gap` tokens apart, on either side."""
    max_span = min(max_span, (n_tokens - gap) // 2)  # a short stretch: shorter spans
    if max_span < min_span:
        raise ValueError(f"{n_tokens} tokens: two spans of at least {min_span} tokens, {gap} "
                         f"apart, need {2 * min_span + gap}")
    query_len = span_length(rng, 4, 2, min_span, max_span)
    target_len = span_length(rng, 2, 4, min_span, max_span)
    # The query's start: uniform over those that leave room for the gap and the target after it,
    # or before it
    starts = np.arange(n_tokens - query_len + 1)
    room_after = starts + query_len + gap + target_len <= n_tokens
    room_before = starts >= target_len + gap
    starts = starts[room_after | room_before]
    query_start = int(starts[rng.integers(len(starts))])
    query_end = query_start + query_len
    # The target's start: uniform over the starts on either side, the gap kept
    before = np.arange(0, query_start - gap - target_len + 1)
    after = np.arange(query_end + gap, n_tokens - target_len + 1)
    starts = np.concatenate([before, after])
    target_start = int(starts[rng.integers(len(starts))])
    return Span(query_start, query_end), Span(target_start, target_start + target_len)


def heldout_pairs(lengths, count: int, min_span: int, max_span: int, gap: int,
                  seed: int = 0) -> list[Pair]:
    """Up to `count` pairs from documents of these lengths, no two sharing a token: every document
    cut into windows of 2·l_max + gap tokens, `count` of the windows drawn, and one pair drawn
    inside each."""
    window = 2 * max_span + gap
    windows = []  # (document, its first token, its tokens)
    for doc, n in enumerate(lengths.tolist()):
        if n >= window:
            windows += [(doc, k * window, window) for k in range(n // window)]
        elif n >= 2 * min_span + gap:  # a shorter document that holds a pair: one window, all of it
            windows.append((doc, 0, n))
    rng = np.random.default_rng([seed, PAIRS_SEED])
    chosen = np.sort(rng.choice(len(windows), size=min(count, len(windows)), replace=False))
    pairs = []
    for k in chosen:
        doc, first, n = windows[k]
        query, target = heldout_pair(rng, n, min_span, max_span, gap)
        query = Span(first + query.start, first + query.end)
        target = Span(first + target.start, first + target.end)
        pairs.append(Pair(doc, query, target))
    return pairs


def span_texts(corpus, docs, tok, count: int, lengths: tuple[int, int], *,
               where: str = "held-out span retrieval", clean: bool = True,
               field: str = "text") -> tuple[list[str], list[str]]:
    """Queries and their targets as text, drawn once (PAIRS_SEED) from the corpus's documents `docs`
    in `tok`'s tokens, `lengths` (shortest, longest) long; each span's text cut from its document
    (the tokenizer's character offsets), not decoded from its tokens: every model and both word
    baselines read the same text, as the document has it. One line, that starts with `where`, if no
    document holds a pair."""
    min_span, max_span = lengths
    docs = np.asarray(docs)
    pairs = heldout_pairs(corpus.lengths[docs], count, min_span, max_span, SPAN_GAP)
    if not pairs:
        raise UserError(f"{where}: none of its {len(docs):,} documents holds two spans of "
                        f"{min_span} tokens {SPAN_GAP} apart ({2 * min_span + SPAN_GAP} tokens)")
    texts = texts_of(corpus, sorted({int(docs[p.doc]) for p in pairs}), clean, field)
    offsets = {d: character_offsets(corpus, d, text, tok, where) for d, text in texts.items()}

    def cut(doc: int, span: Span) -> str:  # the span's tokens, as its document's text has them
        d = int(docs[doc])
        return texts[d][offsets[d][span.start][0]:offsets[d][span.end - 1][1]]

    queries = [cut(p.doc, p.query) for p in pairs]
    targets = [cut(p.doc, p.target) for p in pairs]
    q_len = np.array([p.query.end - p.query.start for p in pairs])
    t_len = np.array([p.target.end - p.target.start for p in pairs])
    say(f"{where}: {len(pairs):,} pairs from {len(texts):,} documents; queries "
        f"{q_len.min()}-{q_len.max()} tokens (mean {q_len.mean():.0f}), targets "
        f"{t_len.min()}-{t_len.max()} (mean {t_len.mean():.0f}), at least {SPAN_GAP} apart",
        file=sys.stderr)
    return queries, targets


def character_offsets(corpus, d: int, text: str, tok, where: str) -> list[tuple[int, int]]:
    """Each token's (first character, one past its last) in document d's text; one line if the text
    no longer gives the tokens the corpus holds for it."""
    found = tok.encode(text, add_special_tokens=False)
    if not np.array_equal(found.ids, corpus.tokens[corpus.offsets[d]:corpus.offsets[d + 1]]):
        raise UserError(f"{where}: its document {d + 1:,} is not the text it was tokenised from; "
                        f"was a file changed during the run? ({corpus.dir})")
    return found.offsets


def run_spans(held, tok, lengths: tuple[int, int], count: int, clean: bool = True,
              field: str = "text"):
    """train.py's pairs (--holdout-docs, --eval-docs: support.processes.EvalDocuments), the same at
    every evaluation: `lengths` the paper's, whatever the run's (evaluate_sts.span_lengths), so that
    runs compare and evaluate_sts.py --docs on the same documents gives the same figures."""
    return span_texts(held.corpus, held.docs, tok, count, lengths, where=held.flag, clean=clean,
                      field=field)


def span_retrieval(encode, model, tok, queries, targets, *, dtype=None, batch_tokens=0,
                   share=(0, 1, None)) -> dict:
    """The encoder's figures on the pairs: each query's target among every target, by the cosine of
    mean-pooled embeddings (`encode`: embed.encode) in the precision embed.py writes them; then
    their alignment and uniformity. share: (rank, world, gather) under torchrun, each process embedding its part
    (gather: its rows -> everyone's, in rank order)."""
    rank, world, gather = share
    texts = queries + targets
    part = -(-len(texts) // world)
    mine = texts[rank * part:(rank + 1) * part]
    emb = encode(mine, model, tok, batch_tokens=batch_tokens, normalize=True, dtype=dtype)
    emb = gather(emb) if world > 1 else emb  # (2n, H)
    q, t = emb[:len(queries)], emb[len(queries):]
    ranks = target_ranks(q[i:i + 1024] @ t.T for i in range(0, len(q), 1024))
    return retrieval(ranks) | alignment_uniformity(q, t)


# The figures: ranks, recall and MRR, alignment and uniformity; word overlap's


def target_ranks(blocks) -> np.ndarray:
    """blocks: similarities of consecutive queries to every target, (rows, targets) each. Each query's own target's
    rank among all the targets, from 1; a tie counts against it (a model that maps everything to one point ranks
    every target last, not first)."""
    out, i = [], 0
    for sims in blocks:
        right = sims[np.arange(len(sims)), i + np.arange(len(sims))]  # (rows,)
        out.append((sims >= right[:, None]).sum(1))
        i += len(sims)
    return np.concatenate(out)


def retrieval(ranks: np.ndarray) -> dict:
    """Recall@1, recall@10 and mean reciprocal rank, x 100, over every query."""
    return dict(recall_at_1=100 * float(np.mean(ranks <= 1)), recall_at_10=100 * float(np.mean(ranks <= 10)),
                mrr=100 * float(np.mean(1 / ranks)), n=len(ranks))


def alignment_uniformity(queries: np.ndarray, targets: np.ndarray, chunk: int = 1024) -> dict:
    """Wang & Isola (2020) on unit rows: alignment, the mean squared distance of a query to its target (lower: pairs
    closer); uniformity, the log of the mean of exp(-2 x squared distance) over every two rows of both (lower: the
    rows spread more evenly over the sphere). For unit rows, squared distance is 2 - 2 x cosine."""
    x = np.concatenate([queries, targets]).astype(np.float64)  # (2n, H)
    total = 0.0
    for i in range(0, len(x), chunk):
        near = np.exp(4 * (x[i:i + chunk] @ x.T) - 4)  # (chunk, 2n)
        total += near.sum() - np.trace(near[:, i:i + chunk])  # every pair of two different rows
    return dict(alignment=float(((queries - targets) ** 2).sum(1).mean()),
                uniformity=float(np.log(total / (len(x) * (len(x) - 1)))))


def words(text: str) -> list[str]:
    """The word baselines' tokens: each lowercased run of letters and digits; a run of Chinese or Japanese characters
    cut into its overlapping pairs of characters (one character alone: itself), as Lucene's CJK analyzer cuts it."""
    out = []
    for w in WORD.findall(text.lower()):
        if len(w) > 1 and UNSPACED.match(w):
            out += [w[i:i + 2] for i in range(len(w) - 1)]
        else:
            out.append(w)
    return out


UNSPACED = re.compile(f"[{CJK}]")


def counts(texts: list[list[str]], vocab: dict, grow: bool) -> torch.Tensor:
    """Sparse (texts, words) of each word's count in each text, coalesced; a word not in `vocab` is added (grow) or
    left out."""
    rows, cols = [], []
    for i, text in enumerate(texts):
        for word in text:
            j = vocab.setdefault(word, len(vocab)) if grow else vocab.get(word)
            if j is not None:
                rows.append(i)
                cols.append(j)
    return torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.int64).reshape(2, -1),
                                   torch.ones(len(rows), dtype=torch.float64), (len(texts), len(vocab)),
                                   check_invariants=False).coalesce()


def tfidf_rows(texts: list[str]) -> torch.Tensor:
    """Unit TF-IDF rows, sparse (texts, words): each word's count x log((1 + texts) / (1 + texts that hold it)) + 1
    (scikit-learn's smoothed idf)."""
    tf = counts([words(t) for t in texts], {}, grow=True)
    row, col = tf.indices()
    idf = torch.log((1 + len(texts)) / (1 + torch.bincount(col, minlength=tf.shape[1]))) + 1
    values = tf.values() * idf[col]
    norm = torch.zeros(len(texts), dtype=torch.float64).index_add_(0, row, values ** 2).sqrt()
    return torch.sparse_coo_tensor(tf.indices(), values / norm[row], tf.shape, check_invariants=False)


def bm25_rows(targets: list[list[str]], vocab: dict, k1: float = 1.2, b: float = 0.75) -> torch.Tensor:
    """Okapi BM25's weight of each word in each target, sparse (targets, words), the targets being the collection:
    idf x tf / (tf + k1 x (1 - b + b x length / mean length)), idf = log(1 + (N - n + 0.5) / (n + 0.5)) for a word in
    n of the N targets (Lucene's and bm25s' "lucene" variant; its constant factor k1 + 1 changes no ranking)."""
    tf = counts(targets, vocab, grow=True)
    row, col = tf.indices()
    n = torch.bincount(col, minlength=tf.shape[1]).double()
    idf = torch.log(1 + (len(targets) - n + 0.5) / (n + 0.5))
    length = torch.tensor([len(t) for t in targets], dtype=torch.float64)
    norm = k1 * (1 - b + b * length / max(float(length.mean()), 1e-12)) if len(targets) else length
    values = idf[col] * tf.values() / (tf.values() + norm[row])
    return torch.sparse_coo_tensor(tf.indices(), values, tf.shape, check_invariants=False)


def bm25_scores(queries: list[list[str]], targets: list[list[str]], k1: float = 1.2, b: float = 0.75):
    """(queries, targets) BM25 scores: each query word's weight in the target, summed over the query's words (a word
    the query repeats counts each time, as Lucene and bm25s count it); blocks of 512 targets at a time."""
    vocab = {}
    weights = bm25_rows(targets, vocab, k1, b)
    asked = counts(queries, vocab, grow=False)  # a query word in no target adds nothing
    return similarity_blocks(asked, weights)


def similarity_blocks(queries: torch.Tensor, targets: torch.Tensor, block: int = 512) -> np.ndarray:
    """Sparse (n, words) x sparse (m, words) -> dense (n, m) products of their rows, the targets dense 512 at a
    time."""
    return torch.cat([torch.mm(queries, targets.index_select(0, torch.arange(i, min(i + block, len(targets))))
                               .to_dense().T) for i in range(0, len(targets), block)], dim=1).numpy()


def word_overlap(queries: list[str], targets: list[str]) -> dict:
    """The same retrieval by the spans' words alone: what an encoder must beat to have learned more than which words
    the spans share. {"bm25": figures, "tfidf": figures, "words": the mean words of a span}; "bar": the stronger of
    the two by MRR."""
    rows, n = tfidf_rows(queries + targets), len(queries)
    tfidf = similarity_blocks(rows.index_select(0, torch.arange(n)), rows.index_select(0, torch.arange(n, 2 * n)))
    q, t = [words(x) for x in queries], [words(x) for x in targets]
    out = {"tfidf": retrieval(target_ranks([tfidf])), "bm25": retrieval(target_ranks([bm25_scores(q, t)]))}
    out["bar"] = max(("bm25", "tfidf"), key=lambda k: out[k]["mrr"])  # BM25 where they tie
    out["words"] = sum(map(len, q + t)) / max(1, len(q + t))
    return out


NAMES = {"bm25": "BM25", "tfidf": "TF-IDF"}


def few_words(per_span: float) -> str:
    """A line for when the word baselines see about one word a span (text without spaces that is not Chinese or
    Japanese: Thai, Lao, Khmer) or none (text of symbols and emoji, which are neither letters nor digits), where
    their figures are their floor, not a bar; "" otherwise."""
    if per_span >= 2 or math.isnan(per_span):
        return ""
    what = ("text with hardly a letter or digit (symbols, emoji)" if per_span < 0.5 else
            "text without spaces between its words")
    return (f"the spans hold {per_span:.1f} words each as BM25 and TF-IDF split them (runs of letters and digits): "
            f"{what}, so their figures are near chance, not a bar for the encoder")


def scored(encode, model, tok, spans: tuple, max_seq_length: int, *, dtype, batch_tokens: int, progress) -> dict:
    """evaluate_sts.py --docs, one model: span_retrieval's figures on the (queries, targets) pairs, and "cut": how
    many of the spans are longer than the model reads whole (max_seq_length tokens with <s> and </s>)."""
    progress.note(f"SPANS, {len(spans[0]):,} pairs")
    found = span_retrieval(encode, model, tok, *spans, dtype=dtype, batch_tokens=batch_tokens)
    found["cut"] = longer_than(tok, spans[0] + spans[1], max_seq_length - 2)
    return found


def longer_than(tok, texts: list[str], most: int) -> int:
    """How many of the texts are more than `most` tokens long in `tok`'s tokens: a model with that
    window reads only their start."""
    return sum(len(e.ids) > most for e in tok.encode_batch(texts, add_special_tokens=False))


def said(results: dict, models: list[str], words: dict) -> str:
    """The lines under evaluate_sts.py's SPANS rows: which word baseline is the bar to beat, how many
    spans a model read only the start of, and whether the word baselines could split the text into
    words at all."""
    bar = words[words["bar"]]
    lines = [f"SPANS: the bar to beat is {NAMES[words['bar']]}, MRR {bar['mrr']:.2f} (the word "
             f"baselines see {words['words']:.0f} words a span)"]
    lines += [f"SPANS: {m} read only the start of {results[m]['SPANS']['cut']:,} of the spans "
              f"(longer than it reads)" for m in models if results[m]["SPANS"]["cut"]]
    if few_words(words["words"]):
        lines.append(f"SPANS: {few_words(words['words'])}")
    return "\n".join(lines)
