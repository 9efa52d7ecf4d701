"""
A train step of train.py against the same step done the way the original DeCLUTR did it, on the same spans and
the same weights, CPU, fp32: transformers' RobertaForMaskedLM on the masked anchors (every field padded to its
batch maximum, MLM logits for every anchor token over the whole vocabulary), the bare encoder on the positives
(padded likewise), mean pooling, NT-Xent plus MLM, backward.

    python bench/train_step.py                         # distilroberta-base shape, N=2 documents (fits 24 GB)
    python bench/train_step.py --docs 4 --repeats 3

Real tokens/s counts only the spans' own tokens (with <s> and </s>), the same number for both.
"""
import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import loss as L  # noqa: E402
import model as M  # noqa: E402
import sampler as S  # noqa: E402
import train as T  # noqa: E402
from support import hub as H  # noqa: E402
from support.cli import bench, optional, shared_assets  # noqa: E402
from support.corpus import prepare_corpus  # noqa: E402


def original_step(hf, batch, tau=0.05, P=2):
    anchor_mask, positive_mask = ((torch.arange(batch[k].shape[1])[None] < batch[f"{k[:-1]}_lengths"][:, None]).long()
                                  for k in ("anchors", "positives"))  # (B, T) 0/1 each
    out = hf(input_ids=batch["mlm_inputs"], attention_mask=anchor_mask, labels=batch["mlm_labels"],
             output_hidden_states=True)
    a = M.mean_pool(out.hidden_states[-1], anchor_mask)
    p = M.mean_pool(hf.roberta(input_ids=batch["positives"], attention_mask=positive_mask).last_hidden_state,
                    positive_mask)
    (L.nt_xent(a, p.view(len(a), P, -1), tau) + out.loss).backward()


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    transformers = optional("transformers", "-r requirements-dev.txt")
    books = sorted((Path(a.shared) / "data/corpus/gutenberg").glob("*.txt"))[:8]
    tok = H.train_tokenizer((b.read_text(encoding="utf-8") for b in books[:2]), 8000)
    with tempfile.TemporaryDirectory() as d:
        corpus = prepare_corpus(books, tok, d)
        sb = S.SpanBatches(corpus, tok, S.SamplerConfig(docs_per_step=a.docs), max_tokens=512)
        batches = [sb[i] for i in range(a.repeats)]
        torch.manual_seed(0)
        c = transformers.RobertaConfig(vocab_size=50265, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                                       intermediate_size=3072, max_position_embeddings=514)
        hf = transformers.RobertaForMaskedLM(c)
        hf.save_pretrained(d + "/m")
        tok.save(d + "/m/tokenizer.json")
        ours, _ = M.load_pretrained(d + "/m", quiet=True)
    hf.train()
    ours.train()
    cfg = T.TrainConfig()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads; "
          f"distilroberta-base shape, N={a.docs} documents, A=P=2, spans of 32-510 tokens, dropout on")
    print("| batch | real tokens | padded tokens (original) | train.py s | original s | ratio |")
    print("|---|---|---|---|---|---|")
    ta, tb, real_all = [], [], 0
    T.train_step(T.ChunkedEncoder(ours), batches[0], cfg)  # warm-up: first-call allocations
    original_step(hf, batches[0])
    for i, b in enumerate(batches):
        real = int(b["anchor_lengths"].sum() + b["positive_lengths"].sum())
        padded = b["anchors"].numel() + b["positives"].numel()
        times = []
        ours_step = functools.partial(T.train_step, T.ChunkedEncoder(ours), b, cfg)
        for fn in (ours_step, functools.partial(original_step, hf, b)):
            ours.zero_grad()
            hf.zero_grad()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        ta.append(times[0])
        tb.append(times[1])
        real_all += real
        print(f"| {i} | {real:,} | {padded:,} | {times[0]:.2f} | {times[1]:.2f} | {times[1] / times[0]:.2f} |")
    median = statistics.median(y / x for x, y in zip(ta, tb, strict=True))
    print(f"\nreal tokens/s: train.py {real_all / sum(ta):,.0f}, original {real_all / sum(tb):,.0f}, "
          f"ratio {sum(tb) / sum(ta):.2f} (median per-batch ratio {median:.2f})")


if __name__ == "__main__":
    main()
