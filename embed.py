"""
embed.py: sentence embeddings of text files with a trained encoder, fast and in bounded memory.

Paper §3.1 and §4.2: a text's embedding is the mean of the encoder's last-layer token states over
the attention mask, the same pooling that training used. Texts are sorted by length and batched by a
token budget, so little compute goes to padding, then written back in input order.

    python embed.py --model runs/declutr/model texts.txt --output embeddings.npy
    python embed.py --model sentence-transformers/all-MiniLM-L6-v2 a.txt b.jsonl --output out.npy \\
        --normalize
    cat texts.txt | python embed.py --model M - --output out.jsonl --format jsonl
    python embed.py --model M long_docs.txt --output out.npy --long chunk   # windows, averaged
    torchrun --nproc_per_node=8 embed.py --model M corpus.jsonl --output out.npy   # a process a GPU
    python embed.py --model M corpus.jsonl --output out.npy --resume   # after a stop: the rest

    from embed import encode
    vectors = encode(["A man plays a guitar.", "Someone plays music."], model, tok)   # (2, hidden)
"""
from dataclasses import dataclass

import numpy as np
import torch

from model import Packing, load_pretrained, mean_pool
from support import cpu_layers, embed_job, embedding
from support.cli import cli, flag, parse_config
from support.device import OnDevice, autocast, compute, to_device
from support.embed_job import JobConfig
from support.hub import special_ids
from support.threads import across_cores, cpu_threads


@dataclass
class EmbedConfig(JobConfig, OnDevice):  # these, the job's (support/embed_job.py), OnDevice's
    model: str = flag("", "hub id or local Hugging Face directory")
    normalize: bool = flag(False, "unit vectors, so that dot products are cosines")
    long: str = flag("truncate", "texts over the model's length", choices=("truncate", "chunk"))
    batch_tokens: int = flag(0, "padded tokens a batch; 0: 2048 on a CPU, 65536 on a GPU", low=0)

    def validate(self):
        embedding.check_flags(self)  # one line for flags that cannot go together


