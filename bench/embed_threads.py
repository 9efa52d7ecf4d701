"""
bench/embed_threads.py: embed.py's sentences/s with --threads 0 (the default: the cores less one) against all the
cores (torch's own default, what embed.py used before it had the flag), alone and beside one busy process.

On a small machine, torch's threads spin at every barrier; beside another process that holds a core they wait
for it, and a run that took seconds takes minutes. The runs alternate, `--repeats` each, so that both settings
see the same machine.

    python bench/embed_threads.py --model runs/demo/model                  # texts: 50,000 STS-B train sentences
    python bench/embed_threads.py --model M --texts lines.txt --repeats 3
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sentences(shared: Path, n: int, out: Path) -> Path:
    rows = (shared / "data/sts/stsbenchmark/sts-train.csv").read_text(encoding="utf-8").splitlines()
    texts = [s for r in rows for s in r.split("\t")[5:7]]
    out.write_text("\n".join((texts * (n // len(texts) + 1))[:n]) + "\n", encoding="utf-8")
    return out


def embed_seconds(model: str, texts: Path, threads: int, out: Path) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "embed.py"), "--model", model, str(texts), "--output", str(out),
                    "--overwrite", "--threads", str(threads)], check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--texts", default="", help="a file of texts, one a line (default: 50,000 STS-B sentences)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as d:
        shared = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))
        texts = Path(a.texts) if a.texts else sentences(shared, 50_000, Path(d) / "texts.txt")
        n = sum(1 for _ in open(texts, encoding="utf-8"))
        default = max(1, cores - 1)
        print(f"| {n:,} texts, {cores} cores | --threads 0 (default: {default}) | --threads {cores} | ratio |")
        print("|---|---|---|---|")
        for beside in (False, True):
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if beside else None
            try:
                runs = {0: [], cores: []}
                for _ in range(a.repeats):
                    for threads in runs:
                        runs[threads].append(n / embed_seconds(a.model, texts, threads, Path(d) / "e.npy"))
            finally:
                if busy:
                    busy.kill()
            ours, all_cores = (statistics.median(runs[t]) for t in runs)
            spread = " / ".join(f"{min(r):,.0f}-{max(r):,.0f}" for r in runs.values())
            print(f"| {'beside one busy process' if beside else 'alone'} | {ours:,.0f} | {all_cores:,.0f} | "
                  f"{ours / all_cores:.2f}× (sentences/s, median of {a.repeats}; range {spread}) |")


if __name__ == "__main__":
    main()
