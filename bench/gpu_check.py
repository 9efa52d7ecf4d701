"""
The one-shot GPU check: is the code right on a GPU, and how fast is it there? Run by bench/gpu_check.sh.

    bash bench/gpu_check.sh                 # one GPU: about 5 minutes by estimate, 8.8 at the most (docs/gpu.md)
    bash bench/gpu_check.sh --dry-run       # on a CPU, small: every section that can run without a GPU
    bash bench/gpu_check.sh --sections ce   # a rerun of some sections
    bash bench/gpu_env_dry_run.sh           # the dry run under the GPU machine's Python and packages
    python bench/gpu_assets.py              # MiniLM, books and STS-B dev packed for the GPU machine (DECLUTR_SHARED)

Sections, each with its own time limit (they add up to less than the shell's); each prints its results as they come,
the JSON (--json; default $OUT/gpu_check.json where $OUT is set, as on the lent GPU machine, whose $OUT alone comes
back, else runs/gpu_check.json) is rewritten after every section, and the summary, as text and JSON, is written
whatever a section raises (SystemExit and the shell's SIGTERM included) and is the last thing printed. Each can pass
on a correct GPU and fail on a wrong one; times are on the GPU's own clock (CUDA events), past a warm-up, with
nothing copied to the host inside what is timed:
  a. the GPU in fp32 (TF32 off) against the CPU on the same weights and batch (embeddings; train_step's loss and
     gradients; dropout off; padded and unpadded), and bf16 against fp32 on the GPU (cosine >= 0.999)
  b. GradCache's gradient against the plain step's with dropout on, eager and compiled, in fp32
  c. --compile against eager on four batches: fp32 within 1e-3; bf16 within twice the spread of eager bf16 against
     eager fp32, measured here; no graph break, at most two graphs (fp32, bf16), no fall back to eager; step times
     of each precision apart (b and c compile a model of the GPU's width with 2 layers: whether compiling is right
     does not depend on depth, and its time does: docs/gpu.md)
  d. a one-rank NCCL process group set up as train.py sets it up: DDP(ChunkedEncoder)'s gradient (plain and GradCache's
     no_sync) against the bare step's, both in fp32 with TF32 off and the same chunks; the gather's forward and
     backward through NCCL against a hand-worked gradient
  e. train.py --steps 30, distilroberta-base shape, N=16: tokens/s, MFU against the GPU's bf16 peak, peak memory
     against the estimate (bench/gpu_memory.py), the GPU's idle time between steps, chunks and host-GPU
     synchronisations per step
  f. the attention kernels of a training step (the memory-efficient kernel, never cuDNN's) and of embedding
  g. embed.encode sentences/s, and the STS-B dev score on the GPU against the CPU's (within 0.1); without MiniLM, a
     random model, and bf16 judged against fp32 on it by the embeddings' lowest cosine; 66,000 empty lines at
     --batch-tokens 131072 (embed.MAX_ROWS)
  h. varlen attention (torch.nn.attention.varlen.varlen_attn over the concatenated spans) against train.py's path:
     tokens/s with dropout as training has it, and the gradient within twice bf16's own spread
  i. roberta-base's shape at the paper's setting (N=16, A=P=2, spans 32-512, bf16): tokens/s, MFU and peak memory of
     whole training steps with every layer padded, with train.py's path, and with varlen attention
  j. embed.encode against sentence-transformers' encode on the same GPU, model and sentences: their ratio of
     sentences/s and the lowest cosine
  k. embed.encode with the encoder under torch.compile (inductor, dynamic shapes) against eager on the same model and
     sentences: sentences/s each, the first pass's seconds (the graphs' build), and the lowest cosine (>= 0.999)
Models are random-init (the distilroberta-base shape, roberta-base's in i, with RoBERTa's 50,265-token vocabulary
on a GPU, whatever the BPE reaches on the documents; tiny in a dry run) with a BPE trained on the check's documents:
16 Gutenberg books under DECLUTR_SHARED if there, else Python's own docstrings joined into long documents. g and j
use all-MiniLM-L6-v2 and STS-B dev when DECLUTR_SHARED has them. The exit code is 0 when every section run passed
or was skipped and one passed, 1 otherwise (after the summary, one line naming the sections that did not pass).
"""
import argparse
import contextlib
import functools
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import embed  # noqa: E402
import evaluate_sts  # noqa: E402
import loss  # noqa: E402
import model  # noqa: E402
import sampler  # noqa: E402
import train  # noqa: E402
from support import chunks, corpus, demo, processes, threads  # noqa: E402
from support.device import compiled_graphs, compute, device_and_dtype  # noqa: E402
from support.hub import train_tokenizer  # noqa: E402
from support.sts_files import load_stsb_dev  # noqa: E402

SHARED = Path(os.environ.get("DECLUTR_SHARED", ROOT.parent / "shared"))
# Dense bf16 tensor-core peaks from the vendors' datasheets (half the "with sparsity" figure), by the exact name torch
# gives the GPU: the H200 NVL and H100 PCIe share a family name with faster parts. Another GPU: GPU_PEAK_FLOPS.
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA H100 80GB HBM3": 989e12,
             "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A100-SXM4-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12, "NVIDIA A100-PCIE-40GB": 312e12,
             "NVIDIA L4": 121e12, "NVIDIA A10": 125e12}


