"""
support/embedding.py: what embed.py does around the embedding itself. Its inputs checked, then read in blocks (standard
input and pipes copied once, as both passes read them), each batch laid out on the device, and the progress of the
texts finished. Where the blocks' rows go is support/embed_job.py's.
"""
import contextlib
import itertools
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from support import quantize
from support.cli import UserError, say
from support.corpus import SUFFIXES, column_bytes, parquet_file, read_lines
from support.device import pad_rows, to_device
from support.files import path_kind

# -----------------------------------------------------------------------------------------------
# A batch on the device


# -----------------------------------------------------------------------------------------------
# Texts into token ids, in bounded memory


# The characters tokenised together at most: the tokenizer's encodings of a whole block of long texts (books: 16,384
# of them) held tens of bytes a token, gigabytes at once
GROUP_CHARS = 1 << 22
# How far into a long text to look for the tokens the model reads (--long truncate): this many characters a token,
# some four times what English text takes
PREFIX_CHARS = 16


def token_ids(texts: list, tok, keep: int | None = None):
    """Each text's token ids, special tokens included, as an int32 array, tokenised a group of GROUP_CHARS at a time on
    every core. keep: only the first `keep` ids are read (--long truncate), and a long text is tokenised from a prefix
    cut at a space: every tokenizer this project loads splits a text into words at spaces before it tokenises them
    one by one, so the prefix's ids are the whole text's first ones. Where the prefix holds `keep` ids or fewer (very
    long words), the whole text is tokenised."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no character offsets
    for group in groups_of(texts, GROUP_CHARS):
        cut = [prefix(t, PREFIX_CHARS * keep) for t in group] if keep else group
        for text, short, e in zip(group, cut, encode(cut), strict=True):
            ids = e.ids if short is text or len(e.ids) > keep else encode([text])[0].ids
            yield np.asarray(ids, dtype=np.int32)


def prefix(text: str, chars: int) -> str:
    """The text up to the last whitespace within its first `chars` characters; the text itself where it is no longer
    or has no whitespace there."""
    if len(text) <= chars:
        return text
    cut = max(text.rfind(c, 0, chars) for c in " \n\t\r\f\v")
    return text[:cut] if cut > 0 else text


def groups_of(texts: list, chars: int):
    """Consecutive texts, as many as hold at most `chars` characters (at least one)."""
    group, size = [], 0
    for t in texts:
        if group and size + len(t) > chars:
            yield group
            group, size = [], 0
        group.append(t)
        size += len(t)
    if group:
        yield group


# Taking a batch's padding out before the token-wise layers and putting it back for attention is two copies of every
# token's states a layer: it pays only where padding is more than this share of the batch (texts sorted by length
# leave almost none: all-MiniLM-L6-v2 on STS-B in bf16, 0.35% of the tokens; docs/measurements.md)
PACK_ABOVE = 1 / 8


def padded_batch(pieces, pad_id: int, T: int, device: torch.device):
    """(ids, mask, positions, attend) on the device: the pieces padded to T; the real tokens' flat positions, which
    the token-wise layers run on (model.Packing's), None where the batch runs as it is (padding at most PACK_ABOVE of
    it); the mask attention needs, None where there is no padding."""
    ids, mask = pad_rows(pieces, pad_id, width=T)
    lengths = mask.sum(1)
    positions = None
    if ids.size - lengths.sum() > PACK_ABOVE * ids.size:
        positions = to_device(np.flatnonzero(mask), device)
    mask = to_device(mask, device)
    return to_device(ids, device), mask, positions, mask if lengths.min() < T else None


@contextlib.contextmanager
def eval_mode(model):
    """Dropout off while embedding, as sentence-transformers' encode (a model in training mode would embed
    differently each call), and the model's mode put back afterwards."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


class FinishedTexts:
    """Tells progress(texts, windows), after each batch, how many texts it finished (a text is finished once all its
    windows are) and how many windows ran."""

    def __init__(self, owner: np.ndarray, n_texts: int, progress):
        self.owner, self.progress = owner, progress
        self.left = np.bincount(owner, minlength=n_texts)  # windows left per text

    def __call__(self, rows: np.ndarray):
        if self.progress:
            texts = self.owner[rows]
            np.subtract.at(self.left, texts, 1)
            self.progress(int((self.left[np.unique(texts)] == 0).sum()), len(rows))


# -----------------------------------------------------------------------------------------------
# Files in, rows out, in blocks


def check_flags(cfg):
    """embed.py's flags together: the --format that --output's extension says, npy (float32, texts x hidden) or jsonl
    (an {"embedding": [...]} per line), and what each of the others needs."""
    suffix = Path(cfg.output).suffix
    if Path(cfg.output).is_dir():
        raise UserError(f"--output {cfg.output}: is a folder; name the file to write")  # a path: exit 1
    if cfg.format and suffix in (".npy", ".jsonl") and suffix != "." + cfg.format:
        raise UserError(f"--format {cfg.format}: --output {cfg.output} says {suffix[1:]}; name the file "
                        f".{cfg.format} or leave --format out", code=2)
    if not cfg.format and suffix not in (".npy", ".jsonl"):
        raise UserError(f"--output {cfg.output}: cannot tell the format from its name; pass --format npy or "
                        f"--format jsonl", code=2)
    cfg.format = cfg.format or suffix[1:]
    if cfg.output_dtype != "float32" and cfg.format != "npy":
        raise UserError(f"--output-dtype {cfg.output_dtype}: for .npy only (a .jsonl row is text)", code=2)
    if cfg.ranges and cfg.output_dtype != "int8":
        raise UserError("--ranges: for --output-dtype int8 only", code=2)
    if cfg.resume and cfg.overwrite:
        raise UserError("--resume and --overwrite: continue the job, or start it afresh, not both", code=2)


