"""
Two trees of this repository, the same bits: for a change that must move nothing in training (a rewrite for the
reader), what each tree's own scripts write, hashed; equal means bit-identical. embed.py's rows are compared by their
lowest cosine as well: a rewrite of the CPU's inference path may round differently (issue 55 changed its bytes, issue
68 again), so fp32 must stay within fp32's rounding (lowest cosine >= 0.999999 between the trees) and the default
dtype as near sentence-transformers' fp32 rows as before (its lowest cosine to them, each tree, where
sentence-transformers is installed).

  demo          python train.py: the demo's 600 steps (metrics.jsonl, every safetensors file of its run folder)
  torchrun      2 ranks (gloo), 20 steps of scratch:tiny with a checkpoint at 10
  resumed       that run's folder cut back to its checkpoint at 10, then --resume: the same 20 steps
  grad-cache    1 process, 20 steps, --grad-cache --chunk-tokens 64
  no-mlm        1 process, 20 steps, --no-mlm
  no-contrast   1 process, 20 steps, --no-contrastive
  embed-fp32    embed.py on the 11,498 STS-B train sentences with all-MiniLM-L6-v2, --dtype fp32
  embed-auto    the same, --dtype auto (bf16 on a CPU that has it)

metrics.jsonl is hashed without tokens_per_s, the one field that is a time. Every run fixes its CPU threads (a sum
split over other threads rounds differently). About 6 minutes a tree on 2 cores.

    git worktree add /tmp/old HEAD && python bench/same_bits.py /tmp/old .
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import UserError, bench, shared_assets  # noqa: E402

SMALL = ["--model", "scratch:tiny", "--docs-per-step", "8", "--min-span", "16", "--max-span", "64", "--workers", "0",
         "--log-every", "100", "--steps", "20", "--ckpt-every", "10", "--lr", "1e-3"]


def digest(folder: Path) -> str:
    """One hash of a run folder's metrics.jsonl (less tokens_per_s) and every safetensors file in it, or of an .npy."""
    h = hashlib.sha256()
    if folder.suffix == ".npy":
        h.update(folder.read_bytes())
        return h.hexdigest()[:16]
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec.pop("tokens_per_s", None)
        h.update(json.dumps(rec, sort_keys=True).encode())
    for f in sorted(folder.rglob("*.safetensors")):
        h.update(str(f.relative_to(folder)).encode() + f.read_bytes())
    return h.hexdigest()[:16]


