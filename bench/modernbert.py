"""
ModernBERT on a CPU, side by side in one run: embed.py against sentence-transformers on the same ModernBERT-base-shaped
model (22 layers, hidden 768, GeGLU 1,152, local attention 128 on all layers but every third, vocabulary 50,368;
random weights scaled so that every layer counts, as no hub is reachable here), then train.py's step at 512- and
2,048-token anchors.

- Embedding: whole processes (start, load, tokenise, embed, write) on the same lines, the arms alternating, median
  of --repeats: short texts (STS-B train sentences) and long ones (Gutenberg passages of --passage-tokens tokens,
  past the local window); texts/s, the ratio to sentence-transformers' encode (its defaults: batch 32, fp32) and the
  lowest cosine of each arm's rows to its rows.
- Training: train.train_step and the optimiser step on N=--docs documents (A=P=2) with the paper's span laws and
  l_min 32, l_max 512 or 2,048, in fp32 (train.py's CPU default); each length in its own process: tokens/s (real
  tokens, anchors and positives), seconds a step and the process's peak resident memory, with and without GradCache.

    python bench/modernbert.py                         # about 25 minutes on 2 cores
    python bench/modernbert.py --repeats 1 --sentences 500 --passages 8
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from support.cli import UserError, bench, optional, shared_assets  # noqa: E402

BASE = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
            local_attention=128, global_attn_every_n_layers=3, max_position_embeddings=8192)
SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # ModernBERT's names


def tokenizer(texts):
    """A byte-level BPE of 16,000 tokens laid out as ModernBERT's ([CLS] text [SEP]), trained on the books."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=16000, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def base_model(folder: Path, books: list[str]):
    """transformers' ModernBertForMaskedLM at the base shape, its own random init, saved through model.py (so that
    sentence-transformers reads mean pooling from the folder, as it would from a DeCLUTR run's)."""
    import torch
    transformers = optional("transformers")

    import model as M

    tok = tokenizer(books)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    torch.manual_seed(0)
    hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(
        **BASE, pad_token_id=ids["[PAD]"], bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"],
        cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"]))
    with torch.no_grad():  # its init leaves the layers' outputs ~100x smaller than the embeddings: scaled up, every
        for m in hf.modules():  # layer moves the states, and a precision's error shows in the lowest cosine
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, m.in_features ** -0.5)
    hf.save_pretrained(folder / "hf")
    tok.save(str(folder / "hf" / "tokenizer.json"))
    M.save_pretrained(*M.load_pretrained(str(folder / "hf")), folder / "model")
    return folder / "model", tok


def embedding(a, d: Path, model: Path, tok, books: list[str], stsb: Path) -> list[dict]:
    from _measure import measured

    rows = stsb.read_text(encoding="utf-8").splitlines()
    sentences = [s for r in rows for s in r.split("\t")[5:7]][:a.sentences]
    words = " ".join(books).split()
    step = max(1, int(a.passage_tokens * 0.7))  # about 1.4 tokens a word with this BPE: passages of ~--passage-tokens
    passages = [" ".join(words[i * step:(i + 1) * step]) for i in range(a.passages)]
    sets = {"short (STS-B sentences)": sentences, f"long (passages of ~{a.passage_tokens} tokens)": passages}
    arms = {"embed.py, default": [sys.executable, ROOT / "embed.py", "--model", model, "--overwrite"],
            "embed.py --dtype fp32": [sys.executable, ROOT / "embed.py", "--model", model, "--overwrite",
                                      "--dtype", "fp32"]}
    st = [sys.executable, ROOT / "bench" / "st_encode.py", "encode", model]
    table = []
    for what, texts in sets.items():
        lines = d / "lines.txt"
        lines.write_text("\n".join(texts) + "\n", encoding="utf-8")
        tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
        seconds = {k: [] for k in [*arms, "sentence-transformers (fp32, batch 32)"]}
        for _ in range(a.repeats):
            for name in seconds:
                cmd = [*st, lines, d / f"{name}.npy"] if name not in arms else [*arms[name], lines, "--output",
                                                                                 d / f"{name}.npy"]
                seconds[name].append(measured(cmd)[0])
        ref = np.load(d / "sentence-transformers (fp32, batch 32).npy")
        st_rate = len(texts) / statistics.median(seconds["sentence-transformers (fp32, batch 32)"])
        for name, s in seconds.items():
            e = np.load(d / f"{name}.npy")
            cos = (e * ref).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(ref, axis=1)
            rate = len(texts) / statistics.median(s)
            table.append(dict(texts=what, n=len(texts), tokens=tokens, arm=name, texts_per_s=round(rate, 1),
                              range=f"{len(texts) / max(s):,.1f}–{len(texts) / min(s):,.1f}",
                              ratio=round(rate / st_rate, 2), lowest_cosine=float(cos.min())))
    print("| texts | arm | texts/s (range) | × sentence-transformers | lowest cosine to its rows |\n"
          "|---|---|---|---|---|")
    for r in table:
        print(f"| {r['texts']}: {r['n']:,}, {r['tokens']:,} tokens | {r['arm']} | {r['texts_per_s']:,} "
              f"({r['range']}) | {r['ratio']:.2f} | {r['lowest_cosine']:.6f} |", flush=True)
    return table


