"""
evaluate_sts.py: semantic textual similarity, the paper's Appendix C evaluation (work in progress: STS-B dev).

Spearman correlation x 100 between gold similarity scores and the cosine of the two sentences' mean-pooled
embeddings.

    python evaluate_sts.py --model runs/declutr/model --data ../shared/data/sts
"""
from pathlib import Path

import numpy as np
import torch

import model as M


def load_stsb_dev(path) -> tuple[list[str], list[str], np.ndarray]:
    """STS Benchmark sts-dev.csv (or its folder): tab-separated, no CSV quoting, extra columns ignored."""
    p = Path(path)
    if p.is_dir():
        p = next((q for q in (p / "sts-dev.csv", p / "stsbenchmark" / "sts-dev.csv") if q.exists()), p / "sts-dev.csv")
    a, b, gold = [], [], []
    for line in p.read_text(encoding="utf-8").splitlines():
        cols = line.split("\t")
        if len(cols) >= 7:
            gold.append(float(cols[4]))
            a.append(cols[5])
            b.append(cols[6])
    return a, b, np.array(gold)


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    xs = x[order]
    start = 0
    for i in range(1, len(x) + 1):
        if i == len(x) or xs[i] != xs[start]:
            ranks[order[start:i]] = (start + i + 1) / 2
            start = i
    return ranks


def spearman(x, y) -> float:
    rx, ry = rankdata(np.asarray(x, float)), rankdata(np.asarray(y, float))
    return float(np.corrcoef(rx, ry)[0, 1])


@torch.inference_mode()
def encode(model, tok, texts, batch_tokens=4096):
    sp, dev = M.special_ids(tok), next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), model.config.hidden_size), dtype=np.float32)
    i = 0
    while i < len(order):
        j = min(len(order), i + max(1, batch_tokens // max(8, len(texts[order[min(len(order), i + 64) - 1]]) // 3)))
        ids, mask = M.batch_encode(tok, [texts[k] for k in order[i:j]], model.config.max_tokens, sp["pad"])
        out[order[i:j]] = model.embed(ids.to(dev), mask.to(dev)).float().cpu().numpy()
        i = j
    return out


def spearman_of(model, tok, pairs) -> float:
    a, b, gold = pairs
    ea, eb = encode(model, tok, a), encode(model, tok, b)
    cos = (ea * eb).sum(1) / (np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1) + 1e-12)
    return 100 * spearman(cos, gold)
