"""
embed.py against sentence-transformers on a CPU, side by side in one run: each arm one whole process (start, model
load, tokenising, embedding, writing the rows) on the same lines, the arms alternating, median of --repeats. Per arm:
sentences/s, the share of the processor's matrix-multiply peak its dense layers reach over the whole process (real
tokens only; the peak measured in the same run, bench/embed_profile.py's), peak memory, the lowest cosine of its rows
to sentence-transformers' fp32 rows, and the STS-B dev score of its embeddings; then embed.py's default beside one
busy process against alone; and each arm's whole process on a file of 2 lines, what a user waits before the first
row (imports, the model's load), so that a cost added there shows. Names the processor it ran on.

    python bench/embed_speed.py --backends-python ~/venvs/backends/bin/python    # every arm, about 45 min on 2 cores
    python bench/embed_speed.py --lines 11498 --repeats 1                         # quicker
    python bench/embed_speed.py --memory 1000000    # peak memory: 100,000 and 1,000,000 lines, 1,888 books
    python bench/embed_speed.py --lines 1000000 --repeats 2 --arms "embed.py, default" "embed.py --dtype fp32"

Arms: embed.py by default (--dtype auto: bf16 on a CPU with AMX or AVX512-BF16, else fp32; --threads: the cores free
at its start), in fp32, in bf16 where the CPU multiplies it; sentence-transformers' encode with its defaults (batch
32, fp32), with bf16 weights, and, with --backends-python (a virtual environment made from
bench/requirements-backends.txt), its ONNX backend in fp32 and its int8 model dynamically quantised for this
processor's instruction set, and OpenVINO where it installs (--arms: those named alone). The lines: STS-B train's
sentences, both of each pair, over and over (four times: 45,992 lines, as a file of duplicates would be).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _measure import measured, processor  # noqa: E402 (bench/_measure.py: what the other embedding benchmarks use)

from evaluate_sts import spearman  # noqa: E402
from support import demo  # noqa: E402
from support.cli import UserError, bench, shared_assets  # noqa: E402
from support.sts_files import read_stsb  # noqa: E402


def arms(a, model: Path, exported: Path | None, has_bf16: bool) -> dict[str, callable]:
    """name -> (input, output) -> the command."""
    ours = [sys.executable, str(ROOT / "embed.py"), "--model", str(model)]
    st = str(ROOT / "bench" / "st_encode.py")
    out = {"embed.py, default": lambda i, o: [*ours, i, "--output", o, "--overwrite"],
           "embed.py --dtype fp32": lambda i, o: [*ours, i, "--output", o, "--overwrite", "--dtype", "fp32"]}
    if has_bf16:
        out["embed.py --dtype bf16"] = lambda i, o: [*ours, i, "--output", o, "--overwrite", "--dtype", "bf16"]
    out["sentence-transformers, default (fp32)"] = lambda i, o: [a.st_python, st, "encode", model, i, o]
    out["sentence-transformers, bf16"] = lambda i, o: [a.st_python, st, "encode", model, i, o, "--bf16"]
    if exported:
        back = [a.backends_python, st, "encode", exported]
        out["sentence-transformers, ONNX fp32"] = lambda i, o: [*back, i, o, "--backend", "onnx"]
        out["sentence-transformers, ONNX int8"] = lambda i, o: [*back, i, o, "--backend", "onnx", "--int8"]
        if (exported / "openvino").exists():
            out["sentence-transformers, OpenVINO"] = lambda i, o: [*back, i, o, "--backend", "openvino"]
    return out


def side_by_side(a, d: Path):
    import torch

    from support.device import cpu_has_bf16

    shared, has_bf16 = Path(a.shared), cpu_has_bf16()
    model = shared / "models" / "all-MiniLM-L6-v2"
    rows = (shared / "data/sts/stsbenchmark/sts-train.csv").read_text(encoding="utf-8").splitlines()
    train = [s for r in rows for s in r.split("\t")[5:7]]
    lines = d / "lines.txt"
    lines.write_text("\n".join((train * -(-a.lines // len(train)))[:a.lines]) + "\n", encoding="utf-8")
    n = a.lines
    s1, s2, gold = read_stsb(shared / "data/sts/stsbenchmark/sts-dev.csv")
    dev = d / "dev.txt"
    dev.write_text("\n".join(s1 + s2) + "\n", encoding="utf-8")
    exported = None
    if a.backends_python:  # the ONNX and OpenVINO models, made once, offline, in a copy of the model
        exported = d / "exported"
        shutil.copytree(model, exported)
        subprocess.run([a.backends_python, str(ROOT / "bench" / "st_encode.py"), "prepare", str(exported)], check=True)
    every = arms(a, model, exported, has_bf16)
    runs = {k: v for k, v in every.items() if k in a.arms or not a.arms}
    if not runs:
        raise UserError(f"--arms {' '.join(a.arms)}: none of this processor's arms ({', '.join(every)})")
    work, best, typical = work_and_peak(model, lines, has_bf16)
    print(f"{processor()}; torch {torch.__version__}; {n:,} lines (STS-B train's sentences); whole process each, "
          f"median of {a.repeats} alternating runs; the model's products here: {best:,.0f} GFLOP/s at best, "
          f"{typical:,.0f} the median of their rounds\n", flush=True)
    seconds, peak, rows = {k: [] for k in runs}, {}, {k: d / f"arm{i}.npy" for i, k in enumerate(runs)}
    for _ in range(a.repeats):
        for name, cmd in runs.items():
            s, mb = measured(cmd(lines, rows[name]))
            seconds[name].append(s)
            peak[name] = max(peak.get(name, 0), mb)
            print(f"  {name}: {n / s:,.0f} sentences/s", flush=True)
    # Quality: the last run's rows against sentence-transformers' fp32 rows, and the STS-B dev score
    st = "sentence-transformers, default (fp32)"
    ref = np.load(rows[st]) if st in runs else None
    table = []
    for name, cmd in runs.items():
        e = np.load(rows[name])
        cos = None if ref is None else (e * ref).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(ref, axis=1)
        subprocess.run(cmd(dev, d / "dev.npy"), check=True, capture_output=True)
        v = np.load(d / "dev.npy")
        pairs = (v[:len(s1)] * v[len(s1):]).sum(1) / np.linalg.norm(v[:len(s1)], axis=1) / np.linalg.norm(
            v[len(s1):], axis=1)
        rate = n / statistics.median(seconds[name])
        spread = f"{n / max(seconds[name]):,.0f}–{n / min(seconds[name]):,.0f}"
        share = work / statistics.median(seconds[name]) / 1e9 / best  # of the best: on a host whose products run at
        # two speeds (a shared AMX Xeon, docs/measurements.md) the share of their median says what the run met
        table.append(dict(arm=name, sentences_per_s=round(rate), range=spread, seconds=statistics.median(seconds[name]),
                          ratio=None if ref is None else round(rate / (n / statistics.median(seconds[st])), 2),
                          of_peak=round(share, 3), of_median_peak=round(share * best / typical, 3),
                          lowest_cosine=None if cos is None else float(cos.min()),
                          stsb_dev=round(100 * spearman(pairs, gold), 2), peak_mb=round(peak[name])))
    print("\n| arm | seconds | sentences/s (range) | × sentence-transformers' default | of the matmul peak, best "
          "(median) | lowest cosine to its fp32 rows | STS-B dev | peak MB |\n|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['arm']} | {r['seconds']:.1f} | {r['sentences_per_s']:,} ({r['range']}) | "
              f"{'–' if r['ratio'] is None else format(r['ratio'], '.2f')} | "
              f"{100 * r['of_peak']:.0f}% ({100 * r['of_median_peak']:.0f}%) | "
              f"{'–' if r['lowest_cosine'] is None else format(r['lowest_cosine'], '.6f')} | "
              f"{r['stsb_dev']:.2f} | {r['peak_mb']:,} |")
    return n, lines, runs, table


def work_and_peak(model: Path, lines: Path, has_bf16: bool) -> tuple[float, float, float]:
    """(FLOP, GFLOP/s, GFLOP/s): the dense layers' arithmetic on the lines' real tokens (padding, which some arms
    compute, is not useful work), and the model's own products on this processor's threads, the best of fp32 and,
    where the processor multiplies it, bf16: their best round, and the median of their rounds."""
    import torch
    from _measure import dense_flops, peak

    import embed as E
    import model as M

    config, tok = M.load_config_and_tokenizer(str(model))
    texts = lines.read_text(encoding="utf-8").splitlines()
    work = dense_flops(config) * sum(len(p) for p in E.tokenize(texts, tok, config.max_tokens).pieces)
    dtypes = [torch.float32] + ([torch.bfloat16] if has_bf16 else [])
    peaks = [peak(config, dtype, torch.get_num_threads()) for dtype in dtypes]  # (best, median) each
    return work, max(p[0] for p in peaks), max(p[1] for p in peaks)


def beside_busy(a, n: int, lines: Path, runs: dict, d: Path) -> list:
    """embed.py's default (threads: the free cores) and torch's own (all the cores), alone and beside one busy
    process, alternating."""
    cores = len(os.sched_getaffinity(0))
    ours = runs["embed.py, default"]
    cases = {"default, alone": (ours, False), "default, beside one busy process": (ours, True),
             f"--threads {cores} (torch's own), beside one busy process": (
                 lambda i, o: [*ours(i, o), "--threads", str(cores)], True)}
    rates = {k: [] for k in cases}
    for _ in range(a.repeats):
        for name, (cmd, busy) in cases.items():
            rates[name].append(n / measured(cmd(lines, d / "busy.npy"), busy)[0])
    alone = statistics.median(rates["default, alone"])
    print("\n| embed.py | sentences/s (range) | of the default alone |\n|---|---|---|")
    out = []
    for name, r in rates.items():
        med = statistics.median(r)
        out.append(dict(case=name, sentences_per_s=round(med), of_alone=round(med / alone, 2)))
        print(f"| {name} | {med:,.0f} ({min(r):,.0f}–{max(r):,.0f}) | {med / alone:.2f} |")
    return out


def start_up(a, runs: dict, d: Path) -> list:
    """Each arm's whole process on a file of 2 lines, the arms alternating, median of --repeats: the start-up a user
    waits for before the first row (imports, the model's load), where a cost that every run pays shows."""
    two = d / "two.txt"
    two.write_text("A man is playing a guitar.\nA woman is singing.\n", encoding="utf-8")
    seconds = {k: [] for k in runs}
    for _ in range(a.repeats):
        for name, cmd in runs.items():
            seconds[name].append(measured(cmd(two, d / "two.npy"))[0])
    print("\n| a file of 2 lines | seconds, whole process (range) |\n|---|---|")
    out = []
    for name, s in seconds.items():
        out.append(dict(arm=name, seconds=round(statistics.median(s), 2)))
        print(f"| {name} | {statistics.median(s):.2f} ({min(s):.2f}–{max(s):.2f}) |")
    return out


def memory(a, d: Path):
    """Peak memory of embed.py over 100,000 and --memory lines: a tiny scratch model (quick enough for a million
    lines on a CPU); the point is what grows."""
    import model as M

    rows = (Path(a.shared) / "data/sts/stsbenchmark/sts-dev.csv").read_text(encoding="utf-8").splitlines()
    texts = [s for r in rows for s in r.split("\t")[5:7]]
    m, t = demo.from_scratch(M.scratch_encoder, "tiny", texts * 3)
    M.save_pretrained(m, t, d / "tiny")
    print("| input | seconds | peak resident MB (embed.py process) | output |\n|---|---|---|---|")
    for n in (100_000, a.memory):
        src = d / f"lines-{n}.txt"
        with open(src, "w") as f:
            for i in range(n):
                f.write(texts[i % len(texts)] + "\n")
        sec, mb = measured([sys.executable, ROOT / "embed.py", "--model", d / "tiny", src, "--output", d / "out.npy",
                            "--overwrite"])
        shape = np.load(d / "out.npy", mmap_mode="r").shape
        print(f"| {n:,} lines | {sec:.0f} | {mb:,.0f} | {shape[0]:,} x {shape[1]} float32, "
              f"{shape[0] * shape[1] * 4 / 2**20:,.0f} MB on disk |")
    long_rows(a, d)


def long_rows(a, d: Path, rows: int = 1888):
    """Peak memory of embed.py (all-MiniLM-L6-v2, its defaults: truncated at 256 tokens) on a Parquet file of long
    rows: the Gutenberg books over and over, `rows` of them (about 513M characters), as a dataset of books is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    books = [p.read_text(encoding="utf-8", errors="replace")
             for p in sorted((Path(a.shared) / "data/corpus/gutenberg").glob("*.txt"))]
    src = d / "books.parquet"
    pq.write_table(pa.table({"text": (books * -(-rows // len(books)))[:rows]}), src, row_group_size=64)
    sec, mb = measured([sys.executable, ROOT / "embed.py", "--model", Path(a.shared) / "models/all-MiniLM-L6-v2", src,
                        "--output", d / "books.npy", "--overwrite"])
    chars = sum(len(t) for t in (books * -(-rows // len(books)))[:rows])
    print(f"| {rows:,} books in one .parquet ({chars / 1e6:,.0f}M characters), all-MiniLM-L6-v2 | {sec:.0f} | "
          f"{mb:,.0f} | {rows:,} x 384 float32 |")


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lines", type=int, default=45_992)
    ap.add_argument("--st-python", default=sys.executable, help="Python with sentence-transformers (its torch arms)")
    ap.add_argument("--backends-python", default="", help="Python of bench/requirements-backends.txt (ONNX, OpenVINO)")
    ap.add_argument("--json", default="", help="also write the tables here")
    ap.add_argument("--memory", type=int, default=0, help="instead: peak memory over 100,000 and this many lines, and "
                    "over a Parquet file of 1,888 books")
    ap.add_argument("--arms", nargs="+", default=[], help="only these arms, by name (default: every one; without "
                    "sentence-transformers' default, no ratio to it and no cosine to its rows)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        if a.memory:
            return memory(a, d)
        n, lines, runs, table = side_by_side(a, d)
        busy = beside_busy(a, n, lines, runs, d) if "embed.py, default" in runs and not a.arms else []
        start = start_up(a, runs, d)
    if a.json:
        Path(a.json).write_text(json.dumps({"processor": processor(), "arms": table, "busy": busy,
                                            "start_up": start}, indent=2) + "\n")


if __name__ == "__main__":
    main()