class Check:
    """The state the sections share: device, sizes, documents, tokenizer, and the results so far."""

    def __init__(self, dry: bool, out: Path):
        self.dry, self.out, self.results = dry, out, {}
        self.dev = device(dry)
        self.shape = "tiny" if dry else "distilroberta-base"
        # The model's vocabulary is the shape's (RoBERTa's 50,265 on a GPU) whatever the BPE reaches on the documents
        # (Python's docstrings give about 16,000): the MLM head, its memory and its FLOPs are distilroberta-base's
        self.vocab = demo.SHAPES[self.shape]["vocab_size"]
        self.docs_per_step, self.max_span = (4, 64) if dry else (16, 510)
        # b and c compile the shape's width with 2 layers (1 in a dry run): whether compiling is right does not depend
        # on depth, and its time does (docs/gpu.md)
        self.compile_layers = 1 if dry else 2
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.docs = documents(self.tmp / "docs", 12 if dry else 16)
        texts = corpus.document_texts([self.docs], max_chars=(2 if dry else 8) << 20)
        self.tok = train_tokenizer(texts, self.vocab)
        self.corpus = corpus.prepare_corpus([self.docs], self.tok, str(self.tmp / "cache"))
        self.cfg = train.TrainConfig(docs_per_step=self.docs_per_step, min_span=16 if dry else 32,
                                     max_span=self.max_span, chunk_tokens=16384)
        self.batches = sampler.SpanBatches(self.corpus, self.tok, self.cfg, 512)
        self.scored = None  # scored_model's, once g or j has made it

    def encoder(self, dropout: bool = False, seed: int = 0, layers: int = 0, shape: str = ""):
        """A random-init encoder of the check's shape or `shape` (layers: fewer than it has), on the device."""
        sizes = {**demo.scratch_shape(shape or self.shape), "vocab_size": self.vocab,
                 **({"num_hidden_layers": layers} if layers else {})}
        enc = model.Encoder(model.ModelConfig(**sizes))
        enc.init_weights(torch.Generator().manual_seed(seed))
        if not dropout:
            for m in enc.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
                if isinstance(m, model.SelfAttention):  # attention dropout, a float
                    m.dropout_p = 0.0
        return enc.to(self.dev).train()

    def config(self, **overrides) -> "train.TrainConfig":
        return replace(self.cfg, **overrides)

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def peak_flops(self) -> float:
        """The device's dense bf16 peak (PEAK_BF16, or GPU_PEAK_FLOPS), nan where unknown (a CPU)."""
        name = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else ""
        return PEAK_BF16.get(name, float(os.environ.get("GPU_PEAK_FLOPS", "nan")))


    def record(self, section: str, **values):
        self.results.setdefault(section, {}).update(values)
        for k, v in values.items():
            print(f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}", flush=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=2, default=str) + "\n")


class Timer:
    """Times of work on the device's own clock: CUDA events recorded around it on a GPU (nothing copied to the host and
    nothing waited for inside; read once, at the end), perf_counter on a CPU."""

    def __init__(self, dev: torch.device):
        self.dev, self.spans = dev, []

    def mark(self):
        if self.dev.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def __call__(self):
        start = self.mark()
        yield
        self.spans.append((start, self.mark()))

    def between(self, a, b) -> float:
        """Seconds from mark a to mark b."""
        if self.dev.type != "cuda":
            return b - a
        torch.cuda.synchronize(self.dev)
        return a.elapsed_time(b) / 1e3

    def seconds(self) -> list[float]:
        return [self.between(a, b) for a, b in self.spans]


def device(dry: bool) -> torch.device:
    """The device as train.py finds it: cuda:LOCAL_RANK, with its index (NCCL's process group is bound to one)."""
    return torch.device("cpu") if dry else processes.processes().device


def one_rank_process_group(dev: torch.device) -> processes.Process:
    """One rank meeting in a store of its own, its process group set up as train.py's (NCCL on a GPU)."""
    import torch.distributed as dist

    proc = processes.Process(rank=0, local=0, world=1, device=dev, store=dist.HashStore())
    processes.init_process_group(proc, 60)
    return proc


def documents(folder: Path, n: int) -> Path:
    """n long documents: Gutenberg books if the shared assets are here, else Python's docstrings joined up."""
    folder.mkdir(parents=True)
    books = sorted((SHARED / "data" / "corpus" / "gutenberg").glob("*.txt"))[:n]
    if len(books) == n:
        for b in books:
            (folder / b.name).write_bytes(b.read_bytes())
        return folder
    text = "\n\n".join(p.read_text() for p in sorted(demo.demo_corpus("").glob("*.txt")))
    size = len(text) // n
    for i in range(n):
        (folder / f"{i}.txt").write_text(text[i * size:(i + 1) * size])
    return folder


def grads(enc) -> dict:
    return {n: p.grad.detach().float().cpu().clone() for n, p in enc.named_parameters() if p.grad is not None}


def worst_relative(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp(min=1e-12)) for n in b)


def step(check: Check, enc, batch, timer: "Timer | None" = None, **overrides) -> dict:
    """train_step on one batch (timed by `timer` alone: the gradients are copied to the host after it)."""
    enc.zero_grad(set_to_none=True)
    cfg = check.config(**overrides)
    chunked = train.ChunkedEncoder(enc, compile=cfg.compile)
    with timer() if timer else contextlib.nullcontext():
        stats = train.train_step(chunked, batch, cfg)
    return {"loss": float(stats["contrastive"] + stats["mlm"]), "grads": grads(enc)}


