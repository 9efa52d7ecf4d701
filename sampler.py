"""
sampler.py: DeCLUTR's data side. Documents in, batches of anchor and positive spans (plus MLM) out.

Paper §3.1-3.2: from each document of n tokens, sample A anchor spans with lengths
floor(p * (l_max - l_min) + l_min), p ~ Beta(4, 2) (long anchors, likely to represent the document),
then P positives per anchor with q ~ Beta(2, 4) (shorter), each starting anywhere it overlaps, adjoins or
lies inside its anchor (Fig. 2's views restrict this: --positive-view). §3.3: the anchors also carry BERT-style
MLM (15% of tokens; 80/10/10).

As in the original, every run of whitespace in a document becomes one space before it is tokenised
(--keep-whitespace keeps the text as it is). The corpus is tokenised once with the model's own tokenizer into one
flat token file plus document offsets (a numpy memmap, cached by the files' names, sizes and times, the cleaning
and the tokenizer), so "length" always means the model's tokens and sampling never tokenises. Every batch is a
pure function of (seed, epoch, rank, step).

    python sampler.py --model distilroberta-base --data docs/ notes.jsonl.gz --show 2   # step 0's spans, as text
    python sampler.py --model runs/demo/model --data ~/.cache/declutr/demo-corpus     # after `python train.py`
    python sampler.py --help                                                          # every flag and default
"""
import array
import hashlib
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from common import (
    Progress,
    UserError,
    bounded,
    choice,
    cli,
    list_files,
    pad_rows,
    parse_config,
    read_documents,
    remove_stale_temporaries,
    say,
    writable_cache,
    write_atomic,
)
from hub import special_ids
from model import load_config_and_tokenizer

VIEWS = ("all", "overlap", "adjacent", "subsumed")  # where a positive may lie relative to its anchor (Fig. 2)


@dataclass
class SamplerConfig:  # the data side's settings; train.py's TrainConfig extends these
    model: str = ""  # hub id, local folder or (train.py) scratch:SHAPE; empty: distilroberta-base (or the demo)
    data: list = field(default_factory=list)  # .txt / .jsonl files (optionally .gz) and directories of them
    docs_per_step: int = bounded(16, 1)  # N, over all ranks together
    num_anchors: int = bounded(2, 1)  # A
    num_positives: int = bounded(2, 1)  # P
    min_span: int = bounded(32, 1)  # l_min, in model tokens, special tokens excluded
    max_span: int = bounded(512, 1)  # l_max; lowered to fit the model's positions once <s> and </s> are added
    scale_short_docs: bool = False  # sample documents shorter than 2*A*l_max with a smaller l_max, not skip them
    positive_view: str = choice(*VIEWS)  # where positives lie: all, overlap, adjacent or subsumed (paper Fig. 2)
    keep_whitespace: bool = False  # tokenise the text as it is, not with every run of whitespace made one space
    mlm_probability: float = bounded(0.15, 0, 1, strict=True)  # share of the anchors' tokens that MLM predicts
    seed: int = bounded(0, 0, 2**32 - 1)  # of the shuffle, the spans, the masks and (train.py) the weights and dropout
    cache_dir: str = ""  # tokenised corpus cache; default: $XDG_CACHE_HOME/declutr or ~/.cache/declutr
    workers: int = bounded(2, 0)  # DataLoader worker processes per rank

    def validate(self):
        if self.min_span > self.max_span:
            raise UserError(f"--min-span {self.min_span}: must be at most --max-span {self.max_span}", code=2)


# -----------------------------------------------------------------------------------------------
# Sampling: the method itself, as pure functions.


def span_length(rng: np.random.Generator, a: float, b: float, min_len: int, max_len: int) -> int:
    return int(rng.beta(a, b) * (max_len - min_len) + min_len)


