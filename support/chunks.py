"""
support/chunks.py: a training step's spans cut into chunks of similar length, each chunk's inputs worked out on the
host. Which spans, in which order, with which ids, and in what precision they run, is train_step's to say; this only
cuts. Token-wise layers skip
padding anyway (model.py), but attention costs T^2 per span, so on a CPU a 40-token positive never waits on a 500-token
anchor; on a GPU one chunk per token budget, where launches cost more than padding.
"""
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from support.device import padding_mask, to_device


class Chunk(NamedTuple):
    """One chunk of a step's spans, on the device: what the encoder and the MLM head take (train.chunk_forward)."""
    ids: torch.Tensor  # (g, T) token ids, padded on the right
    mask: torch.Tensor  # (g, T) 0/1 attention mask
    positions: torch.Tensor  # (n,) the real tokens' flat places in (g*T): model.Packing's, worked out here
    masked_at: torch.Tensor | None  # (K,) the masked tokens' flat places in (g*T); None: no MLM
    masked_ids: torch.Tensor | None  # (K,) what those tokens were (-100: ignored)


class Chunks:
    """Spans given in groups ([(ids (n, t), lengths (n,)), ...], one list in that order), cut into chunks of similar
    length within a token budget: `inputs[k]` is chunk k's inputs on the device, `rows[k]` the spans it holds;
    `sort` takes the spans' order to the chunks', `unsort` back. `mlm_labels` (m, t): what the first m spans'
    masked tokens were (-100 elsewhere), or None. Each chunk's inputs are worked out on the host from the lengths and
    copied to the device from page-locked memory without waiting (to_device): nothing here makes the host wait for
    the GPU. A copy each, a few dozen a step, costs microseconds beside a step's hundreds of milliseconds on a GPU."""

    def __init__(self, groups, mlm_labels, budget: int, device, pad_id: int, multiple: int | None = None):
        self.device = device
        # On a GPU a chunk's width is a multiple of 8: inductor guards on the attention mask's width modulo 8 there
        # (torch/_inductor/lowering.py, sdpa_constraint), so mixed widths would compile a second graph per mode
        self.multiple = multiple or (8 if device.type == "cuda" else 1)
        self.lengths = torch.cat([lengths for _, lengths in groups]).numpy()  # (S,)
        # Spans of similar length run together, within a token budget. On a GPU, one chunk per budget: a chunk more
        # costs more in launches than the padding inside one, which the token-wise layers skip anyway.
        self.rows = length_groups(self.lengths, budget, spread=0.8 if device.type == "cpu" else 0.0)
        T = self.width(max(ids.shape[1] for ids, _ in groups))
        ids = torch.cat([F.pad(ids, (0, T - ids.shape[1]), value=pad_id) for ids, _ in groups]).numpy()  # (S, T)
        labels = None if mlm_labels is None else mlm_labels.numpy()
        self.inputs = [self._chunk(rows, ids, labels) for rows in self.rows]
        sort = np.concatenate(self.rows)
        self.sort, self.unsort = to_device(sort, device), to_device(np.argsort(sort), device)
        self.n_masked = 0 if labels is None else int((labels != -100).sum())

    def _chunk(self, rows, ids, labels) -> Chunk:
        T = self.width(int(self.lengths[rows].max()))
        mask = padding_mask(self.lengths[rows], T).astype(np.int64)  # (g, T)
        at = targets = None
        if labels is not None:
            # Where the labelled spans' masked tokens are in the chunk's (g, T) layout, and what they were
            labelled = np.flatnonzero(rows < len(labels))  # the chunk's rows that carry labels
            chunk_labels = labels[rows[labelled], :T]
            i, j = np.nonzero(chunk_labels != -100)
            at, targets = labelled[i] * T + j, chunk_labels[i, j]
            # Every chunk gets the same kinds of input, so that --compile builds one graph for them all: the real
            # tokens' positions even where there is no padding, and at least two MLM targets, the added ones ignored
            # (-100): a chunk with none or one would be a graph of its own, as the compiler treats sizes 0 and 1 apart.
            pad = max(0, 2 - len(at))
            at, targets = np.r_[at, [0] * pad].astype(np.int64), np.r_[targets, [-100] * pad].astype(np.int64)
            at, targets = to_device(at, self.device), to_device(targets, self.device)
        ids, mask, positions = (to_device(x, self.device) for x in (ids[rows, :T], mask, np.flatnonzero(mask)))
        return Chunk(ids, mask, positions, at, targets)

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