@contextlib.contextmanager
def exact_fp32():
    """fp32 that means fp32: TF32 off for the section's matmuls (train.py turns it on), back on after."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


# -----------------------------------------------------------------------------------------------
# The sections


def parity(check: Check):
    """(a) the GPU in fp32 against the CPU on the same weights; bf16 against fp32 on the GPU."""
    cpu = check.encoder().cpu()
    gpu = check.encoder().to(check.dev)
    gpu.load_state_dict(cpu.state_dict())
    batch = check.batches[0]
    ids, lengths = batch["anchors"], batch["anchor_lengths"]
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()  # (B, T) 0/1
    full = batch["anchors"][:4, :int(batch["anchor_lengths"][:4].min())]  # cut to the shortest: no padding
    with torch.no_grad(), exact_fp32(), compute(None, check.dev):  # the attention kernels train.py and embed.py use
        for name, (x, m) in {"padded": (ids, mask), "unpadded": (full, torch.ones_like(full))}.items():
            a = model.mean_pool(cpu(x, m), m)
            b = model.mean_pool(gpu(x.to(check.dev), m.to(check.dev)), m.to(check.dev)).cpu()
            check.record("a", **{f"embeddings_{name}_max_abs_diff": float((a - b).abs().max()),
                                 f"embeddings_{name}_min_cosine": float(torch.cosine_similarity(a, b).min())})
    with exact_fp32():
        ref = step(check, cpu, batch, dtype="fp32")
        got = step(check, gpu, batch, dtype="fp32")
    check.record("a", train_step_loss_cpu=ref["loss"], train_step_loss_gpu=got["loss"],
                 train_step_worst_relative_grad_diff=worst_relative(got["grads"], ref["grads"]))
    with torch.no_grad(), exact_fp32():
        x, m = ids.to(check.dev), mask.to(check.dev)
        with compute(None, check.dev):
            e32 = model.mean_pool(gpu(x, m), m)
        with compute(torch.bfloat16, check.dev):
            e16 = model.mean_pool(gpu(x, m), m).float()
    cos = float(torch.cosine_similarity(e16, e32).min())
    r = check.results["a"]
    check.record("a", bf16_vs_fp32_min_cosine=cos, bf16_ok=cos >= 0.999,
                 passed=cos >= 0.999 and r["train_step_worst_relative_grad_diff"] <= 1e-3
                 and min(r["embeddings_padded_min_cosine"], r["embeddings_unpadded_min_cosine"]) >= 0.99999)


def grad_cache(check: Check):
    """(b) GradCache = the plain step, with dropout on (the RNG replay), eager and compiled, in fp32."""
    batch = check.batches[1]
    with exact_fp32():
        for compiled in (False, True):
            enc = check.encoder(dropout=True, layers=check.compile_layers)
            torch.manual_seed(3)
            plain = step(check, enc, batch, chunk_tokens=2048, compile=compiled, dtype="fp32")
            torch.manual_seed(3)
            cached = step(check, enc, batch, chunk_tokens=2048, grad_cache=True, compile=compiled, dtype="fp32")
            check.record("b", **{f"{'compiled' if compiled else 'eager'}_worst_relative_grad_diff":
                                 worst_relative(cached["grads"], plain["grads"])})
    check.record("b", passed=all(v <= 1e-3 for k, v in check.results["b"].items() if k.endswith("grad_diff")))


def compile_check(check: Check):
    """(c) --compile against eager: fp32 gradients, bf16 against its own spread, graph breaks, graphs, step time."""
    import torch._dynamo as dynamo

    dynamo.utils.counters["graph_break"].clear()
    graphs_before = compiled_graphs()[0]
    encoders = {name: check.encoder(layers=check.compile_layers) for name in ("eager", "compiled")}
    encoders["compiled"].load_state_dict(encoders["eager"].state_dict())
    timers, r = {(name, dtype): Timer(check.dev) for name in encoders for dtype in ("fp32", "bf16")}, {}
    for i in range(4):
        batch, out = check.batches[2 + i], {}
        with exact_fp32():
            for dtype in ("fp32", "bf16"):
                for name, enc in encoders.items():
                    out[name, dtype] = step(check, enc, batch, timers[name, dtype], compile=name == "compiled",
                                            dtype=dtype)
        ref = out["eager", "fp32"]["grads"]
        r[i] = dict(fp32=worst_relative(out["compiled", "fp32"]["grads"], ref),
                    bf16_spread=worst_relative(out["eager", "bf16"]["grads"], ref),
                    bf16=worst_relative(out["compiled", "bf16"]["grads"], ref))
        check.record("c", **{f"batch{i}_{k}_worst_relative_grad_diff": v for k, v in r[i].items()})
        with torch.no_grad():  # the same update on both, so the next batch compares the same weights again
            for enc in encoders.values():
                for n, p in enc.named_parameters():
                    p.add_(ref[n].to(p.device), alpha=-1e-4)
    graphs, gave_up = compiled_graphs()
    breaks = dynamo.utils.counters["graph_break"]
    # train_step's time alone (the gradients' copy to the host comes after it), each precision apart, past the
    # first two batches, which compile
    times = {f"{name}_{dtype}": timer.seconds() for (name, dtype), timer in timers.items()}
    check.record("c", graph_breaks=sum(breaks.values()), graph_break_reasons=dict(breaks),
                 graphs_compiled_here=graphs - graphs_before, recompile_limit_reached=gave_up,
                 step_ms={k: 1e3 * float(np.median(v[2:])) for k, v in times.items()},
                 first_compiled_steps_s={k: v[:2] for k, v in times.items() if k.startswith("compiled")})
    check.record("c", passed=not breaks and not gave_up and graphs - graphs_before <= 2
                 and all(v["fp32"] <= 1e-3 and v["bf16"] <= 2 * v["bf16_spread"] + 1e-3 for v in r.values()))


def hand_worked_nt_xent_grad(a: torch.Tensor, p: torch.Tensor, tau: float):
    """d NT-Xent / d(anchors, positives), worked out by hand in float64: with unit rows u = z/|z| of z = [a; p],
    S = u u^T / tau (no diagonal) and P its row softmax, dL/dS = (P - Y) / 2M for the partners Y; then
    dL/du = (G + G^T) u / tau and dL/dz = (dL/du - u (u . dL/du)) / |z|."""
    z = torch.cat([a, p]).double().cpu()
    m2 = len(z)
    norm = z.norm(dim=1, keepdim=True)
    u = z / norm
    s = (u @ u.T / tau).masked_fill(torch.eye(m2, dtype=torch.bool), float("-inf"))
    y = torch.zeros(m2, m2, dtype=torch.float64)
    y[torch.arange(m2), torch.arange(m2).roll(m2 // 2)] = 1
    g = (torch.softmax(s, dim=1) - y) / m2
    du = (g + g.T) @ u / tau
    dz = (du - u * (u * du).sum(1, keepdim=True)) / norm
    return dz[:m2 // 2], dz[m2 // 2:]


def ddp(check: Check):
    """(d) a one-rank process group (NCCL on a GPU) as train.py sets it up: DDP(ChunkedEncoder), no_sync under
    GradCache,
    the gather through NCCL; DDP's gradient against the bare step's, the gather's against a hand-worked one."""
    import torch.distributed as dist

    proc = one_rank_process_group(check.dev)
    try:
        batch = check.batches[6]
        enc = check.encoder()
        # Like with like: both sides in fp32 with TF32 off, over the same chunks (bf16, or other chunk budgets, differ
        # by more than 1e-4 on a correct GPU), GradCache's DDP step against GradCache's bare step
        same = dict(dtype="fp32", chunk_tokens=2048)
        with exact_fp32():
            for grad_cache_on in (False, True):
                ref = step(check, enc, batch, grad_cache=grad_cache_on, **same)
                enc.zero_grad(set_to_none=True)
                cfg = check.config(grad_cache=grad_cache_on, **same)
                chunks = DDP(train.ChunkedEncoder(enc), device_ids=proc.device_ids,  # as train.setup() builds it
                             find_unused_parameters=not cfg.mlm)
                train.train_step(chunks, batch, cfg, world=1)
                check.record("d", **{f"ddp{'_grad_cache' if grad_cache_on else ''}_worst_relative_grad_diff":
                                     worst_relative(grads(enc), ref["grads"])})
                del chunks
        gen = torch.Generator().manual_seed(0)
        a, p = (torch.randn(12, 64, generator=gen).to(check.dev).requires_grad_() for _ in range(2))
        with exact_fp32():  # the all_gather whose backward all-reduces, into NT-Xent
            loss.nt_xent(loss._Gather.apply(a), loss._Gather.apply(p), 0.05).backward()
        want = hand_worked_nt_xent_grad(a.detach(), p.detach(), 0.05)
        gather_diff = max(float((x.grad.double().cpu() - w).norm() / w.norm())
                          for x, w in zip((a, p), want, strict=True))
        r = check.results["d"]
        bound = dist.distributed_c10d._get_default_group().bound_device_id  # the GPU NCCL is bound to, with its index
        check.record("d", backend=dist.get_backend(), bound_device=str(bound),
                     gather_grad_vs_hand_worked=gather_diff,
                     passed=gather_diff <= 1e-4
                     and max(r["ddp_worst_relative_grad_diff"], r["ddp_grad_cache_worst_relative_grad_diff"]) <= 1e-4)
    finally:
        dist.destroy_process_group()


