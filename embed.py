"""
embed.py: sentence embeddings of text files with a trained encoder, fast and in bounded memory.

Paper §3.1 and §4.2: a text's embedding is the mean of the encoder's last-layer token states over the
attention mask, the same pooling that training used. Texts are sorted by length and batched by a token
budget, so little compute goes to padding, then written back in input order.

    python embed.py --model runs/declutr/model texts.txt --output embeddings.npy
    python embed.py --model sentence-transformers/all-MiniLM-L6-v2 a.txt b.jsonl --output out.npy --normalize
    cat texts.txt | python embed.py --model M - --output out.jsonl --format jsonl
    python embed.py --model M long_docs.txt --output out.npy --long chunk    # windows, averaged

    from embed import encode
    vectors = encode(["A man plays a guitar.", "Someone plays music."], model, tok)   # (2, hidden) float32
"""
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from model import load_pretrained, mean_pool, nonpad_positions
from support.cli import Progress, UserError, bounded, choice, cli, parse_config, say
from support.corpus import read_lines
from support.device import (
    OnDevice,
    autocast,
    autocast_dtype,
    cpu_has_bf16,
    cpu_threads,
    pad_rows,
    padding_mask,
    pick_device,
    prefetched,
    to_device,
)
from support.files import path_kind, write_atomic
from support.hub import special_ids


@dataclass
class EmbedConfig(OnDevice):  # --dtype, --device and --threads (support.device.OnDevice), then these
    model: str = ""  # hub id or local Hugging Face directory
    inputs: list = field(default_factory=list)  # .txt (a text a line, empty lines too), .jsonl (field text), - (stdin)
    output: str = "embeddings.npy"  # written under a temporary name, renamed when complete
    overwrite: bool = False  # replace an --output that exists
    format: str = field(default="", metadata={"choices": ["npy", "jsonl"]})  # default: --output's extension
    normalize: bool = False  # unit vectors, so that dot products are cosines
    long: str = choice("truncate", "chunk")  # texts over the model's length
    batch_tokens: int = bounded(0, 0)  # padded tokens per batch; 0: 2048 on a CPU (cache-sized), 65536 on a GPU
    block: int = bounded(16384, 1)  # texts read, sorted and embedded at a time: bounds memory for inputs of any size

    def validate(self):
        """npy (float32, texts x hidden) or jsonl (an {"embedding": [...]} per line), by --output's extension."""
        suffix = Path(self.output).suffix
        if Path(self.output).is_dir():
            raise UserError(f"--output {self.output}: is a folder; name the file to write")  # a path: exit 1
        if self.format and suffix in (".npy", ".jsonl") and suffix != "." + self.format:
            raise UserError(f"--format {self.format}: --output {self.output} says {suffix[1:]}; name the file "
                            f".{self.format} or leave --format out", code=2)
        if not self.format and suffix not in (".npy", ".jsonl"):
            raise UserError(f"--output {self.output}: cannot tell the format from its name; pass --format npy or "
                            f"--format jsonl", code=2)
        self.format = self.format or suffix[1:]


