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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model import load_pretrained, mean_pool
from support import embedding
from support.cli import Progress, UserError, cli, flag, parse_config
from support.device import OnDevice, autocast, cpu_threads, device_and_dtype, to_device
from support.files import write_atomic
from support.hub import special_ids


@dataclass
class EmbedConfig(OnDevice):  # --dtype, --device and --threads (support.device.OnDevice), then these
    model: str = flag("", "hub id or local Hugging Face directory")
    inputs: list = flag(list, ".txt (a text a line, empty lines too), .jsonl (field text), - (stdin)")
    output: str = flag("embeddings.npy", "written under a temporary name, renamed when complete")
    overwrite: bool = flag(False, "replace an --output that exists")
    format: str = flag("", "default: --output's extension", choices=("npy", "jsonl"))
    normalize: bool = flag(False, "unit vectors, so that dot products are cosines")
    long: str = flag("truncate", "texts over the model's length", choices=("truncate", "chunk"))
    batch_tokens: int = flag(0, "padded tokens per batch; 0: 2048 on a CPU (cache-sized), 65536 on a GPU", low=0)
    block: int = flag(16384, "texts read, sorted and embedded at a time: bounds memory for inputs of any size", low=1)

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
    limit = model.sentence_transformers.get("max_seq_length", model.config.max_tokens)
    return min(model.config.max_tokens, limit)


@torch.inference_mode()
def embed_tokenized(tokenized: Tokenized, model, tok, *, batch_tokens: int = 0, normalize: bool = False,
                    dtype: torch.dtype | None = None, progress=None) -> np.ndarray:
    """encode() after tokenize(), with dropout off. On a GPU nothing here waits for the GPU but the one copy back at
    the end: each batch goes in from page-locked memory while the GPU still works on the one before, and stays
    there."""
    device, pieces, pad = next(model.parameters()).device, tokenized.pieces, special_ids(tok)["pad"]
    budget = batch_tokens or (65536 if device.type == "cuda" else 2048)  # a CPU's: cache-sized
    width = embedding.shape_multiples(device, dtype)[0]
    out = torch.zeros((len(pieces), model.config.hidden_size), dtype=torch.float32, device=device)
    finished = embedding.FinishedTexts(tokenized.owner, tokenized.n_texts, progress)
    # One autocast region for all the batches: its weights are cast to bf16 once, not for every batch
    with embedding.eval_mode(model), autocast(dtype, device):
        # Longest first, in batches of similar length: little compute goes to padding
        for rows, T in length_batches(pieces, budget, width, model.config.max_tokens):
            # The batch padded to T, and where its real tokens are (None: it has no padding; model.Packing)
            ids, mask, positions = embedding.padded_batch([pieces[k] for k in rows], pad, T, device, dtype)
            h = model(ids, None if positions is None else mask, positions)  # (rows, T, H)
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


@cli
def main(argv=None):
    cfg = parse_config(EmbedConfig, argv, __doc__.split("\n\n")[0], positional=("inputs",))
    with cpu_threads(cfg.threads):
        embed_files(cfg)


def embed_files(cfg: EmbedConfig):
    """`python embed.py`: every input's texts embedded, in order, into --output (support/embedding.py reads, writes)."""
    out = Path(cfg.output)
    if not cfg.model:
        raise UserError("no --model given: a hub id or a local Hugging Face directory")
    embedding.check_paths(cfg, out)
    device, dtype = device_and_dtype(cfg.device, cfg.dtype)
    model, tok = load_pretrained(cfg.model, quiet=True)
    model.to(device)
    with tempfile.TemporaryDirectory() as tmpdir:
        copies = embedding.spooled(cfg.inputs, Path(tmpdir))
        if (n := embedding.count_rows(cfg.inputs, copies)) == 0:
            raise UserError(f"{', '.join(cfg.inputs)}: no texts")
        progress, done = Progress("embedding", f"{n:,} texts with {cfg.model}, into {out}"), [0, 0]

        def report(finished: int, windows: int):  # texts finished, and (--long chunk) the windows they took
            done[0], done[1] = done[0] + finished, done[1] + windows
            chunks = f" ({done[1]:,} windows)" if cfg.long == "chunk" else ""
            progress(f"{done[0]:,}/{n:,} texts{chunks}, {done[0] / (time.time() - progress.t0):,.0f} texts/s")

        def write(tmp: Path):
            with open(tmp, "wb") as f:
                blocks = embedding.blocks(cfg.inputs, copies, cfg.block)
                embedding.write_rows(f, cfg.format, (n, model.config.hidden_size), blocks,
                                 lambda block: tokenize(block, tok, max_tokens(model), cfg.long),
                                 lambda t: embed_tokenized(t, model, tok, batch_tokens=cfg.batch_tokens,
                                                           normalize=cfg.normalize, dtype=dtype, progress=report),
                                 ahead=device.type == "cuda")

        write_atomic(out, write)  # only a complete output gets the name the user asked for
    seconds = time.time() - progress.t0
    progress.note(f"wrote {out}: {n:,} x {model.config.hidden_size} ({seconds:.1f}s, {n / seconds:,.0f} texts/s)")


if __name__ == "__main__":
    main()
