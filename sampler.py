"""
sampler.py: DeCLUTR's data side. Documents in, batches of anchor and positive spans (plus MLM) out.

Paper §3.1-3.2: from each document of n tokens, sample A anchor spans with lengths
floor(p * (l_max - l_min) + l_min), p ~ Beta(4, 2) (long anchors, likely to represent the
document), then P positives per anchor with q ~ Beta(2, 4) (shorter), each starting anywhere it
overlaps, adjoins or lies inside its anchor (Fig. 2's views restrict this: --positive-view). §3.3:
the anchors also carry BERT-style MLM (15% of tokens; 80/10/10).

The documents are tokenised once with the model's own tokenizer (support/corpus.py keeps them as a
memmap of token ids, every run of whitespace made one space first, as in the original), so "length"
always means the model's tokens and sampling never tokenises. Every batch is a pure function of
(seed, epoch, rank, step).

    python sampler.py --model distilroberta-base --data docs/ notes.jsonl.gz --show 2   # as text
    python sampler.py --model runs/demo/model --data ~/.cache/declutr/demo-corpus   # after the demo
    python sampler.py --help                                                  # every flag, default
"""
from dataclasses import dataclass

import numpy as np
import torch

from model import load_config_and_tokenizer
from support.cli import UserError, cli, flag, parse_config
from support.corpus import Corpus, check_usable, prepare_corpus, show_batch
from support.device import pad_rows
from support.hub import special_ids


@dataclass
class SamplerConfig:  # the data side's settings; train.py's TrainConfig extends these
    model: str = flag("", "hub id, folder or scratch:SHAPE (train.py); empty: distilroberta-base")
    data: list = flag(list, ".txt/.jsonl (optionally .gz) and .parquet files, and folders of them")
    text_field: str = flag("text", "the .jsonl field or .parquet column that holds the text")
    docs_per_step: int = flag(16, "N, over all ranks together", low=1)
    num_anchors: int = flag(2, "A", low=1)
    num_positives: int = flag(2, "P", low=1)
    min_span: int = flag(32, "l_min, in model tokens, special tokens excluded", low=1)
    max_span: int = flag(512, "l_max; lowered to fit the model's positions with <s>, </s>", low=1)
    scale_short_docs: bool = flag(False, "documents under 2*A*l_max sampled with a smaller l_max")
    positive_view: str = flag("all", "where positives lie (paper Fig. 2)",
                              choices=("all", "overlap", "adjacent", "subsumed"))
    keep_whitespace: bool = flag(False, "tokenise the text as it is, runs of whitespace kept")
    mlm_probability: float = flag(0.15, "share of the anchors' tokens that MLM predicts",
                                  low=0, high=1, strict=True)
    seed: int = flag(0, "of the shuffle, spans, masks, weights and dropout", low=0, high=2**32 - 1)
    cache_dir: str = flag("", "tokenised corpus cache; default: $XDG_CACHE_HOME/declutr")

    def validate(self):
        if self.min_span > self.max_span:
            raise UserError(f"--min-span {self.min_span}: must be at most --max-span "
                            f"{self.max_span}", code=2)


# -----------------------------------------------------------------------------------------------
# Sampling: the method itself, as pure functions.


def span_length(rng: np.random.Generator, alpha: float, beta: float, min_span: int,
                max_span: int) -> int:
    """§3.2: floor(p * (l_max - l_min) + l_min), p ~ Beta(alpha, beta)."""
    return int(rng.beta(alpha, beta) * (max_span - min_span) + min_span)


