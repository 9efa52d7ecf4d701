"""
Where embed.py's time goes on a CPU, against the processor's own limit: the first step of issue 55 (the plan follows
the profile). One process, as `python embed.py` runs: imports, model load, reading and tokenising, the forward
(with torch.profiler's time by op kind on one block), pooling, writing; then the matrix-multiply peak of this
machine at the model's shapes (2,048 rows, 2 threads, bf16 and fp32, best of 5 and of two kernels) and the share of
it the dense layers reach, counted on real tokens only, over the whole process. Last, the forward again with its dense
products made free (each returns rows of what it returned the first time): the time they leave, measured, and
what the whole process would reach on a processor whose products are faster (--matrix-peak, at the share of its peak
they reach here) and the rest as fast as here: a projection, not a measurement of that processor.

    python bench/embed_profile.py                       # all-MiniLM-L6-v2 on STS-B train x 4 (45,992 lines)
    python bench/embed_profile.py --lines 11498 --dtype fp32
    python bench/embed_profile.py --matrix-peak 3314     # the 2-core AMX Xeon's bf16 peak of issue 55 (the default)
    python3 bench/embed_profile.py --shared gpu-assets --threads 2 --lines 23000   # the lent GPU machine's processor
"""
import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

t_start = time.perf_counter()
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from _measure import dense_flops, peak, processor  # noqa: E402 (bench/_measure.py: embed_speed.py's too)

import embed as E  # noqa: E402
import model as M  # noqa: E402
from support import cpu_layers  # noqa: E402
from support.cli import UserError, bench, shared_assets  # noqa: E402
from support.device import device_and_dtype  # noqa: E402
from support.threads import default_threads  # noqa: E402

t_imports = time.perf_counter() - t_start
# The dense layers are oneDNN's packed products (support.cpu_layers.PackedLinear), addmm where they are not; attention
# is the fused kernel, or for short rows on a CPU (cpu_layers.short_rows) matmuls around a masked softmax; laying a
# weight out for oneDNN is a copy. The first kind whose words are in an op's name is its kind.
KINDS = {"attention": ("attention", "bmm", "matmul", "softmax", "masked_fill"),
         "copies and casts": ("copy_", "to", "_to_copy", "contiguous", "clone", "reorder", "pad"),
         "dense matmuls": ("addmm", "mm", "linear", "onednn", "mkldnn"),
         "layer norm": ("layer_norm",), "gelu": ("gelu",), "gather/scatter (packing)": ("index", "gather", "scatter")}