def train_run(check: Check):
    """(e) train.py's own loop for 30 steps (5 in a dry run): tokens/s, MFU, peak memory, the GPU's idle time between
    steps, chunks and syncs per step."""
    steps = 5 if check.dry else 30
    folder, enc = check.tmp / "init", check.encoder(dropout=True)
    model.save_pretrained(enc.cpu(), check.tok, folder)
    chunk_counts, sync_warnings, timer, started, marks = [], [], Timer(check.dev), [], []
    real_groups, real_step, real_opt = chunks.length_groups, train.train_step, train.optimizer_step

    def counting_groups(*a, **k):
        groups = real_groups(*a, **k)
        chunk_counts.append(len(groups))
        return groups

    def counted(fn):  # host-GPU synchronisations inside the step itself (the loop's one read for the log is apart)
        def wrapped(*a, **k):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn(*a, **k)
            sync_warnings.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))
            return out
        return wrapped

    def timed_step(*a, **k):  # each step from the start of its forward to the end of its optimizer step, on the GPU
        started.append(timer.mark())
        out = real_step(*a, **k)
        started.append(out["tokens"])
        return out

    def timed_opt(*a, **k):
        out = real_opt(*a, **k)
        marks.append((started[-2], timer.mark(), started[-1]))
        return out

    chunks.length_groups, train.train_step = counting_groups, counted(timed_step)
    train.optimizer_step = counted(timed_opt)
    if check.dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        train.main(["--model", str(folder), "--data", str(check.docs), "--out", str(check.tmp / "run"),
                    "--steps", str(steps), "--docs-per-step", str(check.docs_per_step), "--min-span", "32",
                    "--max-span", str(check.max_span), "--cache-dir", str(check.tmp / "cache"), "--log-every", "10",
                    "--ckpt-every", "1000", "--workers", "4" if not check.dry else "0", "--lr", "1e-4"])
    finally:
        chunks.length_groups, train.train_step, train.optimizer_step = real_groups, real_step, real_opt
        if check.dev.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    recs = [json.loads(line) for line in (check.tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    # Past the first third of the steps (the allocator's first allocations, the workers' start), on the GPU's clock:
    # the loop's tokens/s from the start of one step to the end of the last, and how long the GPU sat idle between
    # a step's end and the next one's start (the host late in giving it work)
    warm = marks[len(marks) // 3:]
    tokens_per_s = sum(tokens for *_, tokens in warm) / timer.between(warm[0][0], warm[-1][1])
    idle_ms = [1e3 * timer.between(end, nxt) for (_, end, _), (nxt, _, _) in zip(warm, warm[1:], strict=False)]
    flops_per_token = train_flops_per_token(enc.config, [check.batches[i] for i in range(steps)])
    peak = check.peak_flops()
    check.record("e", device=torch.cuda.get_device_name(check.dev) if check.dev.type == "cuda" else "cpu",
                 steps=steps, timed_steps=len(warm), tokens_per_s=tokens_per_s,
                 step_ms=1e3 * float(np.median([timer.between(a, b) for a, b, _ in warm])),
                 gpu_idle_between_steps_ms=float(np.median(idle_ms)) if idle_ms else "n/a",
                 model_tflops_per_s=tokens_per_s * flops_per_token / 1e12,
                 mfu=tokens_per_s * flops_per_token / peak if math.isfinite(peak) else "n/a (peak unknown)",
                 peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if check.dev.type == "cuda" else "n/a",
                 chunks_per_step=float(np.mean(chunk_counts)) if chunk_counts else "n/a",
                 syncs_per_step_in_the_step=len(sync_warnings) / steps if check.dev.type == "cuda" else "n/a (CPU)",
                 sync_examples=sorted(set(sync_warnings))[:3], last_losses=(recs[-1]["contrastive"], recs[-1]["mlm"]),
                 passed=not sync_warnings and all(math.isfinite(r["contrastive"] + r["mlm"]) for r in recs))


def train_flops_per_token(cfg, batches) -> float:
    """Model FLOPs per real token of these batches: 6 per weight for the token-wise layers, attention's QK^T and AV
    (T per token, fwd + bwd), and the MLM head on the masked tokens. Padding is not counted: it is not useful work."""
    d, layers, ff, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
    per_token = 6 * layers * (4 * d * d + 2 * d * ff)
    total_tokens = total = 0.0
    for b in batches:
        lengths = torch.cat([b["anchor_lengths"], b["positive_lengths"]]).double()
        total_tokens += float(lengths.sum())
        total += per_token * float(lengths.sum()) + 12 * layers * d * float((lengths ** 2).sum())
        total += 6 * float((b["mlm_labels"] != -100).sum()) * (d * d + d * vocab)
    return total / total_tokens


def attention_ops(prof) -> list[str]:
    """The attention operators and kernels a profile holds."""
    words = ("attention", "fmha", "flash", "sdpa", "cudnn")
    return sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in words)})


