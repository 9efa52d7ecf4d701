"""
support/retrieval.py: the figures of held-out span retrieval (evaluate_sts.span_retrieval, train.py --holdout-docs),
which a reader of the method can skip: each query's target ranked among every target, recall and MRR; Wang & Isola's
alignment and uniformity; and word overlap's answer on the same pairs (TF-IDF), the figure an encoder must beat.
"""
import re

import numpy as np
import torch

WORD = re.compile(r"\w+")


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


def tfidf_rows(texts: list[str]) -> torch.Tensor:
    """Unit TF-IDF rows, sparse (texts, words): each lowercased word's count x log((1 + texts) / (1 + texts that
    hold it)) + 1 (scikit-learn's smoothed idf)."""
    vocab, rows, cols = {}, [], []
    for i, text in enumerate(texts):
        for word in WORD.findall(text.lower()):
            rows.append(i)
            cols.append(vocab.setdefault(word, len(vocab)))
    counts = torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.int64).reshape(2, -1),
                                     torch.ones(len(rows), dtype=torch.float64), (len(texts), len(vocab)),
                                     check_invariants=False).coalesce()  # a word's count in a text
    row, col = counts.indices()
    idf = torch.log((1 + len(texts)) / (1 + torch.bincount(col, minlength=len(vocab)))) + 1
    values = counts.values() * idf[col]
    norm = torch.zeros(len(texts), dtype=torch.float64).index_add_(0, row, values ** 2).sqrt()
    return torch.sparse_coo_tensor(counts.indices(), values / norm[row], counts.shape, check_invariants=False)


def word_overlap(queries: list[str], targets: list[str]) -> dict:
    """The same retrieval by the TF-IDF cosine of the spans' words: what an encoder must beat to have learned more
    than which words the spans share."""
    rows, n = tfidf_rows(queries + targets), len(queries)
    queries = rows.index_select(0, torch.arange(n))  # sparse (n, words); the targets dense, 512 at a time
    sims = torch.cat([torch.mm(queries, rows.index_select(0, torch.arange(n + i, min(n + i + 512, 2 * n))).to_dense().T)
                      for i in range(0, n, 512)], dim=1).numpy()  # (n, n)
    return retrieval(target_ranks([sims]))