def _segments(ids, max_tokens: int, long: str) -> list:
    """One text's ids (with its special tokens) -> the pieces to embed: itself, truncated, or
    overlapping windows."""
    if len(ids) <= max_tokens:
        return [ids]
    head, body, tail = ids[:1], ids[1:-1], ids[-1:]
    w = max_tokens - 2
    if long == "truncate":
        return [np.concatenate([head, body[:w], tail])]
    # Half-window overlap: every token sits inside some window away from its edges
    step = max(1, w // 2)
    starts = list(range(0, len(body) - w, step)) + [len(body) - w]
    return [np.concatenate([head, body[s:s + w], tail]) for s in starts]


@dataclass
class Tokenized:
    """Texts as the pieces to embed: pieces[i] is token ids with special tokens, owner[i] the text
    it belongs to."""
    pieces: list
    owner: np.ndarray
    n_texts: int


def tokenize(texts, tok, max_tokens: int, long: str = "truncate") -> Tokenized:
    """Texts -> their pieces. Truncated, a long text is tokenised only as far as the model reads it
    (support/embedding.py's token_ids: the same ids, in bounded memory); in windows, all of it."""
    texts, pieces, owner = list(texts), [], []
    limit = max_tokens if long == "truncate" else None
    for i, ids in enumerate(embedding.token_ids(texts, tok, limit)):
        segs = _segments(ids, max_tokens, long)
        pieces += segs
        owner += [i] * len(segs)
    return Tokenized(pieces, np.asarray(owner, dtype=np.int64), len(texts))


def encode(texts, model, tok, *, batch_tokens: int = 0, long: str = "truncate",
           normalize: bool = False, dtype: torch.dtype | None = None, progress=None) -> np.ndarray:
    """Mean-pooled embeddings (len(texts), hidden) in input order, float32. progress(texts, windows)
    is told, after each batch, how many texts it finished (a text is finished once all its windows
    are) and how many windows ran."""
    return embed_tokenized(tokenize(texts, tok, max_seq_length(model), long), model, tok,
                           batch_tokens=batch_tokens, normalize=normalize, dtype=dtype,
                           progress=progress)


def max_seq_length(model) -> int:
    """The most tokens of a text embedded at once (a --long chunk window's length), <s> and </s>
    included: the model's positions, or its sentence-transformers config's max_seq_length where
    that is shorter, as sentence-transformers itself truncates."""
    limit = model.sentence_transformers.get("max_seq_length", model.config.max_tokens)
    return min(model.config.max_tokens, limit)


@torch.no_grad()  # not inference_mode, under which autocast casts every weight again every batch
def embed_tokenized(tokenized: Tokenized, model, tok, *, batch_tokens: int = 0,
                    normalize: bool = False, dtype: torch.dtype | None = None,
                    progress=None) -> np.ndarray:
    """encode() after tokenize(), dropout off. On a GPU nothing here waits for the GPU but the one
    copy back at the end: each batch goes in from page-locked memory while the GPU works on the one
    before, and stays there."""
    device, pieces = next(model.parameters()).device, tokenized.pieces
    pad = special_ids(tok)["pad"]
    budget = batch_tokens or (65536 if device.type == "cuda" else 2048)  # a CPU's: cache-sized
    hidden = model.config.hidden_size
    out = torch.zeros((len(pieces), hidden), dtype=torch.float32, device=device)  # (pieces, H)
    finished = embedding.FinishedTexts(tokenized.owner, tokenized.n_texts, progress)
    # Longest first, of similar lengths: little compute goes to padding
    batches = list(length_batches(pieces, budget))

    def embed_batch(batch):
        # Padded to T, and where the real tokens are, worked out on the host (None: run as it is)
        rows, T = batch
        ids, mask, positions, attend = embedding.padded_batch([pieces[k] for k in rows], pad, T,
                                                              device)
        # Autocast is a thread's own: on a CPU several batches run at once, a thread each
        with autocast(dtype, device):
            h = model(ids, mask, Packing(*ids.shape, positions, attend))  # (rows, T, H)
        # §3.1: each piece's embedding is the mean of its token states, pooled in fp32 whatever the
        # encoder ran in
        return rows, mean_pool(h.float(), mask)

    # One autocast region for all: a GPU casts the weights once a call, not once a batch. On a CPU
    # several batches at once, a thread each
    with embedding.eval_mode(model), compute(dtype, device):
        for rows, pooled in across_cores(batches, embed_batch, cpu=device.type == "cpu"):
            out.index_copy_(0, to_device(rows, device), pooled)
            finished(rows)
    out = out.cpu().numpy()
    if len(pieces) != tokenized.n_texts:  # --long chunk: a text's embedding is its windows' mean
        sums = np.zeros((tokenized.n_texts, out.shape[1]), dtype=np.float64)
        np.add.at(sums, tokenized.owner, out)
        windows = np.bincount(tokenized.owner, minlength=tokenized.n_texts)
        out = (sums / windows[:, None]).astype(np.float32)
    if normalize:
        out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


# GPUs' fused attention kernels give each row of a batch its own blocks along a grid dimension of at
# most 65,535: 131,072 tokens of empty lines (2 tokens each) would be 65,536 rows, and a CUDA error
MAX_ROWS = 32768


def length_batches(pieces, budget: int):
    """(rows, T): the pieces longest first, in batches of at most `budget` padded tokens (the
    longest piece alone if it is over) and MAX_ROWS rows, T the batch's longest. Longest first: a
    batch that does not fit in memory fails at once."""
    order = np.argsort([len(p) for p in pieces], kind="stable")[::-1]
    i = 0
    while i < len(order):
        T = len(pieces[order[i]])
        # The first is the longest, so that rows x T <= budget
        j = min(len(order), i + min(MAX_ROWS, max(1, budget // T)))
        yield order[i:j], T
        i = j


@cli
def main(argv=None):
    """`python embed.py`, or `torchrun ... embed.py` (a process per GPU, on one machine or several):
    every input's texts embedded in blocks, each block by whichever process takes it, its rows kept
    as soon as they are written, the output named when the last is in (support/embed_job.py: sharing
    out, the record, --resume)."""
    cfg = parse_config(EmbedConfig, argv, __doc__.split("\n\n")[0], positional=("inputs",))
    with cpu_threads(cfg.threads):
        proc, device, dtype = embed_job.place(cfg)  # the paths checked; this process and its device
        model, tok = load_pretrained(cfg.model, quiet=True)
        # On a CPU, short rows' attention written out and, in bf16 where this processor runs them,
        # the layers' products as oneDNN's (support/cpu_layers.py); `runs` says so in the first line
        model, runs = cpu_layers.for_inference(model.to(device), device, dtype, cfg)
        length = max_seq_length(model)
        with embed_job.started(cfg, proc, model, device=device, dtype=dtype, max_tokens=length,
                               argv=argv, runs=runs) as job:
            # This process's blocks, in input order, each tokenised, embedded and kept (on a GPU the
            # next block is read and tokenised in a thread meanwhile)
            for block, pieces in job.blocks(lambda texts: tokenize(texts, tok, length, cfg.long),
                                            ahead=device.type == "cuda"):
                rows = embed_tokenized(pieces, model, tok, batch_tokens=cfg.batch_tokens,
                                       normalize=cfg.normalize, dtype=dtype, progress=job.progress)
                job.write(block, rows)


if __name__ == "__main__":
    main()
