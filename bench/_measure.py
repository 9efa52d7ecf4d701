"""
bench/_measure.py: how the embedding benchmarks measure (bench/embed_speed.py, bench/embed_profile.py,
bench/modernbert.py), not a script, so that no script imports another: the processor's name and units, a whole
command's seconds and peak memory, the dense layers' arithmetic per token, and the products' peak.
"""
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


def processor() -> str:
    """The CPU as /proc/cpuinfo names it (family and model where the name is only "AMD EPYC"), the cores this process
    may use, and its units for bf16 and int8 products."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "?")
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']} model {fields.get('model', '?')})"
    flags = set(info.split())
    units = [f for f in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx2") if f in flags]
    return f"{name}, {len(os.sched_getaffinity(0))} cores ({', '.join(units)})"


def measured(cmd, busy: bool = False) -> tuple[float, float]:
    """(seconds, peak resident MB) of one command, beside one busy process if asked; the peak from the kernel's
    accounting in a parent of its own."""
    probe = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
             "r = subprocess.run(sys.argv[1:], capture_output=True); "
             "r.returncode and sys.exit(r.stderr.decode(errors='replace')[-2000:] or r.returncode); "  # its own words
             "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        if busy:
            time.sleep(0.5)  # already busy when the command starts
        out = subprocess.run([sys.executable, "-c", probe, *map(str, cmd)], check=True, capture_output=True, text=True)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    seconds, kb = out.stdout.split()
    return float(seconds), int(kb) / 1024


def dense_flops(c) -> int:
    """Multiply-adds x 2 of one token through the dense layers: q, k, v, the output, and the feed-forward."""
    h, i = c.hidden_size, c.intermediate_size
    return 2 * c.num_hidden_layers * (3 * h * h + h * h + 2 * h * i)


def peak(c, dtype, threads: int, rounds: int = 15) -> tuple[float, float]:
    """GFLOP/s of the model's products at 2,048 rows, the mix a token meets, and the better of torch's two CPU kernels
    for them: `a @ b` (MKL in fp32, oneDNN in bf16) and oneDNN's with the weight laid out ahead, as embed.py runs them
    (support.cpu_layers.PackedLinear): on a Zen 4, fp32 200-205 GFLOP/s against MKL's 148-168, bf16 401-421 against
    385-390; a peak without them would flatter every share. The best of `rounds`, and their median: on a shared AMX
    Xeon the same products ran at 730-930 GFLOP/s most seconds and 2,100-2,450 in others (docs/measurements.md)."""
    h, i = c.hidden_size, c.intermediate_size
    torch.set_num_threads(threads)
    shapes = [(h, 3 * h), (h, h), (h, i), (i, h)]
    xs = [(torch.randn(2048, k, dtype=dtype), torch.randn(k, n, dtype=dtype)) for k, n in shapes]
    flops = sum(2 * 2048 * k * n for k, n in shapes)
    ways = [[(lambda a=a, b=b: a @ b) for a, b in xs]]
    if torch.backends.mkldnn.is_available():
        packed = [(a, torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), None)) for a, b in xs]
        ways.append([(lambda a=a, w=w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""))
                     for a, w in packed])
    rates = []  # (GFLOP/s of each round) for each kernel
    for products in ways:
        rates.append([])
        for _ in range(rounds):
            for product in products:  # warm
                product()
            t = time.perf_counter()
            for _ in range(10):
                for product in products:
                    product()
            rates[-1].append(10 * flops / (time.perf_counter() - t) / 1e9)
    return max(map(max, rates)), max(map(float, map(np.median, rates)))
