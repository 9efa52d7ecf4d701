"""
How long `--compile` takes to build its graphs, by model depth and backend, on this machine: the figures behind the
GPU check's time limits for its compiling sections (b, c) in docs/gpu.md.

    python bench/compile_time.py                          # tiny, 2 and 6 layers of 768, aot_eager and inductor
    python bench/compile_time.py --backends aot_eager --layers 2 6

Each case compiles train.py's chunk forward (encoder, pooling, MLM head) in a fresh process with an empty compile
cache (as a freshly lent machine has), and times the first training step (forward and backward: one graph with
gradients) and the first step of GradCache's pass without gradients (a second graph), less the same steps run
eager. `aot_eager` is dynamo and AOTAutograd alone: the part of compiling that does not depend on the device.
`inductor` adds code generation, which on a CPU is C++ built by the system compiler and on a GPU Triton kernels,
built in parallel by inductor's compile workers.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.cli import UserError, bench  # noqa: E402


def one_case(width: int, layers: int, backend: str) -> dict:
    """Run in a fresh process (a cold compile cache): seconds to compile a training graph and a no-grad graph."""
    import functools

    import torch

    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    from _spans import span_batch, step_chunks

    import model
    import train
    from support.device import compiled_graphs

    torch.compile = functools.partial(torch.compile, backend=backend)
    torch._inductor.config.compile_threads = max(1, torch.get_num_threads())
    heads = max(1, width // 64)
    c = model.ModelConfig(vocab_size=50265, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                          intermediate_size=4 * width)
    batch = span_batch(2, 50265, max_span=128)  # spans by the sampler's laws, short: eager steps stay quick
    cfg = train.TrainConfig(grad_cache=False, chunk_tokens=1 << 20)
    times = {}
    for compiled in (False, True):
        enc = model.Encoder(c)
        enc.init_weights(torch.Generator().manual_seed(0))
        chunks = train.ChunkedEncoder(enc.train(), compile=compiled)
        t = time.perf_counter()
        train.train_step(chunks, batch, cfg)
        times["train", compiled] = time.perf_counter() - t
        spans = step_chunks(batch, enc, cfg)
        t = time.perf_counter()
        with torch.no_grad():
            chunks.chunk_forward(enc, *spans.inputs[0]._replace(masked_at=None))
        times["no_grad", compiled] = time.perf_counter() - t
    return {"train_graph_s": times["train", True] - times["train", False],
            "no_grad_graph_s": times["no_grad", True] - times["no_grad", False],
            "graphs": compiled_graphs()[0]}


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", nargs="+", default=["aot_eager", "inductor"])
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 6])
    ap.add_argument("--case", help=argparse.SUPPRESS)  # width,layers,backend: one case, in this process
    a = ap.parse_args()
    if a.case:
        width, layers, backend = a.case.split(",")
        print(json.dumps(one_case(int(width), int(layers), backend)))
        return
    import torch

    cases = [(64, 2)] + [(768, n) for n in a.layers]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; seconds to compile, less eager")
    print(f"{'model':<16} {'backend':<10} {'training graph':>15} {'no-grad graph':>14}")
    failed = []
    for backend in a.backends:
        for width, layers in cases:
            with tempfile.TemporaryDirectory() as cache:  # cold: nothing compiled before, as on a fresh machine
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache}
                out = subprocess.run([sys.executable, __file__, "--case", f"{width},{layers},{backend}"],
                                     capture_output=True, text=True, env=env)
            if out.returncode:
                why = [line for line in out.stderr.splitlines() if line.strip()] or ["no output"]
                failed.append(f"{layers} x {width} {backend}: {why[-1].strip()[:200]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            name = f"{layers} x {width}"
            print(f"{name:<16} {backend:<10} {r['train_graph_s']:>15.1f} {r['no_grad_graph_s']:>14.1f}", flush=True)
    if failed:  # a case that measured nothing is no figure: said, and the exit says so
        raise UserError(f"{len(failed)} of {len(a.backends) * len(cases)} cases failed; the first, {failed[0]}")


if __name__ == "__main__":
    main()