def check_paths(cfg, out: Path, world: int = 1):
    """Every input readable, and an output that overwrites nothing the user has (unless --overwrite, or --resume,
    which names it only if complete). Standard input and pipes can be read once, by one process."""
    for p in cfg.inputs:
        if p == "-" and sys.stdin is None:  # started with standard input closed (`<&-`)
            raise UserError("-: standard input is closed; pipe the texts in, or name a file")
        kind = "file" if p == "-" else path_kind(Path(p))
        if kind == "missing":
            raise UserError(f"{p}: no such file")
        if kind not in ("file", "pipe"):
            raise UserError(f"{p}: is a {kind}, not a file of texts; embed.py reads .txt and .jsonl files (maybe .gz), "
                            f".parquet files, pipes, and - for standard input")
        if world > 1 and (p == "-" or kind == "pipe"):
            raise UserError(f"{p}: standard input and pipes are read by one process; with {world} processes, each "
                            f"reads the inputs itself: save it to a file first")
        if p.endswith(".parquet"):
            parquet_file(Path(p), cfg.text_field)
        if p != "-" and Path(p).resolve() == out.resolve():
            raise UserError(f"--output {out}: is also an input, which it would overwrite")
    if out.exists() and not (cfg.overwrite or cfg.resume):
        raise UserError(f"--output {out}: exists; pass --overwrite to replace it")
    if cfg.output_dtype == "int8" and not cfg.ranges and (r := quantize.ranges_path(out)).exists() and not (
            cfg.overwrite or cfg.resume):
        raise UserError(f"--output {out}: its ranges {r} exist; pass --overwrite to replace both")
    if not out.parent.exists() or not os.access(out.parent, os.W_OK):
        raise UserError(f"{out}: cannot write into {out.parent}")


def spooled(inputs, folder: Path, field: str = "text") -> dict[str, Path]:
    """Standard input and pipes (`<(zcat a.gz)`) copied once into `folder`: both passes read them, the first to count
    the rows (the output's size is known before its first row is written). A copy's name keeps the format its
    input's name says (.jsonl, .gz); where the name says none (standard input, /dev/fd/63), a first line that is a JSON
    object makes it JSON lines, said in one line, else a text a line: the markup is never embedded as text."""
    copies = {}
    for k, p in enumerate(dict.fromkeys(inputs)):
        if p == "-" or path_kind(Path(p)) == "pipe":
            copy = folder / f"{k}-{'stdin' if p == '-' else Path(p).name}"
            with open(p, "rb") if p != "-" else contextlib.nullcontext(sys.stdin.buffer) as src:
                with open(copy, "wb") as f:
                    shutil.copyfileobj(src, f)
            if not copy.name.endswith(SUFFIXES):
                jsonl = json_lines(copy)
                copy = copy.rename(copy.with_name(copy.name + (".jsonl" if jsonl else ".txt")))
                if jsonl:
                    say(f"{p}: its first line is a JSON object: read as JSON lines, each one's '{field}' a text",
                        file=sys.stderr)
            copies[p] = copy
    return copies


def json_lines(path: Path) -> bool:
    """Whether the first line that is not blank is a JSON object."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    return isinstance(json.loads(raw.decode("utf-8-sig", errors="replace")), dict)
                except ValueError:
                    return False
    return False


def count_rows(inputs, copies: dict, field: str = "text") -> tuple[int, int]:
    """(texts, characters) of every input: a streaming first pass; a Parquet file's are in its footer (none is
    decoded: its characters are the column's bytes, uncompressed)."""
    rows = chars = 0
    for p in inputs:
        if p.endswith(".parquet"):
            n, c = parquet_rows(copies.get(p) or Path(p), field)
        else:
            n = c = 0
            for text in read_lines(Path(p), copies.get(p), field=field):
                n, c = n + 1, c + len(text)
        rows, chars = rows + n, chars + c
    return rows, chars


def parquet_rows(path: Path, field: str) -> tuple[int, int]:
    source = parquet_file(path, field)
    if source is None:  # an empty file: none
        return 0, 0
    return source.metadata.num_rows, column_bytes(source, field)


# A block holds --block texts, or as many as come to this many characters on average over the input, where its texts
# are long (books: 16,384 of them would be gigabytes of text, tokens and states at once)
BLOCK_CHARS = 1 << 25


def block_rows(block: int, rows: int, chars: int) -> int:
    """The texts of a block: --block, or fewer where the input's texts are long."""
    return max(1, min(block, BLOCK_CHARS * rows // max(chars, 1)))


def blocks(inputs, copies: dict, size: int, wanted=None, field: str = "text"):
    """(index, texts): the inputs' texts in order, `size` at a time. wanted: the block indices to read, increasing
    (drawn one at a time, when the one before is done); the rows of the others are passed over unread, and nothing
    after the last is read."""
    wanted = itertools.count() if wanted is None else iter(wanted)
    target, row, block = next(wanted, None), 0, []

    def skipping():  # the row about to be read is not in the block wanted
        return row // size != target

    for path in inputs:
        for text in read_lines(Path(path), copies.get(path), skipping, field):
            if target is None:
                return
            if text is not None:
                block.append(text)
            row += 1
            if row % size == 0 and row // size - 1 == target:
                yield target, block
                target, block = next(wanted, None), []
    if block:  # the last block, shorter than the others
        yield target, block
