"""
bench/_spans.py: a step's spans for the scripts that estimate a GPU's step on a CPU (bench/gpu_memory.py,
bench/compile_time.py) and for the tests: not a script, so that no script imports another. A batch in the
sampler's layout with lengths by its laws, and the chunks train.train_step cuts it into.
"""
import numpy as np
import torch

import sampler
import train
from support.chunks import Chunks


def span_batch(n_docs: int, vocab: int, seed: int = 0, A: int = 2, P: int = 2, max_span: int = 510):
    """A step's batch in the sampler's layout, lengths by its laws, random token ids; BERT-style MLM on the anchors."""
    rng = np.random.default_rng(seed)

    def spans(n, a, b):
        lengths = np.array([sampler.span_length(rng, a, b, 32, max_span) + 2 for _ in range(n)])
        ids = np.ones((n, lengths.max()), dtype=np.int64)  # padding id 1, RoBERTa's
        for row, k in zip(ids, lengths, strict=True):
            row[0], row[1:k - 1], row[k - 1] = 0, rng.integers(5, vocab, k - 2), 2
        return ids, lengths

    a, al = spans(n_docs * A, 4, 2)
    p, pl = spans(n_docs * A * P, 2, 4)
    m_in, m_lab = sampler.mask_tokens(a, ~np.isin(a, [0, 1, 2]), rng, 4, np.arange(5, vocab))
    t = torch.from_numpy
    return dict(anchors=t(a), anchor_lengths=t(al), positives=t(p), positive_lengths=t(pl), mlm_inputs=t(m_in),
                mlm_labels=t(m_lab))


def step_chunks(batch, encoder, cfg=None, multiple=None) -> Chunks:
    """A step's spans cut into chunks as train.train_step cuts them (support/chunks.py's Chunks)."""
    cfg = cfg or train.TrainConfig()
    dev, n, P = next(encoder.parameters()).device, len(batch["anchors"]), cfg.num_positives if cfg.contrastive else 0
    anchors = batch["mlm_inputs"] if cfg.mlm else batch["anchors"]
    groups = [(anchors, batch["anchor_lengths"]), (batch["positives"][:n * P], batch["positive_lengths"][:n * P])]
    return Chunks(groups, batch["mlm_labels"] if cfg.mlm else None, cfg.chunk_tokens, dev, encoder.config.pad_token_id,
                  **({"multiple": multiple} if multiple else {}))