def attention_kernel(check: Check):
    """(f) the attention kernels of a training step (dropout on, --dtype auto, as train.py runs it) and of embedding
    (embed.py's padded and unpadded batches), from the profiler."""
    activity = [torch.profiler.ProfilerActivity.CPU]
    if check.dev.type == "cuda":
        activity.append(torch.profiler.ProfilerActivity.CUDA)
    enc, batch, cfg = check.encoder(dropout=True), check.batches[0], check.config(dtype="auto")
    train.train_step(train.ChunkedEncoder(enc), batch, cfg)  # a first step: what it sets up once is not profiled
    with torch.profiler.profile(activities=activity) as prof:
        train.train_step(train.ChunkedEncoder(enc), batch, cfg)
        check.sync()
    training = attention_ops(prof)
    _, dtype = device_and_dtype(str(check.dev), "auto")
    texts = ["a man plays a guitar", "a woman sings", "the cat sat on the mat " * 8, "a dog runs"]
    with torch.profiler.profile(activities=activity) as prof:
        embed.encode(texts[:2], enc, check.tok, dtype=dtype)  # two texts of one length: no padding
        embed.encode(texts, enc, check.tok, dtype=dtype)  # padded
        check.sync()
    embedding_ops = attention_ops(prof)
    # On a GPU: training's masked attention is the memory-efficient kernel forward and backward (support/device.py's
    # ATTENTION_KERNELS), never cuDNN's or the math fallback; embedding never cuDNN's either
    efficient = [n for n in training if "efficient_attention" in n]
    gpu_right = (any("backward" in n for n in efficient) and len(efficient) >= 2
                 and not any("cudnn" in n or "flash" in n or "_math" in n for n in training)
                 and not any("cudnn" in n for n in embedding_ops))
    check.record("f", attention_kernels=training, embedding_attention_kernels=embedding_ops,
                 passed=gpu_right or check.dev.type != "cuda")


def scored_model(check: Check):
    """(folder, STS pairs, what they are) for g and j: all-MiniLM-L6-v2 and STS-B dev where DECLUTR_SHARED has them
    (its weights in fp32: bench/gpu_assets.py carries them to the GPU machine in fp16, to fit what travels), else a
    random model of the check's shape on docstring sentences, whose scores are noise."""
    if check.scored is not None:
        return check.scored
    minilm, stsb = SHARED / "models" / "all-MiniLM-L6-v2", SHARED / "data" / "sts" / "stsbenchmark" / "sts-dev.csv"
    folder = check.tmp / "scored-model"
    if (minilm / "model.safetensors").exists() and stsb.exists():
        tensors = safetensors.torch.load_file(minilm / "model.safetensors")
        shutil.copytree(minilm, folder, ignore=shutil.ignore_patterns("model.safetensors"))
        safetensors.torch.save_file({k: (v.float() if v.is_floating_point() else v).contiguous()
                                     for k, v in tensors.items()},
                                    folder / "model.safetensors")
        pairs, what = load_stsb_dev(stsb), "all-MiniLM-L6-v2 on STS-B dev"
    else:
        model.save_pretrained(check.encoder().cpu(), check.tok, folder)
        sents = [s for s in " ".join(corpus.document_texts([check.docs], max_chars=1 << 20)).split(". ") if s][:3000]
        rng = np.random.default_rng(0)
        pairs, what = (sents[:1500], sents[1500:3000], rng.random(1500)), "a random model on docstring sentences"
    if check.dry:  # on a CPU every side of g and j is the CPU's: a few of the pairs check the same code
        pairs, what = tuple(side[:200] for side in pairs), f"{what} (its first 200 pairs: a dry run)"
    check.scored = folder, pairs, what
    return check.scored


def model_and_sentences(check: Check):
    """scored_model's folder, its sentences each once, and what they are."""
    folder, (a, b, _), what = scored_model(check)
    return folder, list(dict.fromkeys(a + b)), what


def embedding(check: Check):
    """(g) embed.encode sentences/s on the device; STS-B dev on the device against the CPU."""
    folder, pairs, what = scored_model(check)
    enc, tok = model.load_pretrained(str(folder), quiet=True)
    texts = pairs[0] + pairs[1]
    cpu = evaluate_sts.spearman_of(enc.cpu(), tok, pairs)  # fp32
    enc.to(check.dev)
    _, dtype = device_and_dtype(str(check.dev), "auto")
    with exact_fp32():  # embed.py's fp32 is fp32 (train.py, run in e, turned TF32 on for this process)
        fp32 = evaluate_sts.spearman_of(enc, tok, pairs)
        e32 = embed.encode(texts, enc, tok)
    on_device = evaluate_sts.spearman_of(enc, tok, pairs, dtype=dtype)
    check.sync()
    t = time.perf_counter()
    e_auto = embed.encode(texts, enc, tok, dtype=dtype)
    check.sync()
    seconds = time.perf_counter() - t
    cosine = e_auto * e32 / (np.linalg.norm(e_auto, axis=1) * np.linalg.norm(e32, axis=1))[:, None]
    lowest = float(cosine.sum(1).min())
    fp32_agrees = abs(fp32 - cpu) <= 0.1
    # MiniLM on STS-B: the auto dtype's score within 0.1 of the CPU's; a random model's score is noise, so its bf16
    # is judged by how near its embeddings stay to fp32's on the same model
    auto_agrees = abs(on_device - cpu) <= 0.1 if "MiniLM" in what else lowest >= 0.999
    check.record("g", scored=what, cpu_fp32=cpu, device_auto_dtype=on_device, device_fp32=fp32,
                 auto_dtype=str(dtype), auto_vs_fp32_lowest_cosine=lowest, sentences_per_s=len(texts) / seconds)
    # 66,000 empty lines at --batch-tokens 131072: without embed.MAX_ROWS, batches of 65,536 rows, past the fused
    # attention kernels' grid ("CUDA error: invalid configuration argument")
    empty = embed.encode([""] * 66_000, enc, tok, batch_tokens=131072, dtype=dtype) if not check.dry else None
    rows_ok = empty is None or bool(np.isfinite(empty).all() and (empty == empty[0]).all())
    check.record("g", empty_lines_66000=("n/a (dry run)" if empty is None else "embedded" if rows_ok else "wrong"),
                 passed=fp32_agrees and auto_agrees and rows_ok)


