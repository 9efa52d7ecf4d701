"""
support/retrieval.py: the figures of held-out span retrieval (evaluate_sts.span_retrieval, train.py --holdout-docs),
which a reader of the method can skip: each query's target ranked among every target, recall and MRR; Wang & Isola's
alignment and uniformity; and word overlap's answers on the same pairs, the figures an encoder must beat: Okapi BM25
(the word baseline of retrieval work, as Lucene and bm25s score it) and the TF-IDF cosine.
"""
import math
import re

import numpy as np
import torch

# Han, Hiragana and Katakana: scripts written without spaces, where \w+ would take a whole clause for one word
CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
WORD = re.compile(rf"[{CJK}]+|(?:(?![{CJK}])\w)+")


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
