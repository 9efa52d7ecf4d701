"""
sampler.py's speed: corpus preparation against tokenizers' own encode_batch on the same text, and sampled
batches per second against what a train step consumes, on the Gutenberg books in ../shared.

    python bench/sampler_speed.py                      # 200 books, MiniLM's WordPiece and a byte-level BPE
    python bench/sampler_speed.py --books 50 --shared /path/to/shared
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import model as M  # noqa: E402
import sampler as S  # noqa: E402
from support import demo  # noqa: E402
from support import hub as H  # noqa: E402
from support.cli import bench, shared_assets  # noqa: E402
from support.corpus import prepare_corpus  # noqa: E402
from support.workers import prefetched_batches  # noqa: E402


def mask_of(ids, lengths):
    return (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()  # (B, T) 0/1


def prep_vs_encode_batch(name, tok, books):
    texts = [b.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n") for b in books]
    t = time.perf_counter()
    n = sum(len(e.ids) for e in tok.encode_batch(texts))
    base = n / (time.perf_counter() - t)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        c = prepare_corpus(books, tok, d)
        ours = c.meta["tokens"] / (time.perf_counter() - t)
    print(f"| {name} | {len(books)} books, {c.meta['tokens']:,} tokens | {ours:,.0f} | {base:,.0f} | "
          f"{ours / base:.2f} |")


def train_step_seconds(shape, tok, batch):
    """Forward and backward of anchors (with MLM on the masked copy) and positives, as train.py's step does."""
    torch.manual_seed(0)
    s = dict(demo.SHAPES[shape])
    s.pop("vocab_size")
    model = M.Encoder(M.ModelConfig(vocab_size=tok.get_vocab_size(), **s))
    model.init_weights(torch.Generator().manual_seed(0))
    model.train()
    t = time.perf_counter()
    anchor_mask, positive_mask = (mask_of(batch[k], batch[f"{k[:-1]}_lengths"]) for k in ("anchors", "positives"))
    h = model(batch["mlm_inputs"], anchor_mask)
    pick = batch["mlm_labels"] != -100
    mlm = torch.nn.functional.cross_entropy(model.mlm_logits(h[pick]), batch["mlm_labels"][pick])
    a = M.mean_pool(h, anchor_mask)
    p = M.mean_pool(model(batch["positives"], positive_mask), positive_mask)
    (mlm + a.pow(2).mean() + p.pow(2).mean()).backward()
    return time.perf_counter() - t


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--books", type=int, default=200)
    ap.add_argument("--batches", type=int, default=40)
    a = ap.parse_args()
    shared = Path(a.shared)
    books = sorted((shared / "data/corpus/gutenberg").glob("*.txt"))[:a.books]
    minilm = H.load_tokenizer(shared / "models/all-MiniLM-L6-v2")
    bpe = H.train_tokenizer((b.read_text(encoding="utf-8") for b in books[:20]), 32000)
    print(f"{torch.get_num_threads()} threads; tokenizers uses every core in both columns\n")
    print("| tokenizer | text | prepare_corpus tokens/s | encode_batch tokens/s | ratio |")
    print("|---|---|---|---|---|")
    prep_vs_encode_batch("MiniLM WordPiece", minilm, books)
    prep_vs_encode_batch("byte-level BPE, 32k", bpe, books)

    with tempfile.TemporaryDirectory() as d:
        corpus = prepare_corpus(books, bpe, d)
        cfg = S.SamplerConfig(docs_per_step=16)  # N=16, A=P=2, l_min=32, l_max=512: the paper's batch
        sb = S.SpanBatches(corpus, bpe, cfg, max_tokens=512)
        steps = min(a.batches, sb.steps_per_epoch * 3)
        t = time.perf_counter()
        for s in range(steps):
            sb[s]
        one = steps / (time.perf_counter() - t)
        t = time.perf_counter()
        n = sum(1 for _ in prefetched_batches(sb, range(0, steps), 2))
        loader = n / (time.perf_counter() - t)
        batch = sb[0]
        tokens = int(batch["anchor_lengths"].sum() + batch["positive_lengths"].sum())
        print(f"\nbatches of N=16 documents (A=P=2, {tokens:,} tokens in batch 0): {one:,.1f}/s in one process, "
              f"{loader:,.1f}/s from a DataLoader with 2 workers (including its start-up)\n")
        print("| train step on this CPU (forward + backward, fp32) | seconds/step | sampler batches per step |")
        print("|---|---|---|")
        # (a distilroberta-base step on this batch needs more than this machine's 24 GB in fp32 without
        # train.py's chunking; the tiny model is the fastest consumer, so it sets the hardest ratio)
        for shape in ("tiny", "small"):
            sec = min(train_step_seconds(shape, bpe, batch) for _ in range(2))
            print(f"| {shape} | {sec:.2f} | {one * sec:,.0f}× |")


if __name__ == "__main__":
    main()