def one_tree(tree: Path, work: Path, docs: Path, sentences: Path, minilm: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    python = [sys.executable]

    def run(*args, threads: str = "2"):
        done = subprocess.run([*args, *(["--threads", threads] if threads else [])], cwd=tree, env=env,
                              capture_output=True, text=True)
        if done.returncode:
            tail = [line for line in done.stderr.splitlines() if line.startswith("error:")] or done.stderr.splitlines()
            raise UserError(f"{tree}: {' '.join(args[1:3])} ... exited {done.returncode}: {tail[-1] if tail else ''}")

    common = [*SMALL, "--data", str(docs), "--cache-dir", str(work / "cache")]
    out = {}
    run(*python, "train.py", "--out", str(work / "demo"))
    out["demo"] = digest(work / "demo")
    run(*python, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", "29577", "train.py",
        *common, "--out", str(work / "torchrun"), threads="1")
    out["torchrun"] = digest(work / "torchrun")
    shutil.copytree(work / "torchrun", work / "resumed")
    for later in ("checkpoints/step-00000020", "model"):
        shutil.rmtree(work / "resumed" / later)
    run(*python, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", "29578", "train.py",
        "--out", str(work / "resumed"), "--resume", threads="")
    out["resumed"] = digest(work / "resumed")
    for name, extra in {"grad-cache": ["--grad-cache", "--chunk-tokens", "64"], "no-mlm": ["--no-mlm"],
                        "no-contrast": ["--no-contrastive"]}.items():
        run(*python, "train.py", *common, *extra, "--out", str(work / name))
        out[name] = digest(work / name)
    for dtype in ("fp32", "auto"):
        npy = work / f"embed-{dtype}.npy"
        run(*python, "embed.py", "--model", str(minilm), str(sentences), "--output", str(npy), "--dtype", dtype)
        out[f"embed-{dtype}"] = digest(npy)
    return out


def lowest_cosine(a, b) -> float:
    import numpy as np

    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def rows_compared(works: list[Path], minilm: Path, sentences: Path) -> list[str]:
    """embed.py's rows of the two trees: fp32 against each other, the default dtype against sentence-transformers'
    fp32 rows (or each other, without it). Returns the failures."""
    import numpy as np

    rows = {k: [np.load(w / f"embed-{k}.npy") for w in works] for k in ("fp32", "auto")}
    fp32 = lowest_cosine(*rows["fp32"])
    print(f"\nembed-fp32: lowest cosine between the trees' rows {fp32:.7f} (fp32's rounding: >= 0.999999)")
    failed = [] if fp32 >= 0.999999 else [f"embed-fp32's rows differ beyond fp32's rounding ({fp32:.7f})"]
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print(f"embed-auto: lowest cosine between the trees' rows {lowest_cosine(*rows['auto']):.6f} "
              "(sentence-transformers is not installed: no reference)")
        return failed
    texts = sentences.read_text(encoding="utf-8").splitlines()
    ref = SentenceTransformer(str(minilm), device="cpu").encode(texts)
    before, after = (lowest_cosine(r, ref) for r in rows["auto"])
    print(f"embed-auto: lowest cosine to sentence-transformers' fp32 rows {before:.6f} before, {after:.6f} after")
    return failed + ([f"embed-auto's rows are further from sentence-transformers' ({after:.6f} < {before:.6f})"]
                     if after < min(before, 0.9999) else [])


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs=2, help="two trees of this repository: before and after")
    ap.add_argument("--shared", default=shared_assets(ROOT))
    a = ap.parse_args()
    shared = Path(a.shared)
    minilm, stsb = shared / "models/all-MiniLM-L6-v2", shared / "data/sts/stsbenchmark/sts-train.csv"
    books = sorted((shared / "data/corpus/gutenberg").glob("*.txt"))[:24]  # a book is a document: 16 a step
    if not (minilm.exists() and stsb.exists() and len(books) == 24):
        raise UserError(f"{shared}: needs all-MiniLM-L6-v2, sts-train.csv and 24 Gutenberg books (--shared)")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "docs").mkdir()
        for b in books:
            shutil.copy(b, tmp / "docs" / b.name)
        sentences = tmp / "sts-train.txt"
        rows = [line.split("\t") for line in stsb.read_text(encoding="utf-8").splitlines()]
        sentences.write_text("".join(f"{r[5]}\n{r[6]}\n" for r in rows), encoding="utf-8")
        for k, tree in enumerate(a.trees):
            results[tree] = one_tree(Path(tree).resolve(), tmp / f"tree{k}", tmp / "docs", sentences, minilm)
        first, second = (results[t] for t in a.trees)
        print(f"| what | {' | '.join(a.trees)} | |\n|---|---|---|---|")
        for key in first:
            print(f"| {key} | {first[key]} | {second[key]} | {'equal' if first[key] == second[key] else 'DIFFERENT'} |")
        failed = rows_compared([tmp / "tree0", tmp / "tree1"], minilm, sentences)
    training = [k for k in first if not k.startswith("embed") and first[k] != second[k]]
    if training:
        failed.insert(0, f"{len(training)} training run(s) differ: {', '.join(training)}")
    if failed:
        raise UserError("; ".join(failed))
    print(f"\nevery training run bit-identical ({len(first) - 2}); embed.py's rows as near as they must be")


if __name__ == "__main__":
    main()