def sample_spans(n_tokens, num_anchors, num_positives, min_len, max_len, rng, view="all"):
    """One ((a_start, a_end), [(p_start, p_end), ...]) per anchor; half-open token positions in the document."""
    if n_tokens < 2 * num_anchors * max_len or min_len > max_len:  # the original's rule, n >= 2·A·l_max
        raise ValueError(f"{n_tokens} tokens: {num_anchors} anchors of up to {max_len} tokens need at least "
                         f"{2 * num_anchors * max_len} (num_anchors * max_span * 2)")
    # Each anchor lies inside its own block of l_max tokens, and no two anchors' blocks are neighbours. A positive
    # reaches at most l_max tokens past its anchor, so it can never overlap another anchor: the document's other
    # anchors stay true (hard) negatives.
    # Choosing A non-neighbouring blocks out of `blocks` is choosing A distinct numbers out of blocks - (A - 1) and
    # adding 0, 1, ..., A-1 to them in sorted order (one gap after each pick). The two are in one-to-one
    # correspondence, so a uniform draw of the numbers is a uniform draw over every valid placement.
    blocks = n_tokens // max_len
    picks = np.sort(rng.choice(blocks - (num_anchors - 1), size=num_anchors, replace=False)) + np.arange(num_anchors)
    out = []
    for b in picks:
        # §3.2: the anchor's length is floor(p * (l_max - l_min) + l_min) with p ~ Beta(4, 2): anchors skew long
        la = span_length(rng, 4, 2, min_len, max_len)
        # Its start: anywhere in its block that leaves room for the whole anchor
        sa = int(b) * max_len + int(rng.integers(0, max_len - la + 1))
        # §3.2: P positives near the anchor, shorter (q ~ Beta(2, 4)); `view` (Fig. 2) says where they may lie
        positives = [positive_span(rng, view, sa, la, n_tokens, min_len, max_len) for _ in range(num_positives)]
        out.append(((sa, sa + la), positives))
    return out


def positive_span(rng, view: str, sa: int, la: int, n: int, min_len: int, max_len: int) -> tuple[int, int]:
    """(start, end) of one positive for the anchor [sa, sa + la) of a document of n tokens. The paper's views (Fig. 2):
    all (the default): anywhere it adjoins the anchor, overlaps it or lies inside it; adjacent: ending where the
    anchor starts or starting where it ends; subsumed: inside it; overlap: sharing text with it without lying
    inside it."""
    if view == "subsumed":  # no longer than its anchor, as in the original
        lp = span_length(rng, 2, 4, min(min_len, la), la)
        sp = int(rng.integers(sa, sa + la - lp + 1))
    elif view == "adjacent":  # no longer than the room on one side of the anchor, as in the original
        lp = span_length(rng, 2, 4, min_len, max(min_len, min(max_len, max(sa, n - sa - la))))
        sides = [s for s in (sa - lp, sa + la) if 0 <= s <= n - lp]
        sp = int(sides[rng.integers(len(sides))])
    elif view == "overlap":
        lp = span_length(rng, 2, 4, max(2, min_len), max(2, max_len))  # 1 token would lie inside or share nothing
        # starts that share text with the anchor, less those inside it: one range before, one after
        before = range(max(0, sa - lp + 1), min(sa, n - lp + 1))
        after = range(max(sa, sa + la - lp + 1), min(sa + la, n - lp + 1))
        k = int(rng.integers(len(before) + len(after)))
        sp = before[k] if k < len(before) else after[k - len(before)]
    else:
        lp = span_length(rng, 2, 4, min_len, max_len)
        # uniform over every start at which it adjoins the anchor (ending where the anchor starts, or starting
        # where it ends), overlaps it, or lies inside it, within the document
        sp = int(rng.integers(max(0, sa - lp), min(sa + la, n - lp) + 1))
    return sp, sp + lp