def train_once(max_span: int, docs: int, steps: int, grad_cache: bool) -> dict:
    """In its own process (--train-once): the base shape, random init, train.py's step on spans of the paper's laws."""
    import resource
    import time

    import torch
    from _spans import span_batch

    import model as M
    import train as T

    cfg = T.TrainConfig(max_span=max_span, grad_cache=grad_cache, chunk_tokens=2048 if grad_cache else 16384)
    enc = M.Encoder(M.ModelConfig(model_type="modernbert", **{k: v for k, v in BASE.items()},
                                  pad_token_id=1, bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, embedding_dropout=0.0,
                                  global_rope_theta=160_000.0, local_rope_theta=10_000.0))
    enc.init_weights(torch.Generator().manual_seed(0))
    opt = T.make_optimizer(enc.train(), cfg.lr, cfg.weight_decay, fused=False)
    times, tokens = [], []
    for step in range(steps + 1):  # the first is warm-up
        batch = span_batch(docs, vocab=16000, seed=step, max_span=max_span)  # the paper's laws, l_min 32
        t = time.perf_counter()
        stats = T.train_step(T.ChunkedEncoder(enc), batch, cfg)
        T.optimizer_step(opt, T.NO_SCALING, enc, cfg.max_grad_norm)
        if step:
            times.append(time.perf_counter() - t)
            tokens.append(stats["tokens"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(max_span=max_span, docs=docs, grad_cache=grad_cache, tokens_per_step=round(statistics.mean(tokens)),
                s_per_step=round(statistics.median(times), 1), tokens_per_s=round(sum(tokens) / sum(times), 1),
                peak_mb=round(peak))


def training(a) -> list[dict]:
    out = []
    print("\n| anchors up to | GradCache | tokens a step | s a step | tokens/s | peak MB |\n|---|---|---|---|---|---|")
    for max_span, grad_cache in ((512, False), (2048, False), (2048, True)):
        cmd = [sys.executable, __file__, "--train-once", str(max_span), "--docs", str(a.docs), "--steps",
               str(a.steps), *(["--grad-cache"] if grad_cache else [])]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise UserError(f"training at {max_span} tokens failed: {done.stderr.strip().splitlines()[-1:]}")
        r = json.loads(done.stdout.splitlines()[-1])
        out.append(r)
        print(f"| {max_span:,} | {'yes, 2,048-token chunks' if grad_cache else 'no'} | {r['tokens_per_step']:,} | "
              f"{r['s_per_step']} | {r['tokens_per_s']:,} | {r['peak_mb']:,} |", flush=True)
    return out


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--passages", type=int, default=24)
    ap.add_argument("--passage-tokens", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=1, help="documents a training step (A=2 anchors, P=2 positives each)")
    ap.add_argument("--steps", type=int, default=2, help="training steps timed, after one of warm-up")
    ap.add_argument("--train-once", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--grad-cache", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="", help="also write the tables here")
    a = ap.parse_args()
    if a.train_once:
        return print(json.dumps(train_once(a.train_once, a.docs, a.steps, a.grad_cache)))
    optional("sentence_transformers")
    import torch
    from _measure import processor

    shared = Path(a.shared)
    stsb = shared / "data/sts/stsbenchmark/sts-train.csv"
    books = sorted((shared / "data/corpus/gutenberg").glob("*.txt"))
    if not stsb.exists() or len(books) < 6:
        raise UserError(f"{shared}: needs sts-train.csv and 6 Gutenberg books (--shared)")
    texts = [b.read_text(encoding="utf-8", errors="replace") for b in books[:6]]
    print(f"{processor()}; torch {torch.__version__}\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = base_model(Path(tmp), texts)
        table = embedding(a, Path(tmp), model, tok, texts, stsb)
    trained = training(a)
    if a.json:
        Path(a.json).write_text(json.dumps({"processor": processor(), "embedding": table, "training": trained},
                                           indent=2) + "\n")


if __name__ == "__main__":
    main()