def sample_spans(rng, n_tokens: int, num_anchors: int, num_positives: int, min_span: int,
                 max_span: int, view: str = "all"):
    """One ((anchor_start, anchor_end), [(positive_start, positive_end), ...]) per anchor; half-open
    token positions in the document."""
    if min_span > max_span:
        raise ValueError(f"min_span {min_span} is over max_span {max_span}: a span's length lies "
                         f"between them")
    if n_tokens < 2 * num_anchors * max_span:  # the original's rule, n >= 2·A·l_max
        raise ValueError(f"{n_tokens} tokens: {num_anchors} anchors of up to {max_span} tokens "
                         f"need at least {2 * num_anchors * max_span} (num_anchors * max_span * 2)")
    # Each anchor lies inside its own block of l_max tokens, and no two anchors' blocks are
    # neighbours. A positive reaches at most l_max tokens past its anchor, so it can never overlap
    # another anchor: the document's other anchors stay true (hard) negatives.
    # Choosing A non-neighbouring blocks out of `blocks` is choosing A distinct numbers out of
    # blocks - (A - 1) and adding 0, 1, ..., A-1 to them in sorted order (one gap after each pick).
    # The two are in one-to-one correspondence, so a uniform draw of the numbers is a uniform draw
    # over every valid placement.
    blocks = n_tokens // max_span
    numbers = rng.choice(blocks - (num_anchors - 1), size=num_anchors, replace=False)
    picks = np.sort(numbers) + np.arange(num_anchors)
    out = []
    for block in picks:
        # §3.2: the anchor's length is floor(p * (l_max - l_min) + l_min) with p ~ Beta(4, 2):
        # anchors skew long
        anchor_len = span_length(rng, 4, 2, min_span, max_span)
        # Its start: anywhere in its block that leaves room for the whole anchor
        anchor_start = int(block) * max_span + int(rng.integers(0, max_span - anchor_len + 1))
        positives = [positive_span(rng, anchor_start, anchor_len, n_tokens=n_tokens,
                                   min_span=min_span, max_span=max_span, view=view)
                     for _ in range(num_positives)]
        out.append(((anchor_start, anchor_start + anchor_len), positives))
    return out


def positive_span(rng, anchor_start: int, anchor_len: int, n_tokens: int, min_span: int,
                  max_span: int, view: str = "all") -> tuple[int, int]:
    """(start, end) of one positive of the anchor [anchor_start, anchor_start + anchor_len). §3.2:
    anywhere it adjoins its anchor, overlaps it or lies inside it; --positive-view restricts this to
    one of Fig. 2's views."""
    if view != "all":
        return POSITIVE_VIEWS[view](rng, anchor_start, anchor_len, n_tokens=n_tokens,
                                    min_span=min_span, max_span=max_span)
    # §3.2: its length is floor(q * (l_max - l_min) + l_min) with q ~ Beta(2, 4): positives skew
    # short
    positive_len = span_length(rng, 2, 4, min_span, max_span)
    # Its start: uniform over every start at which it adjoins the anchor (ending where the anchor
    # starts, or starting where it ends), overlaps it, or lies inside it, within the document
    lowest = max(0, anchor_start - positive_len)
    highest = min(anchor_start + anchor_len, n_tokens - positive_len)
    positive_start = int(rng.integers(lowest, highest + 1))
    return positive_start, positive_start + positive_len


# Fig. 2's views, the paper's ablation of where a positive lies (--positive-view): subsumed and
# adjacent as the original's code has them, overlapping with no counterpart there
# (docs/differences.md)

def subsumed(rng, anchor_start, anchor_len, n_tokens, min_span, max_span):
    """Inside its anchor, and no longer than it."""
    positive_len = span_length(rng, 2, 4, min(min_span, anchor_len), anchor_len)
    last = anchor_start + anchor_len - positive_len
    positive_start = int(rng.integers(anchor_start, last + 1))
    return positive_start, positive_start + positive_len


def adjacent(rng, anchor_start, anchor_len, n_tokens, min_span, max_span):
    """Ending where the anchor starts or starting where it ends, no longer than the room on the
    longer side."""
    room = max(anchor_start, n_tokens - anchor_start - anchor_len)
    positive_len = span_length(rng, 2, 4, min_span, max(min_span, min(max_span, room)))
    sides = [anchor_start - positive_len, anchor_start + anchor_len]  # before it, after it
    sides = [s for s in sides if 0 <= s <= n_tokens - positive_len]
    positive_start = int(sides[rng.integers(len(sides))])
    return positive_start, positive_start + positive_len


