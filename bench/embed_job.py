"""
embed.py as a job (support/embed_job.py), side by side in one run on the same lines and model:

1. one process against two (torchrun --nproc_per_node=2), one CPU thread each: texts/s of the job (from its last
   line) and of the whole command (start and model load included), and whether the two outputs are the same bytes;
2. what keeping each block costs at one process: embed.py's job (rows written in place, flushed, recorded) against
   today's write path written out here (the blocks' rows appended to one open file, nothing flushed or recorded),
   both in this process, alternating, --repeats times, at the default --block and at a small one;
3. a job killed (SIGTERM) at half its rows, then --resume: the rows kept and the time lost against one uninterrupted
   job; an all-or-nothing write would keep none and lose all the time before the kill.

    python bench/embed_job.py                       # all-MiniLM-L6-v2 from ../shared (else a tiny random encoder)
    python bench/embed_job.py --lines 8000 --repeats 5

Lines: STS-B train's sentences where ../shared has them, else random words. With all-MiniLM-L6-v2 and 3,000 lines it
takes about 5 minutes on 2 AMD EPYC Zen 3 cores (AVX2, fp32), 2 minutes on 2 Zen 4 cores (AVX512-BF16, bf16).
"""
import argparse
import contextlib
import io
import os
import signal
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
from support import cpu_layers, demo, embed_job, embedding  # noqa: E402
from support.cli import bench  # noqa: E402
from support.device import device_and_dtype, device_name  # noqa: E402
from support.sts_files import read_stsb  # noqa: E402

SHARED = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))


