"""
support/chunks.py: a training step's spans cut into chunks of similar length, and each chunk's inputs worked out on
the host. Token-wise layers skip padding anyway (model.py), but attention costs T^2 per span, so on a CPU a 40-token
positive never waits on a 500-token anchor; on a GPU one chunk per token budget, where launches cost more than
padding. What train.py's step does with them is the method; this is how it is fed.
"""
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from support.device import autocast_dtype, compute, padding_mask, to_device


class Chunk(NamedTuple):
    """One chunk of a step's spans, on the device: what the encoder and the MLM head take (train.chunk_forward)."""
    ids: torch.Tensor  # (g, T) token ids, padded on the right
    mask: torch.Tensor  # (g, T) 0/1 attention mask
    positions: torch.Tensor  # (N,) the real tokens' flat places in (g*T): model.Packing's, worked out here
    mlm_at: torch.Tensor | None  # (K,) the anchors' masked tokens' flat places in (g*T); None: no MLM
    mlm_targets: torch.Tensor | None  # (K,) what those tokens were (-100: ignored)


class Spans:
    """One step's spans as one list: the anchors first (MLM-corrupted when MLM is on), then their positives, P per
    anchor in order, cut into chunks of similar length (`rows[k]`: the spans chunk k holds, `chunks[k]`: its inputs).
    Each chunk's inputs are worked out on the host from the lengths the sampler gives, and copied to the device from
    page-locked memory without waiting (to_device): nothing in the step makes the host wait for the GPU. A copy each,
    a few dozen a step, costs microseconds beside a step's hundreds of milliseconds on a GPU."""

    def __init__(self, batch, cfg, encoder, multiple: int | None = None):
        self.device = device = next(encoder.parameters()).device
        self.n_anchors, self.mlm = len(batch["anchors"]), cfg.mlm
        # On a GPU a chunk's width is a multiple of 8: inductor guards on the attention mask's width modulo 8 there
        # (torch/_inductor/lowering.py, sdpa_constraint), so mixed widths would compile a second graph per mode
        self.multiple = multiple or (8 if device.type == "cuda" else 1)
        anchors = batch["mlm_inputs"] if cfg.mlm else batch["anchors"]
        positives = batch["positives"] if cfg.contrastive else batch["positives"][:0]  # MLM alone needs no positives
        lengths = torch.cat([batch["anchor_lengths"], batch["positive_lengths"][:len(positives)]]).numpy()  # (S,)
        self.lengths = lengths
        # Spans of similar length run together, within a token budget. On a GPU, one chunk per budget: a chunk more
        # costs more in launches than the padding inside one, which the token-wise layers skip anyway.
        self.rows = length_groups(lengths, cfg.chunk_tokens, spread=0.8 if device.type == "cpu" else 0.0)
        T, pad = self.width(max(anchors.shape[1], positives.shape[1])), encoder.config.pad_token_id
        ids = torch.cat([F.pad(anchors, (0, T - anchors.shape[1]), value=pad),
                         F.pad(positives, (0, T - positives.shape[1]), value=pad)]).numpy()  # (S, T)
        labels = batch["mlm_labels"].numpy()
        self.chunks = [self._chunk(rows, ids, lengths, labels) for rows in self.rows]
        order = np.concatenate(self.rows)
        self.order, self.unsort = to_device(order, device), to_device(np.argsort(order), device)
        self.n_masked = int((labels != -100).sum())
        self.compute = compute(autocast_dtype(cfg.dtype, device), device)  # --dtype, and the attention kernels

    def _chunk(self, rows, ids, lengths, labels) -> Chunk:
        T = self.width(int(lengths[rows].max()))
        mask = padding_mask(lengths[rows], T).astype(np.int64)  # (g, T)
        # §3.3: where the anchors' masked tokens are in the chunk's (g, T) layout, and what they were
        anchors = np.flatnonzero(rows < self.n_anchors)  # the chunk's rows that hold anchors
        chunk_labels = labels[rows[anchors], :T]
        i, j = np.nonzero(chunk_labels != -100)
        at, targets = anchors[i] * T + j, chunk_labels[i, j]
        # Every chunk gets the same kinds of input, so that --compile builds one graph for them all: the real
        # tokens' positions even where there is no padding, and at least two MLM targets, the added ones ignored
        # (-100): a chunk with none or one would be a graph of its own, as the compiler treats sizes 0 and 1 apart.
        pad = max(0, 2 - len(at))
        at, targets = np.r_[at, [0] * pad].astype(np.int64), np.r_[targets, [-100] * pad].astype(np.int64)
        ids, mask, positions, at, targets = (to_device(x, self.device) for x in
                                             (ids[rows, :T], mask, np.flatnonzero(mask), at, targets))
        return Chunk(ids, mask, positions, *((at, targets) if self.mlm else (None, None)))

    def width(self, longest: int) -> int:
        return -(-longest // self.multiple) * self.multiple


def length_groups(lengths: np.ndarray, budget: int, spread: float = 0.8) -> list[np.ndarray]:
    """Span indices sorted by length, cut into chunks whose padded size stays within `budget` tokens and
    whose shortest span is at least `spread` of the longest: token-wise layers skip padding anyway
    (model.py), attention and its dropout cost T^2 per span, so on a CPU a 40-token positive never waits on a
    500-token anchor. A chunk holds two spans at least, past the budget if need be: under --compile a chunk of one
    would be a graph of its own (the compiler treats a size of 1 apart)."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        top = lengths[order[start]]
        if i == len(order) or i - start >= 2 and ((i - start + 1) * top > budget or lengths[order[i]] < spread * top):
            groups.append(order[start:i])
            start = i
    if len(groups) > 1 and len(groups[-1]) == 1:  # the shortest span left alone joins the chunk before it
        groups[-2:] = [np.concatenate(groups[-2:])]
    return groups