def _segments(ids: list[int], max_tokens: int, long: str) -> list[list[int]]:
    """One text's ids (with its special tokens) -> the pieces to embed: itself, truncated, or overlapping windows."""
    if len(ids) <= max_tokens:
        return [ids]
    head, body, tail = ids[:1], ids[1:-1], ids[-1:]
    w = max_tokens - 2
    if long == "truncate":
        return [head + body[:w] + tail]
    step = max(1, w // 2)  # half-window overlap: every token sits inside some window away from its edges
    starts = list(range(0, len(body) - w, step)) + [len(body) - w]
    return [head + body[s:s + w] + tail for s in starts]


@dataclass
class Tokenized:
    """Texts as the pieces to embed: pieces[i] is token ids with special tokens, owner[i] the text it belongs to."""
    pieces: list
    owner: np.ndarray
    n_texts: int


def tokenize(texts, tok, max_tokens: int, long: str = "truncate") -> Tokenized:
    encodings = getattr(tok, "encode_batch_fast", tok.encode_batch)(list(texts))  # all cores, no character offsets
    pieces, owner = [], []
    for i, e in enumerate(encodings):
        segs = _segments(e.ids, max_tokens, long)
        pieces += segs
        owner += [i] * len(segs)
    return Tokenized(pieces, np.asarray(owner, dtype=np.int64), len(encodings))


def encode(texts, model, tok, *, batch_tokens: int = 0, long: str = "truncate", normalize: bool = False,
           dtype: torch.dtype | None = None, progress=None) -> np.ndarray:
    """Mean-pooled embeddings (len(texts), hidden) in input order, float32. progress(texts, windows) is told, after
    each batch, how many texts it finished (a text is finished once all its windows are) and how many windows ran."""
    return embed_tokenized(tokenize(texts, tok, max_tokens(model), long), model, tok,
                           batch_tokens=batch_tokens, normalize=normalize, dtype=dtype, progress=progress)


def max_tokens(model) -> int:
    """The longest window a text is embedded in, <s> and </s> included: the model's positions, or the max_seq_length
    of its sentence-transformers config where that is shorter, as sentence-transformers itself truncates."""
    limit = getattr(model, "sentence_transformers", {}).get("max_seq_length", model.config.max_tokens)
    return min(model.config.max_tokens, limit)


@torch.inference_mode()
def embed_tokenized(tokenized: Tokenized, model, tok, *, batch_tokens: int = 0, normalize: bool = False,
                    dtype: torch.dtype | None = None, progress=None) -> np.ndarray:
    """encode() after tokenize(). Dropout is off, as in sentence-transformers' encode (a model in training mode would
    embed differently each call), and the model's mode is put back afterwards. On a GPU nothing here waits for the
    GPU but the one copy back at the end: each batch goes in from page-locked memory while the GPU still works on
    the one before, and stays there."""
    device, pieces = next(model.parameters()).device, tokenized.pieces
    pad, width, tokens = special_ids(tok)["pad"], *shape_multiples(device, dtype)
    out = torch.zeros((len(pieces), model.config.hidden_size), dtype=torch.float32, device=device)
    finished = Finished(tokenized, progress)
    # One autocast region for all the batches: its weights are cast to bf16 once, not for every batch
    with eval_mode(model), autocast(dtype, device):
        for rows, T in length_batches(pieces, batch_tokens or (65536 if device.type == "cuda" else 2048), width,
                                      model.config.max_tokens):
            # The batch's pieces padded to T, and the positions its token-wise layers run on (model.Encoder)
            ids, mask = pad_rows([pieces[k] for k in rows], pad, width=T)
            lengths = mask.sum(1)
            nonpad = to_device(token_positions(lengths, T, tokens), device) if lengths.min() < T else None
            ids, mask = to_device(ids, device), to_device(mask, device)
            h = model(ids, mask if nonpad is not None else None, nonpad=nonpad)  # (rows, T, H)
            # §3.1: each piece's embedding is the mean of its token states, pooled in fp32 whatever the encoder ran in
            out.index_copy_(0, to_device(rows, device), mean_pool(h.float(), mask))
            finished(rows)
    out = out.cpu().numpy()
    if len(pieces) != tokenized.n_texts:  # --long chunk: a text's embedding is the mean of its windows
        sums = np.zeros((tokenized.n_texts, out.shape[1]), dtype=np.float64)
        np.add.at(sums, tokenized.owner, out)
        out = (sums / np.bincount(tokenized.owner, minlength=tokenized.n_texts)[:, None]).astype(np.float32)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def length_batches(pieces, budget: int, width: int, max_tokens: int):
    """(rows, T): the pieces longest first, in batches of at most `budget` padded tokens (the longest piece alone if it
    is over), T the batch's width rounded up to a multiple of `width` as far as the model's positions go. Longest
    first: a batch that does not fit in memory fails at once."""
    order = np.argsort([len(p) for p in pieces], kind="stable")[::-1]
    i = 0
    while i < len(order):
        longest = len(pieces[order[i]])
        T = min(-(-longest // width) * width, max(longest, max_tokens))
        j = min(len(order), i + max(1, budget // T))  # the first is the longest: rows x T <= budget
        yield order[i:j], T
        i = j


@contextlib.contextmanager
def eval_mode(model):
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


class Finished:
    """Tells progress(texts, windows), after each batch, how many texts it finished (a text is finished once all its
    windows are) and how many windows ran."""

    def __init__(self, tokenized: Tokenized, progress):
        self.owner, self.progress = tokenized.owner, progress
        self.left = np.bincount(tokenized.owner, minlength=tokenized.n_texts)  # windows left per text

    def __call__(self, rows: np.ndarray):
        if self.progress:
            texts = self.owner[rows]
            np.subtract.at(self.left, texts, 1)
            self.progress(int((self.left[np.unique(texts)] == 0).sum()), len(rows))


def shape_multiples(device: torch.device, dtype) -> tuple[int, int]:
    """(width, tokens): what a batch's width and the count of tokens its token-wise layers run on are rounded up to.
    oneDNN builds a bf16 kernel for every new shape a CPU meets (about 10 ms each here, against 6 ms to run one), and
    the real tokens of a batch are a new count almost every time: on a CPU in bf16, widths of 8 and counts of 64
    leave few shapes (14% more sentences/s, docs/measurements.md). fp32 and GPUs need none."""
    return (8, 64) if device.type == "cpu" and dtype == torch.bfloat16 else (1, 1)


def token_positions(lengths: np.ndarray, T: int, multiple: int) -> np.ndarray:
    """The flat positions the token-wise layers run on: the real tokens', then as many padding positions as make
    their count a multiple of `multiple`, where the batch has that much padding (pooling leaves them out)."""
    real = nonpad_positions(lengths, T)
    extra = -len(real) % multiple
    padding = np.flatnonzero(~padding_mask(lengths, T))[:extra]
    return np.sort(np.concatenate([real, padding])) if extra and len(padding) == extra else real


# -----------------------------------------------------------------------------------------------
# Files in, rows out, in blocks.


def _blocks(cfg, copies: dict):
    block = []
    for path in cfg.inputs:
        for text in read_lines(Path(path), copies.get(path)):
            block.append(text)
            if len(block) == cfg.block:
                yield block
                block = []
    if block:
        yield block


def check_paths(cfg: EmbedConfig, out: Path):
    """Every input readable, and an output that overwrites nothing the user has (unless --overwrite)."""
    for p in cfg.inputs:
        if p == "-" and sys.stdin is None:  # started with standard input closed (`<&-`)
            raise UserError("-: standard input is closed; pipe the texts in, or name a file")
        kind = "file" if p == "-" else path_kind(Path(p))
        if kind == "missing":
            raise UserError(f"{p}: no such file")
        if kind not in ("file", "pipe"):
            raise UserError(f"{p}: is a {kind}, not a file of texts; embed.py reads .txt and .jsonl files (maybe .gz), "
                            f"pipes, and - for standard input")
        if p != "-" and Path(p).resolve() == out.resolve():
            raise UserError(f"--output {out}: is also an input, which it would overwrite")
    if out.exists() and not cfg.overwrite:
        raise UserError(f"--output {out}: exists; pass --overwrite to replace it")
    if not out.parent.exists() or not os.access(out.parent, os.W_OK):
        raise UserError(f"{out}: cannot write into {out.parent}")


def spooled(inputs, folder: Path) -> dict[str, Path]:
    """Standard input and pipes (`<(zcat a.gz)`) copied once into `folder`: both passes read them, the first to count
    the rows (the output's size is known before its first row is written)."""
    copies = {}
    for k, p in enumerate(dict.fromkeys(inputs)):
        if p == "-" or path_kind(Path(p)) == "pipe":
            copies[p] = folder / f"{k}-{'stdin.txt' if p == '-' else Path(p).name}"  # its name says .jsonl, .gz
            with open(p, "rb") if p != "-" else contextlib.nullcontext(sys.stdin.buffer) as src:
                with open(copies[p], "wb") as f:
                    shutil.copyfileobj(src, f)
    return copies


def device_and_dtype(device: str, dtype: str):
    """--device and --dtype, for embed.py and evaluate_sts.py alike: an STS score is the score of the embeddings that
    embed.py writes. auto: bf16 on a GPU that has it, else fp16; bf16 on a CPU that multiplies it in hardware (AMX or
    AVX512-BF16: 2-3x fp32's speed, cosine to fp32 above 0.9999), else fp32."""
    device = pick_device(device)
    if dtype == "fp16" and device.type == "cpu":
        raise UserError("--dtype fp16 is for GPUs; on a CPU embeddings are computed in bf16 or fp32")
    if dtype == "bf16" and device.type == "cpu" and not cpu_has_bf16():
        say("warning: --dtype bf16: this CPU has neither AMX nor AVX512-BF16, so bf16 is emulated, about 400x slower "
            "than fp32 in matrix products; --dtype auto picks fp32 here", file=sys.stderr)
    return device, autocast_dtype(dtype, device, cpu_bf16=True)


def write_rows(f, cfg: EmbedConfig, n: int, model, tok, dtype, copies: dict, progress):
    """Every block's embeddings appended to the open file f, in input order (npy: the header first)."""
    if cfg.format == "npy":  # the row count is known, so the header can come before the rows
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                 "shape": (n, model.config.hidden_size)})
    # On a GPU the next block is read and tokenised (in a thread: the tokenizer releases the GIL) while this one is
    # embedded. On a CPU the two would only share the same cores.
    longest = max_tokens(model)
    blocks, gpu = _blocks(cfg, copies), next(model.parameters()).device.type == "cuda"

    def work(texts):
        return tokenize(texts, tok, longest, cfg.long)

    for tokenized in prefetched(blocks, work) if gpu else map(work, blocks):
        emb = embed_tokenized(tokenized, model, tok, batch_tokens=cfg.batch_tokens, normalize=cfg.normalize,
                              dtype=dtype, progress=progress)
        if cfg.format == "npy":
            f.write(emb.astype("<f4").tobytes())
        else:
            f.writelines((json.dumps({"embedding": [round(float(x), 7) for x in e]}) + "\n").encode() for e in emb)


@cli
def main(argv=None):
    cfg = parse_config(EmbedConfig, argv, __doc__.split("\n\n")[0], positional=("inputs",))
    with cpu_threads(cfg.threads):
        embed_files(cfg)


def embed_files(cfg: EmbedConfig):
    """`python embed.py`: every input's texts embedded, in order, into --output."""
    out = Path(cfg.output)
    if not cfg.model:
        raise UserError("no --model given: a hub id or a local Hugging Face directory")
    check_paths(cfg, out)
    device, dtype = device_and_dtype(cfg.device, cfg.dtype)
    model, tok = load_pretrained(cfg.model, quiet=True)
    model.to(device)
    with tempfile.TemporaryDirectory() as tmpdir:
        copies = spooled(cfg.inputs, Path(tmpdir))
        n = sum(sum(1 for _ in read_lines(Path(p), copies.get(p))) for p in cfg.inputs)  # a streaming first pass
        if n == 0:
            raise UserError(f"{', '.join(cfg.inputs)}: no texts")
        progress, done = Progress("embedding", f"{n:,} texts with {cfg.model}, into {out}"), [0, 0]

        def report(texts: int, windows: int):  # texts finished, and (--long chunk) the windows they took
            done[0], done[1] = done[0] + texts, done[1] + windows
            chunks = f" ({done[1]:,} windows)" if cfg.long == "chunk" else ""
            progress(f"{done[0]:,}/{n:,} texts{chunks}, {done[0] / (time.time() - progress.t0):,.0f} texts/s")

        def write(tmp: Path):
            with open(tmp, "wb") as f:
                write_rows(f, cfg, n, model, tok, dtype, copies, report)

        write_atomic(out, write)  # only a complete output gets the name the user asked for
    seconds = time.time() - progress.t0
    progress.note(f"wrote {out}: {n:,} x {model.config.hidden_size} ({seconds:.1f}s, {n / seconds:,.0f} texts/s)")


if __name__ == "__main__":
    main()