def mask_tokens(ids, eligible, rng, mask_id, random_ids, p=0.15):
    """BERT's MLM corruption: choose p of the eligible tokens; of those 80% <mask>, 10% random, 10% kept."""
    chosen = eligible & (rng.random(ids.shape) < p)
    labels = np.where(chosen, ids, -100)
    r = rng.random(ids.shape)
    inputs = np.where(chosen & (r < 0.8), mask_id, ids)
    swap = chosen & (r >= 0.8) & (r < 0.9)
    inputs[swap] = random_ids[rng.integers(0, len(random_ids), size=int(swap.sum()))]
    return inputs, labels


# -----------------------------------------------------------------------------------------------
# The corpus: read every document once, tokenise, keep the ids on disk.


class Corpus:
    """Token ids of every document, flat on disk: document i is tokens[offsets[i]:offsets[i + 1]]."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.meta = json.loads((directory / "meta.json").read_text())
        self.offsets = np.load(directory / "offsets.npy")
        self.lengths = np.diff(self.offsets)
        self._tokens = None

    @property
    def tokens(self):  # opened lazily, so each DataLoader worker maps the file itself
        if self._tokens is None:
            self._tokens = np.memmap(self.dir / "tokens.bin", dtype=self.meta["dtype"], mode="r") \
                if self.meta["tokens"] else np.zeros(0, dtype=self.meta["dtype"])
        return self._tokens

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __len__(self):
        return len(self.lengths)


def prepare_corpus(paths, tok, cache: str = "", clean: bool = True) -> Corpus:
    """Tokenise the documents under `paths` once (batched over every core, whitespace cleaned unless clean=False)
    into a cached memmap."""
    files = list_files(paths)
    # The cache key: the tokenizer, the cleaning, and each file's path, size and time
    key = hashlib.sha256(tok.to_str().encode() + (b"clean" if clean else b"raw"))
    for f in files:
        st = f.stat()
        key.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    root = writable_cache(cache)
    remove_stale_temporaries(root)  # what a preparation that was killed left
    out = root / f"corpus-{key.hexdigest()[:20]}"
    if (out / "meta.json").exists():
        corpus = Corpus(out)
        say(f"corpus: reusing {out}: {corpus.meta['summary']}", file=sys.stderr)
        return corpus
    progress = Progress("corpus", f"tokenising {len(files):,} files once, into {out}")
    # The cache folder appears whole or not at all; if another process (another machine's) finished it first, its
    # folder is kept
    write_atomic(out, lambda tmp: _tokenise(files, tok, tmp, progress, clean), keep_existing=True)
    corpus = Corpus(out)
    progress.note(f"{corpus.meta['summary']} ({time.time() - progress.t0:.1f}s)")
    return corpus


def _tokenise(files, tok, folder: Path, progress: Progress, clean: bool):
    """tokens.bin (every document's ids, one after another), offsets.npy and meta.json, written into `folder`."""
    folder.mkdir()
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    stats = dict(files=len(files), documents=0, empty=0, binary=0, malformed=0, files_repaired=0, bytes_replaced=0)
    offsets = array.array("q", [0])  # 8 bytes a document
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no character offsets: we only need ids
    with open(folder / "tokens.bin", "wb") as f:
        for texts in _batches(read_documents(files, stats, clean), 1 << 24):
            for e in encode(texts, add_special_tokens=False):
                ids = np.asarray(e.ids, dtype=dtype)
                f.write(ids.tobytes())
                offsets.append(offsets[-1] + len(ids))
            progress(f"{len(offsets) - 1:,} documents, {offsets[-1]:,} tokens, "
                     f"{offsets[-1] / (time.time() - progress.t0):,.0f} tokens/s")
    stats["documents"], stats["tokens"] = len(offsets) - 1, offsets[-1]
    np.save(folder / "offsets.npy", np.frombuffer(offsets, dtype=np.int64))
    summary = (f"{stats['files']:,} files, {stats['documents']:,} documents, {stats['tokens']:,} tokens; skipped "
               f"{stats['empty']} empty, {stats['binary']} binary, {stats['malformed']} malformed; "
               f"{stats['bytes_replaced']} undecodable bytes replaced in {stats['files_repaired']} files")
    meta = dict(stats, dtype=np.dtype(dtype).name, summary=summary, sources=[str(f) for f in files])
    (folder / "meta.json").write_text(json.dumps(meta))


def _batches(texts, max_chars: int):
    """Lists of texts of about `max_chars` characters (16M): memory stays bounded, every core stays busy."""
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# -----------------------------------------------------------------------------------------------
# Batches: step -> anchors, positives, MLM, as a map-style dataset the DataLoader's workers index by step.


class SpanBatches(torch.utils.data.Dataset):
    def __init__(self, corpus: Corpus, tok, cfg: SamplerConfig, max_tokens: int, rank=0, world_size=1):
        self.corpus, self.cfg, self.rank, self.world = corpus, cfg, rank, world_size
        self.per_rank = cfg.docs_per_step // world_size  # this rank's share of the N documents of a step
        self.special = special_ids(tok)
        self.random_ids = np.setdiff1d(np.arange(tok.get_vocab_size()), list(self.special.values()))
        self.max_span = min(cfg.max_span, max_tokens - 2)  # room for <s> and </s> within the positions
        # The paper's l_max of 512 already means the span inside <s> ... </s>: only a --max-span the user chose is
        # worth a warning when it has to be lowered
        if self.max_span < cfg.max_span != SamplerConfig.max_span:
            say(f"sampler: max_span {cfg.max_span} + 2 special tokens exceeds the model's {max_tokens} positions; "
                f"using {self.max_span}", file=sys.stderr)
        A, lengths = cfg.num_anchors, corpus.lengths
        if len(lengths) == 0:  # every file empty, binary or malformed: nothing to sample from, whatever the spans
            raise UserError(f"no documents in the data: {corpus.meta['summary']}")
        self.need = 2 * A * self.max_span  # the original's requirement, n >= 2 * A * l_max
        floor = 2 * A * cfg.min_span if cfg.scale_short_docs else self.need
        self.docs = np.flatnonzero(lengths >= floor)
        if len(self.docs) == 0:
            raise UserError(f"no document has the {floor:,} tokens that {A} anchors need (2·A·l_max); the longest "
                            f"has {int(lengths.max(initial=0)):,}. Lower --max-span or pass --scale-short-docs")
        self.steps_per_epoch = len(self.docs) // world_size // max(1, self.per_rank)
        if self.per_rank == 0 or self.steps_per_epoch == 0:
            raise UserError(f"{len(self.docs)} usable documents cannot fill one step of {cfg.docs_per_step} "
                            f"documents over {world_size} ranks")
        short = int((lengths < floor).sum())
        say(f"sampler: {len(self.docs):,} documents qualify, {short:,} skipped as shorter than {floor:,} tokens; "
            f"{self.steps_per_epoch:,} steps per epoch", file=sys.stderr)
        self._shard = (None, None)

    def shard(self, epoch: int) -> np.ndarray:
        """This rank's documents for the epoch: one shuffle shared by all ranks, dealt out round-robin."""
        if self._shard[0] != epoch:
            perm = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.docs))
            self._shard = (epoch, self.docs[perm[self.rank::self.world]])
        return self._shard[1]

    def __getitem__(self, step: int) -> dict:
        cfg, special = self.cfg, self.special
        epoch, i = divmod(int(step), self.steps_per_epoch)
        rng = np.random.default_rng([cfg.seed, epoch, self.rank, i])  # resumable: no state carried between steps
        anchors, positives, a_doc = [], [], []
        for d in self.shard(epoch)[i * self.per_rank:(i + 1) * self.per_rank]:
            start, n = int(self.corpus.offsets[d]), int(self.corpus.lengths[d])
            max_len = min(self.max_span, n // (2 * cfg.num_anchors))  # only short docs, when allowed, scale down
            toks = self.corpus.tokens
            for (a0, a1), pos in sample_spans(n, cfg.num_anchors, cfg.num_positives, min(cfg.min_span, max_len),
                                              max_len, rng, cfg.positive_view):
                anchors.append(toks[start + a0:start + a1])
                positives += [toks[start + p0:start + p1] for p0, p1 in pos]
                a_doc.append(d)  # for `python sampler.py`, which names each anchor's document
        # <s> span </s>, padded to the longest of the batch (the model computes only the real tokens)
        a_ids, a_mask = pad_rows([[special["cls"], *s, special["sep"]] for s in anchors], special["pad"])
        p_ids, p_mask = pad_rows([[special["cls"], *s, special["sep"]] for s in positives], special["pad"])
        # §3.3: MLM on the anchors' own tokens, never on <s>, </s> or padding
        eligible = ~np.isin(a_ids, list(special.values()))
        mlm_inputs, mlm_labels = mask_tokens(a_ids, eligible, rng, special["mask"], self.random_ids,
                                             cfg.mlm_probability)
        t = torch.from_numpy
        return dict(anchors=t(a_ids), anchor_lengths=t(a_mask.sum(1)), positives=t(p_ids),
                    positive_lengths=t(p_mask.sum(1)), mlm_inputs=t(mlm_inputs), mlm_labels=t(mlm_labels),
                    anchor_doc=t(np.asarray(a_doc, dtype=np.int64)))


def make_loader(batches: SpanBatches, start_step: int, stop_step: int, workers: int):
    """Batches for global steps [start_step, stop_step): resuming at step k needs nothing of steps before k."""
    return torch.utils.data.DataLoader(batches, batch_size=None, sampler=range(start_step, stop_step),
                                       num_workers=workers, persistent_workers=False,
                                       pin_memory=torch.cuda.is_available(), prefetch_factor=4 if workers else None,
                                       worker_init_fn=_ignore_sigterm if workers else None)


def _ignore_sigterm(worker_id: int):
    """A scheduler's SIGTERM reaches every process of the job: the workers leave it to the training process, which
    finishes its step, checkpoints and stops them (one that died of it would end the run with a traceback)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@dataclass
class SamplerCommand(SamplerConfig):  # python sampler.py: the settings above, and what to show
    show: int = bounded(1, 0)  # print the spans of this many documents of step 0


@cli
def main(argv=None):
    cfg = parse_config(SamplerCommand, argv, __doc__.split("\n\n")[0])
    if not cfg.data:
        raise UserError("no --data given: pass .txt/.jsonl files or directories")
    config, tok = load_config_and_tokenizer(cfg.model or "distilroberta-base")
    corpus = prepare_corpus(cfg.data, tok, cfg.cache_dir, clean=not cfg.keep_whitespace)
    batches = SpanBatches(corpus, tok, cfg, config.max_tokens)
    b, A, P = batches[0], cfg.num_anchors, cfg.num_positives
    print(f"step 0: {len(b['anchors'])} anchors of {b['anchor_lengths'].min()}-{b['anchor_lengths'].max()} tokens, "
          f"{len(b['positives'])} positives of {b['positive_lengths'].min()}-{b['positive_lengths'].max()}, "
          f"{int((b['mlm_labels'] != -100).sum())} MLM targets")

    def clip(ids, n):  # a span's text without <s> and </s>, on one line
        return tok.decode(ids[1:n - 1].tolist())[:160].replace("\n", " ")

    for k in range(min(cfg.show, len(b["anchors"]) // A) * A):
        print(f"\ndocument {int(b['anchor_doc'][k])}, anchor {k % A}: {clip(b['anchors'][k], b['anchor_lengths'][k])}")
        for j in range(k * P, (k + 1) * P):
            print(f"  positive: {clip(b['positives'][j], b['positive_lengths'][j])}")


if __name__ == "__main__":
    main()