def overlapping(rng, anchor_start, anchor_len, n_tokens, min_span, max_span):
    """Sharing text with its anchor without lying inside it: a start in one range before the
    anchor's, or one after."""
    # At least 2 tokens: a positive of 1 lies inside its anchor, or shares nothing with it
    positive_len = span_length(rng, 2, 4, max(2, min_span), max(2, max_span))
    anchor_end = anchor_start + anchor_len
    last = n_tokens - positive_len  # the last start in the document
    before = range(max(0, anchor_start - positive_len + 1), min(anchor_start, last + 1))
    after = range(max(anchor_start, anchor_end - positive_len + 1), min(anchor_end, last + 1))
    k = int(rng.integers(len(before) + len(after)))
    positive_start = before[k] if k < len(before) else after[k - len(before)]
    return positive_start, positive_start + positive_len


POSITIVE_VIEWS = {"overlap": overlapping, "adjacent": adjacent, "subsumed": subsumed}


def mask_tokens(ids, eligible, rng, mask_id, random_ids, probability=0.15):
    """BERT's MLM corruption: choose `probability` of the eligible tokens; of those 80% <mask>, 10%
    random, 10% kept."""
    # One uniform draw a token, so that the count varies, as in transformers'
    # DataCollatorForLanguageModeling (BERT's own data script masks a fixed count)
    chosen = eligible & (rng.random(ids.shape) < probability)
    labels = np.where(chosen, ids, -100)
    # A second splits the chosen 80/10/10; a random token is any but the special ones (the original
    # draws from the whole vocabulary, <pad> and <mask> included: docs/differences.md)
    r = rng.random(ids.shape)
    inputs = np.where(chosen & (r < 0.8), mask_id, ids)
    swap = chosen & (r >= 0.8) & (r < 0.9)
    inputs[swap] = random_ids[rng.integers(0, len(random_ids), size=int(swap.sum()))]
    return inputs, labels


# -----------------------------------------------------------------------------------------------
# Batches: step -> anchors, positives, MLM, as a map-style dataset the DataLoader's workers index
# by step.