def inputs(folder: Path, lines: int) -> tuple[Path, Path]:
    """(the texts, the model): STS-B train's sentences and all-MiniLM-L6-v2 where ../shared has them."""
    stsb, minilm = SHARED / "data/sts/stsbenchmark/sts-train.csv", SHARED / "models/all-MiniLM-L6-v2"
    if stsb.exists():
        a, b, _ = read_stsb(stsb)
        texts = [s for pair in zip(a, b, strict=True) for s in pair]
    else:
        rng = np.random.default_rng(0)
        words = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing".split()
        texts = [" ".join(rng.choice(words, rng.integers(3, 40))) for _ in range(lines)]
    (folder / "in.txt").write_text("\n".join((texts * (lines // len(texts) + 1))[:lines]) + "\n")
    if not minilm.exists():
        minilm = folder / "tiny"
        M.save_pretrained(*demo.from_scratch(M.scratch_encoder, "tiny", texts[:500]), minilm)
    return folder / "in.txt", minilm


def command(ranks: int, *args) -> list[str]:
    if ranks == 1:
        return [sys.executable, str(ROOT / "embed.py"), *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", str(ROOT / "embed.py"),
            *map(str, args)]


def job_rate(stderr: str) -> float:
    """texts/s from the job's last line: `embedding: wrote out.npy: N x H (12.3s, 81 texts/s...)`."""
    last = [s for s in stderr.splitlines() if s.startswith("embedding: wrote")][-1]
    return float(last.split("s, ")[1].split(" texts/s")[0].replace(",", ""))


def processes(text: Path, model: Path, folder: Path, block: int):
    print("1. one process against two, one thread each (texts/s: the job's own, and the whole command's)")
    outs = {}
    for ranks in (1, 2):
        outs[ranks] = folder / f"ranks{ranks}.npy"
        t0 = time.perf_counter()
        r = subprocess.run(command(ranks, "--model", model, text, "--output", outs[ranks], "--threads", 1, "--block",
                                   block), capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - t0
        assert r.returncode == 0, r.stderr[-2000:]
        rows = len(np.load(outs[ranks], mmap_mode="r"))
        print(f"   {ranks} process(es): {job_rate(r.stderr):8,.0f} texts/s in the job, {rows / wall:8,.0f} texts/s "
              f"for the whole command ({wall:.1f} s)")
    print(f"   the same bytes: {outs[1].read_bytes() == outs[2].read_bytes()}")


def today(text: Path, out: Path, model_dir: Path, block: int):
    """embed.py before the job (c166367, support/embedding.write_rows): the model loaded, the rows counted, the npy
    header, then each block's rows appended in order, nothing flushed or recorded."""
    model, tok = M.load_pretrained(str(model_dir), quiet=True)
    cpu_layers.short_rows(model)  # short rows' attention written out, as embed.py ran it then and runs it now
    dtype = device_and_dtype("cpu", "auto")[1]  # as the job's --dtype auto: bf16 on a CPU with AVX512-BF16 or AMX
    n = embedding.count_rows([str(text)], {})[0]
    with open(out, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                                 "shape": (n, model.config.hidden_size)})
        for _, texts in embedding.blocks([str(text)], {}, block):
            tokenized = E.tokenize(texts, tok, E.max_seq_length(model), "truncate")
            f.write(E.embed_tokenized(tokenized, model, tok, dtype=dtype).astype("<f4").tobytes())


def timed(spent: list, method):
    """The job's method, its seconds added to `spent`."""
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return method(*a, **k)
        finally:
            spent.append(time.perf_counter() - t0)
    return wrapper


def keeping(text: Path, model_dir: Path, folder: Path, repeats: int, blocks: list[int]):
    print(f"2. keeping each block, at one process: the job against today's write path, {repeats} alternating "
          f"repeats, in this process (2 threads); and the job's own work (its set-up but the rows' count, which both "
          f"do; its writes, flushes, records and end) as a share of the job's time, which the noise of shared cores "
          f"moves little")
    torch.set_num_threads(2)
    spent, counted, job = [], [], embed_job.Job
    for name in ("_prepare", "write", "finish"):
        setattr(job, name, timed(spent, getattr(job, name)))
    embedding.count_rows = timed(counted, embedding.count_rows)  # inside _prepare: today's counts them too
    for block in blocks:
        times, shares = {"today": [], "job": []}, []
        for r in range(repeats + 1):  # the first round warms both up, and is not counted
            for arm in ("today", "job"):
                out = folder / f"{arm}.npy"
                out.unlink(missing_ok=True)
                t0 = time.perf_counter()
                spent.clear(), counted.clear()
                if arm == "today":
                    today(text, out, model_dir, block)
                else:
                    with contextlib.redirect_stderr(io.StringIO()):  # its progress lines
                        E.main(["--model", str(model_dir), str(text), "--output", str(out), "--block", str(block),
                                "--threads", "2"])
                times[arm].append(time.perf_counter() - t0)
                if arm == "job":
                    shares.append((sum(spent) - sum(counted)) / times[arm][-1])
                if r == 0:
                    times[arm].pop(), shares.clear()
        same = (folder / "today.npy").read_bytes() == (folder / "job.npy").read_bytes()
        ratios = [j / t for j, t in zip(times["job"], times["today"], strict=True)]
        print(f"   --block {block:6,}: today {statistics.median(times['today']):6.2f} s, job "
              f"{statistics.median(times['job']):6.2f} s; job/today median {statistics.median(ratios):.3f} (spread "
              f"{min(ratios):.3f}-{max(ratios):.3f}); the job's own work {statistics.median(shares):.2%} of its time "
              f"({min(shares):.2%}-{max(shares):.2%}); the same bytes: {same}")


def killed(text: Path, model: Path, folder: Path, block: int):
    print("3. killed (SIGTERM) at half its rows, then --resume, against one uninterrupted job (one process, 2 threads)")
    out, rows = folder / "killed.npy", embedding.count_rows([str(text)], {})[0]
    args = ["--model", model, text, "--output", out, "--block", block, "--threads", 2]
    t0 = time.perf_counter()
    subprocess.run(command(1, *args[:4], folder / "whole.npy", *args[5:]), check=True, capture_output=True)
    whole = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = subprocess.Popen(command(1, *args), stderr=subprocess.PIPE, text=True)
    folder_ = embed_job.job_folder(out)
    blocks = -(-rows // block)
    while not folder_.is_dir() or len(embed_job.recorded(folder_, blocks, True)) * block < rows / 2:
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    line = p.communicate()[1].strip().splitlines()[-1]
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(command(1, *args, "--resume"), check=True, capture_output=True)
    resumed = time.perf_counter() - t0
    print(f"   stopped: {line}")
    print(f"   uninterrupted {whole:.1f} s; killed at {first:.1f} s, then --resume {resumed:.1f} s: lost "
          f"{first + resumed - whole:.1f} s ({(first + resumed - whole) / whole:.0%} of the job); the same bytes: "
          f"{out.read_bytes() == (folder / 'whole.npy').read_bytes()}")
    print(f"   all or nothing (the write before the job): 0 rows kept, {first:.1f} s lost")


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"processor: {device_name(torch.device('cpu'))}; torch {torch.__version__}; --dtype auto: "
          f"{device_and_dtype('cpu', 'auto')[1] or 'fp32'}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        text, model = inputs(folder, args.lines)
        print(f"{args.lines:,} lines of {text.name}, model {model.name}")
        block = max(1, args.lines // 8)  # 8 blocks: enough to share out, and a kill at half keeps 4
        processes(text, model, folder, block)
        keeping(text, model, folder, args.repeats, [16384, max(1, args.lines // 16)])
        killed(text, model, folder, block)


if __name__ == "__main__":
    main()