def products_free(tokenized, model, tok, dtype) -> float | None:
    """Seconds of the forward with every dense product free: each PackedLinear returns rows of what it returned the
    first time for its output width (a view, made once), so the rest runs on numbers of the sizes it meets. None
    where the layers do not run as PackedLinear (a torch without oneDNN)."""
    real, made = cpu_layers.PackedLinear.forward, {}

    def free(self, x):
        width, n = self.weight.size(0), max(4096, x.shape[0])
        if width not in made or len(made[width]) < x.shape[0]:
            made[width] = real(self, torch.cat([x] * -(-n // x.shape[0]))[:n])  # (n, width)
        return made[width][:x.shape[0]]

    cpu_layers.PackedLinear.forward = free
    try:
        E.embed_tokenized(tokenized, model, tok, dtype=dtype)  # every shape's kernels made first
        t = time.perf_counter()
        E.embed_tokenized(tokenized, model, tok, dtype=dtype)
        return time.perf_counter() - t if made else None
    finally:
        cpu_layers.PackedLinear.forward = real


def op_kinds(model, tok, texts, dtype) -> dict:
    """torch.profiler's CPU time by op kind, over one block of texts, on every thread (embed.py runs batches on
    several)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    tokenized = E.tokenize(texts, tok, E.max_seq_length(model))
    E.embed_tokenized(tokenized, model, tok, dtype=dtype)  # oneDNN's kernels made before the profile
    every_thread = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
        E.embed_tokenized(tokenized, model, tok, dtype=dtype)
    kinds, total = defaultdict(float), 0.0
    for ev in prof.key_averages():
        if not ev.key.startswith(("aten::", "mkldnn::")):
            continue
        total += ev.self_cpu_time_total
        name = ev.key.split("::", 1)[1]
        kind = next((k for k, words in KINDS.items() if any(w in name for w in words)), "other")
        kinds[kind] += ev.self_cpu_time_total
    return {k: v / total for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared", default=shared_assets(ROOT))
    ap.add_argument("--lines", type=int, default=45_992)
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--threads", type=int, default=0,
                    help="torch's CPU threads (default: as embed.py, the free cores this process may use)")
    ap.add_argument("--matrix-peak", type=float, default=3314.0,
                    help="GFLOP/s of the products on the processor projected to (default: issue 55's AMX Xeon, bf16)")
    a = ap.parse_args()
    shared = Path(a.shared)
    model_dir, stsb = shared / "models/all-MiniLM-L6-v2", shared / "data/sts/stsbenchmark/sts-train.csv"
    if not model_dir.exists() or not stsb.exists():
        raise UserError(f"{shared}: needs models/all-MiniLM-L6-v2 and sts-train.csv (--shared)")
    threads = a.threads or default_threads()
    torch.set_num_threads(threads)
    wall = {"imports (torch, numpy, the project)": t_imports}
    t = time.perf_counter()
    model, tok = M.load_pretrained(str(model_dir), quiet=True)
    device, dtype = device_and_dtype("cpu", a.dtype)
    flags = argparse.Namespace(dtype=a.dtype, onednn=True)
    model = cpu_layers.for_inference(model, device, dtype, flags)[0]  # as embed.py swaps
    wall["model load"] = time.perf_counter() - t
    t = time.perf_counter()
    rows = stsb.read_text(encoding="utf-8").splitlines()
    texts = ([s for r in rows for s in r.split("\t")[5:7]] * 4)[:a.lines]
    tokenized = E.tokenize(texts, tok, E.max_seq_length(model))
    wall["reading and tokenising"] = time.perf_counter() - t
    t = time.perf_counter()
    out = E.embed_tokenized(tokenized, model, tok, dtype=dtype)
    wall["forward and pooling"] = time.perf_counter() - t
    t = time.perf_counter()
    np.save(Path(os.environ.get("TMPDIR", "/tmp")) / f"embed_profile-{os.getpid()}.npy", out)
    os.remove(Path(os.environ.get("TMPDIR", "/tmp")) / f"embed_profile-{os.getpid()}.npy")
    wall["writing"] = time.perf_counter() - t
    whole = sum(wall.values())
    tokens = sum(len(p) for p in tokenized.pieces)
    achieved = tokens * dense_flops(model.config) / whole / 1e9
    peaks = {"fp32": peak(model.config, torch.float32, threads)}  # (best, median)
    if dtype == torch.bfloat16:  # where embed.py runs bf16, the processor multiplies it
        peaks["bf16"] = peak(model.config, torch.bfloat16, threads)
    kinds = op_kinds(model, tok, texts[:16384], dtype)
    name = str(dtype).removeprefix("torch.") if dtype else "float32"
    print(f"all-MiniLM-L6-v2, {len(texts):,} lines, {tokens:,} tokens ({tokens / len(texts):.1f} a line), dtype "
          f"{name}, {threads} threads, torch {torch.__version__}; {processor()}; AMX usable by torch: "
          f"{getattr(torch.cpu, '_is_amx_tile_supported', lambda: False)()}\n")
    print("| part of the process | seconds | share |\n|---|---|---|")
    for k, v in wall.items():
        print(f"| {k} | {v:.2f} | {100 * v / whole:.1f}% |")
    print(f"| whole | {whole:.2f} | {len(texts) / whole:,.0f} lines/s |\n")
    print("| op kind (forward, one block, torch.profiler self CPU time) | share |\n|---|---|")
    for k, v in kinds.items():
        print(f"| {k} | {100 * v:.1f}% |")
    best, typical = max(v[0] for v in peaks.values()), max(v[1] for v in peaks.values())
    print(f"\ndense layers over the whole process: {achieved:,.0f} GFLOP/s; the model's products here: "
          + ", ".join(f"{k} {v[0]:,.0f} GFLOP/s (median {v[1]:,.0f})" for k, v in peaks.items())
          + f" (2,048 rows, {threads} threads); **{100 * achieved / best:.0f}% of the best**, "
          f"{100 * achieved / typical:.0f}% of the median")
    # What a processor with faster matrix units (AMX) does not speed up: the whole less the dense layers' share
    outside = whole - wall["forward and pooling"] * kinds.get("dense matmuls", 0.0)
    print(f"outside the dense matmuls: {outside:.2f} s, {1000 * outside / len(texts):.3f} ms a line (by the profile)")
    free = products_free(tokenized, model, tok, dtype)
    if free is None:
        return print("the products could not be made free: this torch runs the layers without oneDNN")
    products = wall["forward and pooling"] - free  # the products' own time here
    share = tokens * dense_flops(model.config) / products / 1e9 / best  # of this processor's peak, in the forward
    elsewhere = whole - products + tokens * dense_flops(model.config) / (share * a.matrix_peak * 1e9)
    projected = tokens * dense_flops(model.config) / elsewhere / 1e9 / a.matrix_peak
    print(f"the forward with its products free: {free:.2f} s against {wall['forward and pooling']:.2f}; outside the "
          f"products {1000 * (whole - products) / len(texts):.3f} ms a line (measured); the products themselves run "
          f"at {100 * share:.0f}% of the peak. Projected, products at {a.matrix_peak:,.0f} GFLOP/s and that share, the "
          f"rest as here: {elsewhere:.2f} s, {100 * projected:.0f}% of that peak (a projection, not a measurement)")
    # A shared host's cores slow down and speed up (another tenant's work on the same core): the peak is the best of
    # short runs, the forward a long one. Where the products inside it ran far from the peak, or the peak's own runs
    # spread, the host's speed moved during the run, and the share is the host's as much as this code's
    if not 0.8 <= share <= 1.2 or best > 1.25 * typical:
        print(f"the host's speed moved during this run (products in the forward at {100 * share:.0f}% of the peak, the "
              f"peak's best {best / typical:.2f}x its median): run it again for a share to compare")


if __name__ == "__main__":
    main()