def varlen_forward(self, x, packing):
    """SelfAttention.forward with varlen_attn (torch >= 2.10, CUDA only) over the real tokens themselves: no padding
    anywhere. It has no attention dropout."""
    from torch.nn.attention.varlen import varlen_attn

    B, T, H, mask = packing.B, packing.T, x.shape[-1], packing.key_mask
    lengths = mask.view(B, T).sum(1) if mask is not None else torch.full((B,), T, device=x.device)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    q, k, v = self.qkv(x).view(-1, 3, self.n_head, H // self.n_head).unbind(1)  # 3 x (N, nh, hd)
    y = varlen_attn(q, k, v, cu, cu, T, T).reshape(-1, H)
    return self.ln(x + self.drop(self.out(y)))


class Padded(model.Packing):
    """Every token-wise layer on the whole padded (B, T) batch, as transformers runs an encoder: attention masked."""

    def __init__(self, B, T, positions=None, attention_mask=None):
        super().__init__(B, T, positions, attention_mask)
        self.positions = None


PATHS = ("padded", "packed", "varlen")  # packed: train.py's own (token-wise layers on the real tokens only)


@contextlib.contextmanager
def attention_path(path: str):
    """The encoder's layers run one of PATHS while inside."""
    packing, forward = model.Packing, model.SelfAttention.forward
    model.Packing = Padded if path == "padded" else packing
    model.SelfAttention.forward = varlen_forward if path == "varlen" else forward
    try:
        yield
    finally:
        model.Packing, model.SelfAttention.forward = packing, forward


def run_steps(enc, batches, cfg, timer: Timer, optimizer=None) -> list:
    """train_step on each batch (and AdamW's step, if given), each timed by `timer`; nothing copied to the host inside.
    Returns the losses, on the device."""
    chunked, losses = train.ChunkedEncoder(enc), []
    for batch in batches:
        with timer():
            stats = train.train_step(chunked, batch, cfg)
            if optimizer is not None:
                train.optimizer_step(optimizer, train.NO_SCALING, enc, cfg.max_grad_norm)
        enc.zero_grad(set_to_none=True)
        losses.append(stats["contrastive"] + stats["mlm"])
    return losses


def real_tokens(batch) -> int:
    return int(batch["anchor_lengths"].sum() + batch["positive_lengths"].sum())


def packed_attention(check: Check):
    """(h) varlen attention against train.py's path (attention over the padded batch): tokens/s as training runs
    (dropout on: train.py's attention dropout, which varlen_attn lacks) and the gradient (dropout off in both).
    Adopted only if faster with the same gradient; this section only measures."""
    if check.dev.type != "cuda":
        raise Skipped("varlen_attn runs on CUDA only")
    batch = check.batches[7]
    with exact_fp32():
        ref = step(check, check.encoder(), batch, dtype="fp32")["grads"]  # train.py's path in fp32: the reference
    results = {}
    for path in ("packed", "varlen"):
        with attention_path(path):
            grad = worst_relative(step(check, check.encoder(), batch, dtype="bf16")["grads"], ref)
            timer = Timer(check.dev)
            run_steps(check.encoder(dropout=True), [batch] * 4, check.config(dtype="bf16"), timer)
            results[path] = grad, 3 * real_tokens(batch) / sum(timer.seconds()[1:])  # past the first
    (spread, speed), (varlen, varlen_speed) = results["packed"], results["varlen"]
    same = varlen <= 2 * spread + 1e-3  # as close to fp32 as bf16's own path is, within twice that
    check.record("h", packed_tokens_per_s=speed, varlen_tokens_per_s=varlen_speed,
                 packed_bf16_vs_fp32_worst_relative_grad_diff=spread,
                 varlen_bf16_vs_fp32_worst_relative_grad_diff=varlen,
                 adopt=same and varlen_speed > speed, passed=same)


def paper_setting(check: Check):
    """(i) roberta-base's shape at the paper's setting (N=16, A=P=2, spans 32-512, bf16, dropout on), whole training
    steps (AdamW's included): tokens/s, MFU and peak memory with every layer on the padded batch, with train.py's
    path (token-wise layers on the real tokens), and with varlen attention too."""
    shape = "tiny" if check.dry else "roberta-base"
    steps, warm = (3, 1) if check.dry else (8, 3)
    batches, cfg, peak = [check.batches[8 + k] for k in range(steps)], check.config(dtype="auto"), check.peak_flops()
    r = {key: {} for key in ("tokens_per_s", "mfu", "model_tflops_per_s", "step_ms", "peak_memory_gib")}
    finite = True
    for path in PATHS:
        if path == "varlen" and check.dev.type != "cuda":
            for key in r:
                r[key][path] = "n/a (CUDA only)"
            continue
        with attention_path(path):
            enc = check.encoder(dropout=True, shape=shape)
            optimizer = train.make_optimizer(enc, cfg.lr, cfg.weight_decay, fused=check.dev.type == "cuda")
            if check.dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(check.dev)
            timer = Timer(check.dev)
            losses = run_steps(enc, batches, cfg, timer, optimizer)
        seconds = timer.seconds()[warm:]  # past the first steps (the allocator's first allocations)
        tokens_per_s = sum(real_tokens(b) for b in batches[warm:]) / sum(seconds)
        flops = train_flops_per_token(enc.config, batches[warm:])
        finite = finite and all(math.isfinite(float(x)) for x in losses)
        r["tokens_per_s"][path], r["step_ms"][path] = tokens_per_s, 1e3 * float(np.median(seconds))
        r["model_tflops_per_s"][path] = tokens_per_s * flops / 1e12
        r["mfu"][path] = tokens_per_s * flops / peak if math.isfinite(peak) else "n/a (peak unknown)"
        r["peak_memory_gib"][path] = (torch.cuda.max_memory_allocated(check.dev) / 2**30 if check.dev.type == "cuda"
                                      else "n/a")
        del enc, optimizer
    check.record("i", shape=shape, documents_per_step=check.docs_per_step, timed_steps=steps - warm,
                 real_tokens_per_step=float(np.mean([real_tokens(b) for b in batches])), **r, passed=finite)


def versus_sentence_transformers(check: Check):
    """(j) embed.encode against sentence-transformers' encode on the same device, model and sentences, each as a user
    runs it (ours --dtype auto; theirs in fp32, its default, and in bf16 where the device has it): sentences/s and
    the lowest cosine to theirs in fp32."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise Skipped("sentence-transformers is not installed") from None
    folder, texts, what = model_and_sentences(check)
    texts = texts[:200] if check.dry else texts
    enc, tok = model.load_pretrained(str(folder), quiet=True)
    enc.to(check.dev)
    _, dtype = device_and_dtype(str(check.dev), "auto")
    arms = {"declutr": lambda: embed.encode(texts, enc, tok, dtype=dtype)}
    st = SentenceTransformer(str(folder), device=str(check.dev))
    arms["sentence_transformers"] = lambda: st.encode(texts, convert_to_numpy=True)
    if dtype == torch.bfloat16:
        st_bf16 = SentenceTransformer(str(folder), device=str(check.dev)).bfloat16()
        arms["sentence_transformers_bf16"] = lambda: st_bf16.encode(texts, convert_to_numpy=True)
    out, _, per_s = alternating(check, arms, len(texts))
    ours, theirs = out["declutr"], out["sentence_transformers"]
    cosine = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    check.record("j", model=what, sentences=len(texts), declutr_dtype=str(dtype), sentences_per_s=per_s,
                 ratio_vs_sentence_transformers=per_s["declutr"] / per_s["sentence_transformers"],
                 **({"ratio_vs_sentence_transformers_bf16": per_s["declutr"] / per_s["sentence_transformers_bf16"]}
                    if "sentence_transformers_bf16" in per_s else {}),
                 min_cosine=float(cosine.min()), passed=float(cosine.min()) >= 0.999)


def alternating(check: Check, arms: dict, items: int) -> tuple[dict, dict, dict]:
    """Each arm once, untimed but for its own seconds (what it sets up once: a compiled graph's build), then 3 timed
    passes (1 in a dry run), the arms alternating so that all see the same machine: (each arm's output, its first
    pass's seconds, its items/s by the median pass)."""
    out, first, times = {}, {}, {name: [] for name in arms}
    for name, arm in arms.items():
        t = time.perf_counter()
        out[name] = arm()
        check.sync()
        first[name] = time.perf_counter() - t
    for _ in range(1 if check.dry else 3):
        for name, arm in arms.items():
            check.sync()
            t = time.perf_counter()
            arm()
            check.sync()
            times[name].append(time.perf_counter() - t)
    return out, first, {name: items / float(np.median(t)) for name, t in times.items()}


def compiled_embedding(check: Check):
    """(k) embed.encode with the encoder under torch.compile against eager: sentences/s and the lowest cosine."""
    folder, texts, what = model_and_sentences(check)
    texts = texts[:200] if check.dry else texts
    enc, tok = model.load_pretrained(str(folder), quiet=True)
    if check.dry:  # as b and c: one layer shows the compiled forward right, in a fraction of the build
        enc.layers, enc.config.num_hidden_layers = enc.layers[:1], 1
    enc.to(check.dev)
    _, dtype = device_and_dtype(str(check.dev), "auto")
    # embed.py dropped --compile: on a 2-core CPU it never paid (docs/measurements.md). This is the figure that
    # could bring it back on a GPU: inductor for batches of every shape, the graphs built in the first pass
    compiled = torch.compile(enc, dynamic=True)
    arms = {name: functools.partial(embed.encode, texts, m, tok, dtype=dtype)
            for name, m in (("eager", enc), ("compiled", compiled))}
    # A CPU (the dry run) runs its batches one at a time: a graph built in one thread waits on the others forever
    with threads.cpu_threads(1) if check.dev.type == "cpu" else contextlib.nullcontext():
        out, first, per_s = alternating(check, arms, len(texts))
    a, b = out["compiled"], out["eager"]
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    check.record("k", model=what, sentences=len(texts), dtype=str(dtype), sentences_per_s=per_s,
                 compiled_over_eager=per_s["compiled"] / per_s["eager"], first_pass_s=first,
                 min_cosine=float(cosine.min()), passed=float(cosine.min()) >= 0.999)


# Seconds each section may take on one GPU (a dry run: three times as long). With setup's they add up to 515 s, under
# the 530 s that gpu_check.sh gives the whole; docs/gpu.md gives each one's estimate (about 5 minutes in all) and how
# a 15-minute lease holds a start, the whole check and a rerun of the sections that failed.
SETUP_LIMIT = 45
SECTIONS = {"a": (parity, 30), "b": (grad_cache, 70), "c": (compile_check, 90), "d": (ddp, 20), "e": (train_run, 45),
            "f": (attention_kernel, 15), "g": (embedding, 30), "h": (packed_attention, 20), "i": (paper_setting, 45),
            "j": (versus_sentence_transformers, 45), "k": (compiled_embedding, 60)}


class Skipped(Exception):
    """A section that cannot run here (CUDA only, a package missing): reported as skipped, with why."""


class TimeLimit(BaseException):
    """A section past its limit. Not an Exception: library code that catches Exception (torch compiles a backward
    inside the forward's compile and swallows what that raises) must not swallow the limit too."""


class Terminated(BaseException):
    """SIGTERM (gpu_check.sh's timeout): no more sections, but the summary is written."""


@contextlib.contextmanager
def time_limit(seconds: int):
    def stop(signum, frame):
        raise TimeLimit(f"over its {seconds} s")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def run_section(check: Check, key: str, scale: int):
    """One section under its time limit; whatever it raises (SystemExit from train.main too) is its result. A SIGTERM
    ends the check: here, or inside train.main, whose own handler turns it into SystemExit(143)."""
    fn, limit = SECTIONS[key]
    t = time.time()
    check.record(key, started=time.strftime("%H:%M:%S"))  # before its header: a section cut short is reported as one
    print(f"\n{fn.__doc__.splitlines()[0]}", flush=True)
    try:
        with time_limit(limit * scale):
            fn(check)
        check.record(key, status="ok", seconds=time.time() - t)
    except Skipped as e:
        check.record(key, status=f"skipped: {e}", seconds=time.time() - t)
    except SystemExit as e:
        if e.code == 143:  # train.main stopped by the shell's SIGTERM
            check.record(key, seconds=time.time() - t)
            raise Terminated from None
        failed(check, key, e, t)
    except (Exception, TimeLimit) as e:  # reported, and the next section runs
        failed(check, key, e, t)


def failed(check: Check, key: str, e: BaseException, t: float):
    print(traceback.format_exc(limit=-3), flush=True)
    why = str(e).splitlines()[0][:300] if str(e) else ""
    check.record(key, status=f"failed: {type(e).__name__}: {why}", seconds=time.time() - t)


def earlier(path: Path, sections: str) -> dict:
    """What an earlier run left in --json of the sections this one does not run: `--sections ij` after a whole run
    keeps a-h's results beside its own (the summary then covers them all)."""
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in before.items() if k in SECTIONS and k not in sections} if isinstance(before, dict) else {}


def summarise(check: Check, sections: str, t0: float):
    """pass, FAIL (ran, and a result is wrong), failed: ... (raised), skipped: ..., cut short or not run; as JSON and
    a table; over the sections run now and those an earlier run left (earlier())."""
    sections = "".join(k for k in SECTIONS if k in sections or k in check.results) or sections
    summary = {}
    for key in sections:
        r = check.results.get(key, {})
        status = r.get("status", "cut short" if r else "not run")  # cut short: started, and SIGTERM while it ran
        summary[key] = ("pass" if r.get("passed") else "FAIL") if status == "ok" else status
    check.record("summary", **summary, seconds=round(time.time() - t0))
    print(f"\n{'section':<8} {'result':<60} seconds")
    for key in sections:
        print(f"{key:<8} {summary[key][:60]:<60} {check.results.get(key, {}).get('seconds', float('nan')):.0f}")
    print(f"done in {time.time() - t0:.0f}s; results in {check.out}", flush=True)


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, small: every section that can run there")
    # $OUT: the one folder whose files come back from the lent GPU machine
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs"
    ap.add_argument("--json", default=str(out / "gpu_check.json"), help="results, rewritten per section")
    ap.add_argument("--sections", default="".join(SECTIONS), help="which sections, e.g. abd")
    ap.add_argument("--compile-backend", choices=["inductor", "aot_eager"],
                    help="torch.compile's backend in b and c: inductor (the default on a GPU) or aot_eager (a dry "
                         "run's default: the graphs inductor would be given, without its C++ builds for a CPU)")
    return ap.parse_args(argv)


def main():
    args = arguments()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no GPU here: bash bench/gpu_check.sh --dry-run runs the check on the CPU")
    if unknown := set(args.sections) - set(SECTIONS):
        sys.exit(f"--sections {args.sections}: no section {', '.join(sorted(unknown))} (one of {''.join(SECTIONS)})")
    # The JSON is written after every section: a --json that cannot be written is said now, not after setup
    json_path, folder = Path(args.json), Path(args.json).parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if json_path.is_dir() or not existing.is_dir():
        why = "is a folder" if json_path.is_dir() else f"{existing} is not a folder"
        sys.exit(f"error: --json {json_path}: {why}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only file system, say
        sys.exit(f"error: --json {json_path}: cannot make {folder} ({e.strerror})")
    if not os.access(folder, os.W_OK):
        sys.exit(f"error: --json {json_path}: cannot write into {folder}")
    kept = earlier(json_path, args.sections)  # read before this run writes its first result over them

    def terminated(signum, frame):
        raise Terminated

    signal.signal(signal.SIGTERM, terminated)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    backend = args.compile_backend or ("aot_eager" if args.dry_run else "inductor")
    torch.compile = functools.partial(torch.compile, backend=backend)  # what train.py's --compile calls
    t0, scale = time.time(), 3 if args.dry_run else 1
    check = None
    try:
        with time_limit(SETUP_LIMIT * scale):
            check = Check(args.dry_run, Path(args.json))
        check.results.update(kept)
        check.record("setup", device=torch.cuda.get_device_name(check.dev) if not args.dry_run else "cpu (dry run)",
                     torch=torch.__version__, python=platform.python_version(), shape=check.shape,
                     compile_backend=backend, setup_s=time.time() - t0)
        for key in args.sections:
            run_section(check, key, scale)
    except Terminated:
        print("\nterminated (SIGTERM): the sections left are not run", flush=True)
        sys.exit(143)
    finally:
        if check is not None:
            summarise(check, args.sections, t0)
            shutil.rmtree(check.tmp, ignore_errors=True)  # its documents, corpus and models: the results are kept
        else:
            print("setup did not finish: no section ran", flush=True)
    ran = {k: v for k, v in check.results["summary"].items() if k in args.sections}
    if not_passed := {k: v for k, v in ran.items() if v != "pass" and not v.startswith("skipped")}:
        sys.exit(f"error: {len(not_passed)} of {len(ran)} section(s) did not pass: "
                 + "; ".join(f"{k} {v}" for k, v in not_passed.items()))
    if "pass" not in ran.values():
        sys.exit(f"error: every section was skipped ({''.join(ran)}): nothing was measured")


if __name__ == "__main__":
    main()
