"""
embed.py's speed against sentence-transformers' encode (batch 32, its defaults) on the same model and texts, and
its peak memory on inputs of 100,000 and 1,000,000 lines.

    python bench/embed_speed.py                        # MiniLM on the 3,000 STS-B dev sentences, CPU
    python bench/embed_speed.py --lines 1000000 --shared /path/to/shared
"""
import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import embed as E  # noqa: E402
import model as M  # noqa: E402


def peak_rss_mb(cmd) -> tuple[float, float]:
    """(seconds, peak resident MB) of one command, from the kernel's accounting in a fresh parent of its own."""
    probe = "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, capture_output=True); " \
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    t = time.perf_counter()
    kb = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - t, int(kb) / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=str(ROOT.parent / "shared"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lines", type=int, default=1_000_000)
    a = ap.parse_args()
    from sentence_transformers import SentenceTransformer
    shared = Path(a.shared)
    minilm = shared / "models/all-MiniLM-L6-v2"
    rows = (shared / "data/sts/stsbenchmark/sts-dev.csv").read_text(encoding="utf-8").splitlines()
    texts = [s for r in rows for s in r.split("\t")[5:7]]  # 3,000 sentences, duplicates kept
    st = SentenceTransformer(str(minilm), device="cpu")
    model, tok = M.load_pretrained(str(minilm), quiet=True)
    E.encode(texts[:64], model, tok)  # warm-up
    st.encode(texts[:64])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; all-MiniLM-L6-v2, {len(texts):,} STS-B dev "
          f"sentences, fp32 CPU, median of {a.repeats} alternating runs\n")
    print("| encoder | sentences/s | ratio to sentence-transformers |")
    print("|---|---|---|")
    ts, ours = [], {b: [] for b in (1024, 2048, 4096, 8192)}
    for _ in range(a.repeats):
        t = time.perf_counter()
        ref = st.encode(texts, batch_size=32)
        ts.append(time.perf_counter() - t)
        for b in ours:
            t = time.perf_counter()
            emb = E.encode(texts, model, tok, batch_tokens=b)
            ours[b].append(time.perf_counter() - t)
    base = len(texts) / statistics.median(ts)
    print(f"| sentence-transformers encode, batch 32 | {base:,.0f} | 1.00 |")
    for b, t in ours.items():
        rate = len(texts) / statistics.median(t)
        default = " (default)" if b == 2048 else ""
        print(f"| embed.encode, batches of {b:,} tokens{default} | {rate:,.0f} | {rate / base:.2f} |")
    cos = (emb * ref).sum(1) / np.linalg.norm(emb, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"\nlowest cosine between the two, over all rows: {cos.min():.7f}")

    # Peak memory: a tiny scratch model (fast enough for a million lines on a CPU); the point is what grows.
    with tempfile.TemporaryDirectory() as d:
        m, t = M.from_scratch("tiny", texts * 3)
        M.save_pretrained(m, t, d + "/tiny")
        print("\n| input | seconds | peak resident MB (embed.py process) | output |")
        print("|---|---|---|---|")
        for n in (100_000, a.lines):
            src = Path(d) / f"lines-{n}.txt"
            with open(src, "w") as f:
                for i in range(n):
                    f.write(texts[i % len(texts)] + "\n")
            sec, mb = peak_rss_mb([sys.executable, str(ROOT / "embed.py"), "--model", d + "/tiny", str(src),
                                   "--output", d + f"/out-{n}.npy"])
            shape = np.load(d + f"/out-{n}.npy", mmap_mode="r").shape
            print(f"| {n:,} lines | {sec:.0f} | {mb:,.0f} | {shape[0]:,} x {shape[1]} float32, "
                  f"{shape[0] * shape[1] * 4 / 2**20:,.0f} MB on disk |")
            (Path(d) / f"out-{n}.npy").unlink()


if __name__ == "__main__":
    main()
