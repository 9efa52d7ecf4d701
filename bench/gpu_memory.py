"""
The GPU memory a training step needs, estimated on a CPU: distilroberta-base and roberta-base at N=16 documents a
step, on 1 GPU (16 documents each) and on 8 (2 each), with and without GradCache. No GPU is needed, and none was used.

    python bench/gpu_memory.py --seeds 1          # the table in docs/gpu.md, about 40 minutes on 2 cores
    python bench/gpu_memory.py --docs 16 --shape roberta-base

How: the step's spans are drawn from the sampler's own length laws (anchors 32 + 478·Beta(4, 2), positives
32 + 478·Beta(2, 4), plus <s> and </s>), and the step's forward is run as train.train_step runs it on a GPU (one
chunk per --chunk-tokens budget, bf16 autocast as --dtype auto gives there, hidden dropout on), at the model's real
width and depth, on the CPU. Every tensor autograd saves for the backward is counted once (by its storage): what a
step holds at its peak, at the start of the backward. Attention dropout is off here, so that the CPU runs its fused
attention, which keeps what a GPU's flash or memory-efficient kernel keeps (q, k, v, the output, the log-sum-exp),
not the (T, T) probabilities and masks of the math path (a GPU's kernels replay their dropout from the RNG state).
Added to that: the weights, their gradients and AdamW's two moments in fp32 (16 bytes a parameter), DDP's gradient
buckets on more than one GPU (4 more), and the backward's transients, taken as twice the largest saved tensor (the
MLM logits' gradient, usually). Not counted: the CUDA context (~0.5 GiB, outside torch's allocator) and the
allocator's fragmentation. Without GradCache the peak is every chunk's saved tensors together; with it, the
largest chunk's.
"""
import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from _spans import span_batch, step_chunks  # noqa: E402

import model  # noqa: E402
import train  # noqa: E402
from support import chunks, demo  # noqa: E402
from support.cli import bench  # noqa: E402

GIB = 2**30


class SavedBytes:
    """Bytes of the distinct storages autograd saves while this is entered; any (spans, heads, T, T) attention tensor
    would be the CPU's math path, which a GPU's fused kernels do not take, and is left out."""

    def __init__(self, T: int, heads: int):
        self.attention = (heads, T, T)
        self.storages, self.largest = {}, 0

    def pack(self, t):
        if t.dim() == 4 and tuple(t.shape[1:]) == self.attention:
            return t
        storage = t.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        self.largest = max(self.largest, storage.nbytes())
        return t

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def activations(encoder, batch, cfg, grad_cache: bool) -> tuple[int, int]:
    """(bytes saved for the backward at the step's peak, its largest saved tensor), the step's forward as train_step
    runs it: all chunks at once, or with GradCache the largest chunk alone."""
    groups = chunks.length_groups  # a GPU's chunks: one per --chunk-tokens budget, whatever the spread of lengths
    chunks.length_groups = lambda lengths, budget, spread: groups(lengths, budget, spread=0.0)
    try:
        spans = step_chunks(batch, encoder, cfg)
    finally:
        chunks.length_groups = groups
    heads = encoder.config.num_attention_heads
    per_chunk = []
    for chunk in spans.inputs:
        with SavedBytes(chunk.ids.shape[1], heads) as saved, torch.autocast("cpu", dtype=torch.bfloat16):
            train.chunk_forward(encoder, *chunk)
        per_chunk.append((sum(saved.storages.values()), saved.largest))
    if grad_cache:
        return max(b for b, _ in per_chunk), max(b for _, b in per_chunk)
    return sum(b for b, _ in per_chunk), max(b for _, b in per_chunk)


def encoder_of(shape: str, layers: int):
    sizes = {k: v for k, v in demo.scratch_shape(shape).items() if k != "num_hidden_layers"}
    encoder = model.Encoder(model.ModelConfig(**sizes, num_hidden_layers=layers, attention_probs_dropout_prob=0.0))
    encoder.init_weights(torch.Generator().manual_seed(0))
    return encoder.train()


def estimate(shape: str, docs_per_gpu: int, gpus: int, grad_cache: bool, chunk_tokens: int, seed: int = 0) -> dict:
    """One row. Attention dropout is off: the CPU then runs its fused attention, which keeps what a GPU's flash or
    memory-efficient kernel keeps, not the math path's (T, T) probabilities and masks (a GPU's kernels replay their
    dropout from the RNG state). The layers are alike, so what a step saves is a + layers x b: measured with none and
    with (at most) six layers, and carried on to the model's depth, in a CPU's memory."""
    layers = demo.scratch_shape(shape)["num_hidden_layers"]
    cfg = train.TrainConfig(chunk_tokens=chunk_tokens, grad_cache=grad_cache)
    batch = span_batch(docs_per_gpu, 50265, seed)
    measured = min(layers, 6)
    (none, largest), (some, largest_some) = (activations(encoder_of(shape, n), batch, cfg, grad_cache)
                                             for n in (0, measured))
    saved = none + (some - none) * layers / measured
    params = sum(p.numel() for p in model.scratch_encoder(shape, 50265).parameters())
    states = params * (16 + (4 if gpus > 1 else 0))
    transients = 2 * max(largest, largest_some)
    tokens = int(batch["anchor_lengths"].sum() + batch["positive_lengths"].sum())
    return dict(shape=shape, gpus=gpus, docs_per_gpu=docs_per_gpu, grad_cache=grad_cache, chunk_tokens=chunk_tokens,
                real_tokens=tokens, states_gib=states / GIB, activations_gib=saved / GIB,
                transients_gib=transients / GIB, peak_gib=(states + saved + transients) / GIB)


@bench
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=["distilroberta-base", "roberta-base"])
    ap.add_argument("--docs", type=int, default=16, help="N, documents a step over all GPUs")
    ap.add_argument("--seeds", type=int, default=2, help="batches drawn per row: the spread of the sampler's lengths")
    args = ap.parse_args()
    torch.manual_seed(0)
    print("| model | GPUs | documents a GPU | GradCache | real tokens a GPU | weights, grads, AdamW | activations | "
          "transients | peak (GiB) |\n|---|---|---|---|---|---|---|---|---|")
    for shape in args.shape:
        for gpus in (1, 8):
            for grad_cache, chunk in ((False, 16384), (True, 4096)):
                rows = [estimate(shape, args.docs // gpus, gpus, grad_cache, chunk, seed) for seed in range(args.seeds)]

                def spread(key, fmt="{:.1f}", rows=rows):  # one figure, or the lowest and highest over the seeds
                    values = sorted({fmt.format(x[key]) for x in rows}, key=lambda v: float(v.replace(",", "")))
                    return "–".join(dict.fromkeys([values[0], values[-1]]))

                print(f"| {shape} | {gpus} | {rows[0]['docs_per_gpu']} | "
                      f"{'--chunk-tokens 4096' if grad_cache else 'off'} | {spread('real_tokens', '{:,}')} | "
                      f"{rows[0]['states_gib']:.1f} | {spread('activations_gib')} | {spread('transients_gib')} | "
                      f"**{spread('peak_gib')}** |", flush=True)

if __name__ == "__main__":
    main()
