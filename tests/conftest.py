"""Shared test helpers. Assets are read in place from ../shared (override with DECLUTR_SHARED)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))
MINILM = SHARED / "models" / "all-MiniLM-L6-v2"
STSB_DEV = SHARED / "data" / "sts" / "stsbenchmark" / "sts-dev.csv"


def need(path: Path):
    """Skip, saying which shared asset is missing and how to point at it."""
    if not path.exists():
        pytest.skip(f"needs {path} (set DECLUTR_SHARED to the shared/ folder)")
    return path


WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """8 documents of 600 random words: a corpus for whole training runs in seconds."""
    import numpy as np

    d = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    for i in range(8):
        (d / f"{i}.txt").write_text(" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 600)))
    return d


def stsb_sentences(limit=None):
    """Unique STS-B dev sentences, in file order (columns 6 and 7, tab-separated, no CSV quoting)."""
    seen = {}
    for line in need(STSB_DEV).read_text(encoding="utf-8").splitlines():
        cols = line.split("\t")
        for s in cols[5:7]:
            seen.setdefault(s, None)
    out = list(seen)
    return out[:limit] if limit else out


def synthetic_batch(n_docs, A=2, P=2, vocab=300, seed=0, pad=1, cls=0, sep=2, mask=4, anchor_len=(3, 41),
                    positive_len=(3, 41)):
    """A batch in sampler.py's layout with random token ids: spans of 3-40 tokens, BERT-style MLM."""
    import numpy as np
    import torch

    import sampler as S

    rng = np.random.default_rng(seed)

    def spans(n, low_high):
        lengths = rng.integers(*low_high, n) + 2
        ids = np.full((n, lengths.max()), pad)
        for row, k in zip(ids, lengths, strict=True):
            row[0], row[1:k - 1], row[k - 1] = cls, rng.integers(5, vocab, k - 2), sep
        return ids, lengths

    a, al = spans(n_docs * A, anchor_len)
    p, pl = spans(n_docs * A * P, positive_len)
    m_in, m_lab = S.mask_tokens(a, ~np.isin(a, [pad, cls, sep]), rng, mask, np.arange(5, vocab))
    t = torch.from_numpy

    def rows(ids, k):
        return t((np.arange(ids.shape[1])[None] < k[:, None]).astype(np.int64))

    return dict(anchors=t(a), anchor_mask=rows(a, al), anchor_lengths=t(al), positives=t(p), positive_mask=rows(p, pl),
                positive_lengths=t(pl), mlm_inputs=t(m_in), mlm_labels=t(m_lab),
                anchor_doc=t(np.repeat(np.arange(n_docs), A)), positive_doc=t(np.repeat(np.arange(n_docs), A * P)))


def tiny_encoder(vocab=300, seed=0, dropout=0.0):
    import torch

    import model as M

    c = M.ModelConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=130, hidden_dropout_prob=dropout,
                      attention_probs_dropout_prob=dropout)
    m = M.Encoder(c)
    m.init_weights(torch.Generator().manual_seed(seed))
    return m.train()


# The configurations whose gradient through DDP must equal one process's (tests/ddp_grad.py, test_train.py), on a
# batch whose anchors are longer than its positives, as DeCLUTR's are: the last length chunk holds no anchor.
DDP_BATCH = dict(n_docs=6, anchor_len=(25, 41), positive_len=(3, 12))
DDP_CONFIGS = {"plain": {}, "grad-cache": dict(grad_cache=True), "no-mlm": dict(mlm=False),
               "no-mlm-grad-cache": dict(mlm=False, grad_cache=True), "no-contrastive": dict(contrastive=False),
               "no-contrastive-grad-cache": dict(contrastive=False, grad_cache=True)}


def half_batch(batch, rank, world, A=2, P=2):
    """The documents of one rank when the ranks split `batch` in order."""
    n_docs = len(batch["anchors"]) // A
    k = n_docs // world
    out = {}
    for key, v in batch.items():
        per = A * P if key.startswith("positive") else A
        out[key] = v[rank * k * per:(rank + 1) * k * per]
    return out