class SpanBatches(torch.utils.data.Dataset):
    """Step -> this rank's batch: its share of the step's N documents, A anchors and A·P positives
    from each."""

    def __init__(self, corpus: Corpus, tok, cfg: SamplerConfig, max_tokens: int, rank=0,
                 world_size=1, held_out=()):
        self.corpus, self.cfg, self.rank, self.world = corpus, cfg, rank, world_size
        self.per_rank = cfg.docs_per_step // world_size  # this rank's share of a step's N documents
        self.special = special_ids(tok)
        every_id = np.arange(tok.get_vocab_size())
        self.random_ids = np.setdiff1d(every_id, list(self.special.values()))
        # l_max counts the span inside <s> ... </s>: lowered, if need be, to fit the model's
        # positions with them
        self.max_span = min(cfg.max_span, max_tokens - 2)
        if cfg.min_span > self.max_span:  # every span l_max long: §3.2's lengths would be lost
            raise UserError(f"--min-span {cfg.min_span}: the model's {max_tokens:,} positions hold "
                            f"spans of at most {self.max_span:,} tokens with <s> and </s>, so "
                            f"every span would be that long; pass --min-span below "
                            f"{self.max_span:,}", code=2)
        # The original's rule: a document of n tokens gives A anchors in non-neighbouring blocks of
        # l_max when n >= 2·A·l_max; --scale-short-docs takes shorter ones too, their l_max
        # lowered to n / 2A (max_span_of)
        shortest = 2 * cfg.num_anchors * (cfg.min_span if cfg.scale_short_docs else self.max_span)
        # Documents kept for held-out span retrieval (evaluate_sts.py) are never trained on
        self.n_held_out = len(held_out)
        self.docs = np.setdiff1d(np.flatnonzero(corpus.lengths >= shortest), held_out)
        self.steps_per_epoch = len(self.docs) // world_size // max(1, self.per_rank)
        # One line if it cannot sample, or what it will
        check_usable(self, shortest, max_tokens, SamplerConfig.max_span)
        self._shard = (None, None)

    def max_span_of(self, n: int) -> int:
        """l_max for a document of n tokens: the run's, or n / 2A for a short one under
        --scale-short-docs."""
        return min(self.max_span, n // (2 * self.cfg.num_anchors))

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's documents for the epoch: one shuffle shared by all ranks, dealt out
        round-robin."""
        if self._shard[0] != epoch:
            perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.docs))
            self._shard = (epoch, self.docs[perm[self.rank::self.world]])
        return self._shard[1]

    def __getitem__(self, step: int) -> dict:
        cfg, special, tokens = self.cfg, self.special, self.corpus.tokens
        epoch, i = divmod(int(step), self.steps_per_epoch)
        # Resumable: no state is carried from one step to the next
        rng = np.random.default_rng([cfg.seed, epoch, self.rank, i])
        anchors, positives, a_doc = [], [], []
        for d in self.shard(epoch)[i * self.per_rank:(i + 1) * self.per_rank]:
            start, n = int(self.corpus.offsets[d]), int(self.corpus.lengths[d])
            max_span = self.max_span_of(n)
            spans = sample_spans(rng, n, num_anchors=cfg.num_anchors,
                                 num_positives=cfg.num_positives,
                                 min_span=min(cfg.min_span, max_span), max_span=max_span,
                                 view=cfg.positive_view)
            for (a0, a1), pos in spans:
                anchors.append(tokens[start + a0:start + a1])
                positives += [tokens[start + p0:start + p1] for p0, p1 in pos]
                a_doc.append(d)  # for `python sampler.py`, which names each anchor's document
        # <s> span </s>, padded to the longest of the batch (the model computes only the real
        # tokens)
        cls, sep, pad = special["cls"], special["sep"], special["pad"]
        a_ids, a_mask = pad_rows([[cls, *s, sep] for s in anchors], pad)  # (A·n, T), n documents
        p_ids, p_mask = pad_rows([[cls, *s, sep] for s in positives], pad)  # (A·P·n, T')
        # §3.3: MLM on the anchors' own tokens, never on <s>, </s> or padding
        eligible = ~np.isin(a_ids, list(special.values()))
        mlm_inputs, mlm_labels = mask_tokens(a_ids, eligible, rng, mask_id=special["mask"],
                                             random_ids=self.random_ids,
                                             probability=cfg.mlm_probability)
        t = torch.from_numpy
        return dict(anchors=t(a_ids), anchor_lengths=t(a_mask.sum(1)), positives=t(p_ids),
                    positive_lengths=t(p_mask.sum(1)), mlm_inputs=t(mlm_inputs),
                    mlm_labels=t(mlm_labels), anchor_doc=t(np.asarray(a_doc, dtype=np.int64)))


@dataclass
class SamplerCommand(SamplerConfig):  # python sampler.py: the settings above, and what to show
    show: int = flag(1, "print the spans of this many documents of step 0", low=0)


@cli
def main(argv=None):
    cfg = parse_config(SamplerCommand, argv, __doc__.split("\n\n")[0])
    if not cfg.data:
        raise UserError("no --data given: pass .txt/.jsonl files or directories")
    config, tok = load_config_and_tokenizer(cfg.model or "distilroberta-base")
    corpus = prepare_corpus(cfg.data, tok, cfg.cache_dir, clean=not cfg.keep_whitespace,
                            field=cfg.text_field)
    batches = SpanBatches(corpus, tok, cfg, config.max_tokens)
    show_batch(batches[0], tok, cfg.num_anchors, cfg.num_positives, documents=cfg.show)  # as text


if __name__ == "__main__":
    main()
