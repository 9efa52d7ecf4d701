"""
The GPU check, under 5 minutes on one GPU: bf16 parity with transformers, train tokens/s and peak memory against
the original-style transformers step, and embed sentences/s against sentence-transformers. Run by
bench/gpu_check.sh; prints one table per check. Baselines whose package is missing are reported as skipped.

    bash bench/gpu_check.sh
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import embed as E  # noqa: E402
import hub as H  # noqa: E402
import model as M  # noqa: E402
import sampler as S  # noqa: E402
import train as T  # noqa: E402

dev = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda"))  # "cpu" for a dry run of the script itself
DOCS = int(os.environ.get("GPU_CHECK_DOCS", "16"))  # a dry run on a CPU: GPU_CHECK_DOCS=1 GPU_CHECK_TEXTS=200
TEXTS = int(os.environ.get("GPU_CHECK_TEXTS", "4000"))
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
SHARED = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))


def timed(fn, repeats=5):
    fn()
    sync()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    import transformers
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU (dry run)"
    print(f"{name}, torch {torch.__version__}, transformers {transformers.__version__}")
    torch.backends.cuda.matmul.allow_tf32 = True
    d = tempfile.mkdtemp()
    torch.manual_seed(0)
    c = transformers.RobertaConfig(vocab_size=50265, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                                   intermediate_size=3072, max_position_embeddings=514)
    transformers.RobertaForMaskedLM(c).save_pretrained(d)
    texts = [f"sentence number {i} about {'many ' * (i % 40)}things" for i in range(max(TEXTS, 4000))]
    tok = H.train_tokenizer(texts, 2000)
    tok.save(d + "/tokenizer.json")
    ours, _ = M.load_pretrained(d, verbose=False)
    hf = transformers.RobertaForMaskedLM.from_pretrained(d).to(dev)
    words = " ".join(texts).split()
    for i in range(32):  # 32 documents of ~4,000 words: every one long enough for A=2 anchors of 512 tokens
        Path(d, "docs").mkdir(exist_ok=True)
        Path(d, "docs", f"{i}.txt").write_text(" ".join(words[(i * 997) % 1000:][:4000]))
    corpus = S.prepare_corpus([Path(d, "docs")], tok, d + "/cache", quiet=True)
    ours.to(dev)

    # 1. bf16 parity on a padded batch of spans
    ids = torch.randint(3, 2000, (8, 384), device=dev)
    lengths = torch.randint(32, 385, (8,), device=dev)
    mask = (torch.arange(384, device=dev)[None] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 1)
    ours.eval()
    hf.eval()
    with torch.no_grad(), torch.autocast(dev.type, torch.bfloat16):
        a = M.mean_pool(ours(ids, mask).float(), mask)
        ref = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        b = M.mean_pool(ref.float(), mask)
    cos = torch.nn.functional.cosine_similarity(a, b).min().item()
    print(f"\n| bf16 autocast parity, distilroberta-base shape | lowest cosine of mean-pooled embeddings: {cos:.5f} |")

    # 2. a train step: N=16 documents, A=P=2, bf16, against the original way (padded, full-vocabulary MLM)
    cfg = T.TrainConfig(dtype="bf16")
    scfg = S.SamplerConfig(docs_per_step=DOCS, min_span=32, max_span=510)
    batch = S.SpanBatches(corpus, tok, scfg, 512, quiet=True)[0]
    gb = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}
    real = int(batch["anchor_lengths"].sum() + batch["positive_lengths"].sum())
    ours.train()
    hf.train()
    from train_step import original_step

    rows = []
    for name, fn in (("train.py", lambda: T.train_step(T.Chunks(ours), batch, cfg)),
                     ("transformers, padded (original)", lambda: original_step_bf16(original_step, hf, gb))):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sec = timed(fn, 3)
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
        rows.append((name, real / sec, peak))
        ours.zero_grad(set_to_none=True)
        hf.zero_grad(set_to_none=True)
    print(f"\n| train step, N={DOCS}, A=P=2, bf16 | real tokens/s | peak GB |\n|---|---|---|")
    for name, tps, gb_ in rows:
        print(f"| {name} | {tps:,.0f} | {gb_:.1f} |")
    print(f"ratio: {rows[0][1] / rows[1][1]:.2f}x tokens/s")

    # 3. embedding sentences/s against sentence-transformers on the same weights
    minilm = SHARED / "models/all-MiniLM-L6-v2"
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("\nembed: sentence-transformers not installed here, baseline skipped")
        return
    path = str(minilm) if minilm.exists() else d
    model, mtok = M.load_pretrained(path, verbose=False)
    model.to(dev).eval()
    st = SentenceTransformer(path, device=dev.type)
    texts = texts[:TEXTS]
    t_st = timed(lambda: st.encode(texts, batch_size=32), 3)
    t_ours = timed(lambda: E.encode(texts, model, mtok, dtype=torch.bfloat16 if dev.type == "cuda" else None), 3)
    t_ours32 = timed(lambda: E.encode(texts, model, mtok), 3)
    print(f"\n| embed {len(texts):,} sentences ({Path(path).name}) | sentences/s |\n|---|---|")
    print(f"| sentence-transformers encode, batch 32, fp32 | {len(texts) / t_st:,.0f} |")
    print(f"| embed.encode, fp32 | {len(texts) / t_ours32:,.0f} |")
    print(f"| embed.encode, bf16 | {len(texts) / t_ours:,.0f} |")


def original_step_bf16(step, hf, batch):
    with torch.autocast(dev.type, torch.bfloat16):
        step(hf, batch)


if __name__ == "__main__":
    main()
