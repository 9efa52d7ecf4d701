"""
Forward throughput of model.py against transformers on the same weights and the same padded batches, CPU, fp32.

    python bench/model_forward.py                       # MiniLM on STS-B dev + a distilroberta-base shape
    python bench/model_forward.py --shared ../shared --repeats 5

Both models run under torch.inference_mode in eval mode; runs alternate (ours, theirs, ours, ...) so drift in
the machine's speed hits both alike; the figure is the median over repeats of tokens per second.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import embed as E  # noqa: E402
import model as M  # noqa: E402
from support import hub as H  # noqa: E402
from support.cli import bench, optional, shared_assets  # noqa: E402
from support.device import pad_rows  # noqa: E402


def sts_sentences(shared: Path, n: int):
    rows = (shared / "data/sts/stsbenchmark/sts-dev.csv").read_text(encoding="utf-8").splitlines()
    return list(dict.fromkeys(s for r in rows for s in r.split("\t")[5:7]))[:n]


def batches_from_text(tok, texts, bs):
    pad = H.special_ids(tok)["pad"]
    texts = sorted(texts, key=len)  # what any sensible caller does; same batches for both models
    pieces = E.tokenize(texts, tok, 256).pieces  # truncated at 256 tokens, the end token kept
    return [tuple(map(torch.from_numpy, pad_rows(pieces[i:i + bs], pad))) for i in range(0, len(pieces), bs)]


def timed(fn, batches):
    t = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            fn(ids, mask)
    return time.perf_counter() - t


def compare(name, ours, theirs, batches, repeats):
    tokens = sum(int(m.sum()) for _, m in batches)
    with torch.inference_mode():  # warm-up, and a parity check on the first batch
        ids, mask = batches[0]
        diff = (ours(ids, mask) - theirs(input_ids=ids, attention_mask=mask).last_hidden_state)[mask.bool()].abs().max()
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(lambda i, m: ours(i, m), batches))
        b.append(timed(lambda i, m: theirs(input_ids=i, attention_mask=m), batches))
    ta, tb = statistics.median(a), statistics.median(b)
    print(f"| {name} | {tokens / ta:,.0f} | {tokens / tb:,.0f} | {tb / ta:.2f} | {diff:.1e} |")


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sentences", type=int, default=1024)
    a = ap.parse_args()
    transformers = optional("transformers", "-r requirements-dev.txt")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    print("| model, batches | model.py tokens/s | transformers tokens/s | ratio | max abs diff |")
    print("|---|---|---|---|---|")
    shared = Path(a.shared)
    minilm = shared / "models/all-MiniLM-L6-v2"
    if minilm.exists():
        ours, tok = M.load_pretrained(str(minilm))
        theirs = transformers.AutoModel.from_pretrained(minilm).eval()
        sents = sts_sentences(shared, a.sentences)
        compare(f"MiniLM-L6, {len(sents)} STS-B dev sentences, batch 64", ours, theirs,
                batches_from_text(tok, sents, 64), a.repeats)
    else:
        print(f"(skipping MiniLM: {minilm} not found; pass --shared)")
    # distilroberta-base shape, random weights: spans like DeCLUTR's (32-512 tokens), batch 8, padded.
    with tempfile.TemporaryDirectory() as d:
        c = transformers.RobertaConfig(vocab_size=50265, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                                       intermediate_size=3072, max_position_embeddings=514)
        transformers.RobertaModel(c).save_pretrained(d)
        H.train_tokenizer(["a b c"], 300).save(str(Path(d) / "tokenizer.json"))
        ours, _ = M.load_pretrained(d, quiet=True)
        theirs = transformers.RobertaModel.from_pretrained(d).eval()
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        lengths = torch.randint(32, 385, (8,), generator=g)
        ids = torch.randint(3, 50265, (8, int(lengths.max())), generator=g)
        mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
        batches.append((ids.masked_fill(mask == 0, 1), mask))
    compare("distilroberta-base shape, 4 batches of 8 spans of 32-384 tokens", ours, theirs, batches, a.repeats)


if __name__ == "__main__":
    main()
