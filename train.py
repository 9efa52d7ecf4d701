"""
train.py: DeCLUTR's training loop. Contrastive loss on sampled spans plus MLM, on a CPU, a GPU, or many.

Paper §3 and §4: continue pretraining an encoder on unlabelled documents with NT-Xent over anchors and
positives (loss.py) sampled from the same documents (sampler.py), plus masked language modelling on the
anchors in the same forward pass; AdamW (lr 5e-5, weight decay 0.1 except biases and LayerNorms, eps 1e-6),
a slanted triangular schedule (cut_frac 0.1, ratio 32), gradients clipped to norm 1.0, N=16 documents a step.

    python train.py                                   # the demo: a tiny model learns from Python's own docs, ~3 min
    python train.py --model scratch:tiny --data docs/ --steps 200 --lr 1e-3 --out runs/tiny
    python train.py --model distilroberta-base --data docs/ --out runs/declutr-small
    torchrun --nproc_per_node=4 train.py --model distilroberta-base --data owt/ --out runs/declutr-small
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=run1 \\
        train.py --model roberta-base --data owt/ --out runs/declutr-base
    python train.py --out runs/declutr-small --resume          # continue from the newest checkpoint
"""
import collections
import contextlib
import functools
import gc
import json
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import evaluate_sts
import sampler
from common import UserError, bounded
from loss import nt_xent
from model import (
    load_pretrained,
    mean_pool,
    nonpad_positions,
    save_pretrained,
    scratch_encoder,
    scratch_shape,
    scratch_tokenizer,
)

MAX_STEPS = 10**7  # a month of steps at a quarter of a second each: more is a typo, not a run


@dataclass
class TrainConfig(sampler.SamplerConfig, common.Precision):  # --dtype, the sampler's (model, data, N, A, P...), these
    out: str = ""  # checkpoints, metrics.jsonl, and the final model in out/model; empty: runs/declutr (runs/demo)
    resume: bool = False  # continue the newest checkpoint in out (runs/declutr or runs/demo) as it was configured
    overwrite: bool = False  # start afresh in an out that holds an earlier run
    temperature: float = bounded(0.05, 0, 10, strict=True)  # tau of NT-Xent
    mlm: bool = True  # --no-mlm: contrastive only (the paper's Fig. 3 ablation)
    contrastive: bool = True  # --no-contrastive: MLM only
    lr: float = bounded(5e-5, 0, 1, strict=True)
    weight_decay: float = bounded(0.1, 0, 1)  # AdamW's, decoupled; not on biases and LayerNorms
    warmup_frac: float = bounded(0.1, 0, 1)  # slanted triangular cut_frac
    lr_ratio: float = bounded(32.0, 1, 1e6)  # slanted triangular: lowest lr is lr / ratio
    max_grad_norm: float = bounded(1.0, 0, 1e6, strict=True)
    steps: int = bounded(0, 0, MAX_STEPS)  # optimiser steps; 0: --epochs passes over the documents
    epochs: int = bounded(1, 1, 10**6)
    chunk_tokens: int = bounded(16384, 1)  # spans run in length-sorted chunks of at most this many padded tokens
    grad_cache: bool = False  # GradCache: chunks forward without a graph, then backward chunk by chunk
    compile: bool = False  # torch.compile each chunk's forward: the encoder, pooling and the MLM head
    ddp_timeout: int = bounded(1800, 1, 604800)  # seconds a collective waits for the other ranks before the job stops
    log_every: int = bounded(10, 1)
    eval_data: str = ""  # STS-B folder or sts-dev.csv: dev Spearman at every eval, best model kept in out/best
    eval_every: int = bounded(0, 0)  # steps between evaluations (0: only at the end)
    ckpt_every: int = bounded(500, 1)
    keep_ckpts: int = bounded(2, 1)  # the newest checkpoints kept
    threads: int = bounded(0, 0)  # torch CPU threads per rank; 0: its share of the cores free when it starts

    def validate(self):
        super().validate()
        if not (self.mlm or self.contrastive):
            raise UserError("--no-mlm and --no-contrastive together leave nothing to train", code=2)
        if self.contrastive and self.docs_per_step * self.num_anchors < 2:
            raise UserError(f"--docs-per-step {self.docs_per_step} with --num-anchors {self.num_anchors}: the "
                            f"contrastive loss needs at least 2 anchors a step, or it has no negative", code=2)
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite: continue the run, or replace it, not both", code=2)
        if (shape := scratch(self.model)) is not None:
            scratch_shape(shape, "--model scratch:")


# Flags that --resume takes from the command line: they extend the run or change what is logged, evaluated and
# kept, not the model's trajectory. Any other flag given with --resume is refused.
RESUMABLE = {"out", "resume", "steps", "epochs", "log_every", "eval_data", "eval_every", "ckpt_every", "keep_ckpts",
             "workers", "threads", "cache_dir", "ddp_timeout"}


# -----------------------------------------------------------------------------------------------
# One step (§3): embed every span, NT-Xent between anchors and their positives, MLM on the anchors.
# The step first, then what it is made of: one chunk's forward, the spans cut into chunks, GradCache.


def train_step(model, batch, cfg: TrainConfig, world: int = 1, scaler=None) -> dict:
    """Forward and backward of this rank's documents; leaves the step's gradient in .grad. `model` is
    ChunkedEncoder(encoder), under torchrun in the DDP that setup() builds (DDP averages the gradients)."""
    # The step's spans on the device, in chunks of similar length
    spans = Spans(batch, cfg, unwrap(model).encoder)
    # §3.3: MLM is a mean over the masked tokens of the whole global batch
    spans.mlm_scale = mlm_scale(spans.n_masked, world, spans.device)
    if cfg.grad_cache:
        return grad_cache_step(model, spans, cfg, world, scaler)
    # §3.1: every span's mean-pooled embedding and §3.3: the MLM loss of the anchors' masked tokens, all chunks
    emb, mlm = model(spans, range(len(spans.chunks)))
    # Back from the chunks' length order to the batch's order: the anchors, then the P positives of each anchor
    emb = emb[spans.unsort]
    # §3.2: NT-Xent between each anchor and the mean of its positives, every other span a negative
    contrastive = contrastive_loss(emb, spans.n_anchors, cfg)
    # §3.3: one objective, contrastive + MLM, one backward
    scaled(contrastive + mlm, scaler).backward()
    return step_stats(spans, contrastive, mlm, world)


def contrastive_loss(emb, n_anchors: int, cfg: TrainConfig):
    if not cfg.contrastive:
        return emb.new_zeros(())
    anchors, positives = emb[:n_anchors], emb[n_anchors:]
    return nt_xent(anchors, positives.view(n_anchors, cfg.num_positives, -1), cfg.temperature)  # (M, d), (M, P, d)


def mlm_scale(n_masked: int, world: int, device) -> torch.Tensor:
    """What this rank's summed MLM loss is multiplied by: DDP averages gradients over ranks, so each rank's share is
    its sum over the global count of masked tokens, times world. A tensor, so that --compile does not specialise on
    it."""
    count = common.to_device(np.asarray(n_masked, dtype=np.float32), device)
    if world > 1:
        dist.all_reduce(count)
    return world / count.clamp(min=1)


def scaled(loss, scaler):
    """fp16: the loss times the scaler's scale, so that small gradients do not vanish in half precision."""
    return loss if scaler is None else scaler.scale(loss)


def step_stats(spans, contrastive, mlm, world: int) -> dict:
    """The step's losses for the log, left on the device (the loop reads them once): contrastive (the same on every
    rank) and MLM averaged over ranks."""
    mlm_log = mlm.detach() / world if spans.mlm else torch.zeros((), device=spans.device)
    if world > 1:
        dist.all_reduce(mlm_log)  # the global mean, for the log
    return dict(tokens=int(spans.lengths.sum()), contrastive=contrastive.detach(), mlm=mlm_log)


def chunk_forward(encoder, ids, mask, nonpad, mlm_at, mlm_targets, mlm_scale):
    """One chunk of spans -> their embeddings (g, H) and this rank's share of the MLM loss of the anchors among them.
    What --compile compiles: the encoder, the pooling and the MLM head in one graph."""
    h = encoder(ids, mask, nonpad=nonpad)  # (g, T, H)
    # §3.1: a span's embedding is the mean of its token states
    emb = mean_pool(h, mask).float()  # (g, H)
    if mlm_at is None:
        return emb, emb.new_zeros(())
    # §3.3: the MLM head on the K masked tokens only, from the same forward pass
    logits = encoder.mlm_logits(h.flatten(0, 1)[mlm_at])  # (K, V)
    return emb, F.cross_entropy(logits.float(), mlm_targets, reduction="sum") * mlm_scale


class ChunkedEncoder(nn.Module):
    """The encoder over several chunks of spans in one forward. Under DDP a step is then one forward and one
    backward, during which DDP all-reduces the gradients in buckets as they become ready."""

    def __init__(self, encoder, compile: bool = False):
        super().__init__()
        self.encoder = encoder
        self.chunk_forward = torch.compile(chunk_forward, dynamic=True) if compile else chunk_forward

    def chunk(self, spans: "Spans", k: int, with_mlm: bool = True):
        with spans.autocast:
            return self.chunk_forward(self.encoder, *spans.chunk(k, with_mlm), spans.mlm_scale)

    def forward(self, spans: "Spans", chunks):
        outs = [self.chunk(spans, k) for k in chunks]
        return torch.cat([e for e, _ in outs]), sum(m for _, m in outs)  # (n, d) in the chunks' order, MLM


def unwrap(model) -> ChunkedEncoder:
    """The ChunkedEncoder itself, also from inside setup()'s DDP(ChunkedEncoder(encoder))."""
    return model.module if isinstance(model, DDP) else model


class Spans:
    """One step's spans as one list: the anchors first (MLM-corrupted when MLM is on), then their positives, P per
    anchor in order, cut into chunks of similar length. Each chunk's inputs (its ids and mask, where its non-pad
    tokens and MLM targets are) are worked out on the host from the lengths the sampler gives, and copied to the
    device from page-locked memory without waiting (common.to_device): nothing in the step makes the host wait for
    the GPU. A copy each, a few dozen a step, costs microseconds beside a step's hundreds of milliseconds on a GPU."""

    def __init__(self, batch, cfg: TrainConfig, encoder, multiple: int | None = None):
        self.device = device = next(encoder.parameters()).device
        self.n_anchors, self.mlm = len(batch["anchors"]), cfg.mlm
        # On a GPU a chunk's width is a multiple of 8: inductor guards on the attention mask's width modulo 8 there
        # (torch/_inductor/lowering.py, sdpa_constraint), so mixed widths would compile a second graph per mode
        self.multiple = multiple or (8 if device.type == "cuda" else 1)
        anchors = batch["mlm_inputs"] if cfg.mlm else batch["anchors"]
        positives = batch["positives"] if cfg.contrastive else batch["positives"][:0]  # MLM alone needs no positives
        lengths = torch.cat([batch["anchor_lengths"], batch["positive_lengths"][:len(positives)]]).numpy()  # (S,)
        self.lengths = lengths
        # Spans of similar length run together, within a token budget. On a GPU, one chunk per budget: a chunk more
        # costs more in launches than the padding inside one, which the token-wise layers skip anyway.
        self.groups = length_groups(lengths, cfg.chunk_tokens, spread=0.8 if device.type == "cpu" else 0.0)
        T, pad = self.width(max(anchors.shape[1], positives.shape[1])), encoder.config.pad_token_id
        ids = torch.cat([F.pad(anchors, (0, T - anchors.shape[1]), value=pad),
                         F.pad(positives, (0, T - positives.shape[1]), value=pad)]).numpy()  # (S, T)
        labels = batch["mlm_labels"].numpy()
        self.chunks = [self._chunk(group, ids, lengths, labels) for group in self.groups]
        order = np.concatenate(self.groups)
        self.order, self.unsort = common.to_device(order, device), common.to_device(np.argsort(order), device)
        self.n_masked = int((labels != -100).sum())
        self.autocast = common.autocast(common.autocast_dtype(cfg.dtype, device), device)

    def _chunk(self, group, ids, lengths, labels) -> tuple:
        """(g, T) ids and 0/1 mask, the non-pad tokens' flat positions, the MLM targets' flat positions and ids."""
        T = self.width(int(lengths[group].max()))
        mask = (np.arange(T)[None] < lengths[group][:, None]).astype(np.int64)  # (g, T)
        # §3.3: where the anchors' masked tokens are in the chunk's (g, T) layout, and what they were
        anchors = np.flatnonzero(group < self.n_anchors)  # the chunk's rows that hold anchors
        chunk_labels = labels[group[anchors], :T]
        i, j = np.nonzero(chunk_labels != -100)
        at, targets = anchors[i] * T + j, chunk_labels[i, j]
        # Every chunk gets the same kinds of input, so that --compile builds one graph for them all: the non-pad
        # tokens' positions even where there is no padding, and at least two MLM targets, the added ones ignored
        # (-100): a chunk with none or one would be a graph of its own, as the compiler treats sizes 0 and 1 apart.
        pad = max(0, 2 - len(at))
        at, targets = np.r_[at, [0] * pad].astype(np.int64), np.r_[targets, [-100] * pad].astype(np.int64)
        host = (ids[group, :T], mask, nonpad_positions(lengths[group], T), at, targets)
        return tuple(common.to_device(x, self.device) for x in host)

    def width(self, longest: int) -> int:
        return -(-longest // self.multiple) * self.multiple

    def chunk(self, k: int, with_mlm: bool = True) -> tuple:
        """Chunk k's inputs to chunk_forward; without MLM targets (None) when MLM is off, or in GradCache's first
        pass."""
        ids, mask, nonpad, at, targets = self.chunks[k]
        mlm = with_mlm and self.mlm
        return ids, mask, nonpad, at if mlm else None, targets if mlm else None


def length_groups(lengths: np.ndarray, budget: int, spread: float = 0.8) -> list[np.ndarray]:
    """Span indices sorted by length, cut into chunks whose padded size stays within `budget` tokens and
    whose shortest span is at least `spread` of the longest: token-wise layers skip padding anyway
    (model.py), attention and its dropout cost T^2 per span, so on a CPU a 40-token positive never waits on a
    500-token anchor. A chunk holds two spans at least, past the budget if need be: under --compile a chunk of one
    would be a graph of its own (the compiler treats a size of 1 apart)."""
    order = np.argsort(-lengths, kind="stable")
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        top = lengths[order[start]]
        if i == len(order) or i - start >= 2 and ((i - start + 1) * top > budget or lengths[order[i]] < spread * top):
            groups.append(order[start:i])
            start = i
    if len(groups) > 1 and len(groups[-1]) == 1:  # the shortest span left alone joins the chunk before it
        groups[-2:] = [np.concatenate(groups[-2:])]
    return groups


def grad_cache_step(model, spans: Spans, cfg: TrainConfig, world: int = 1, scaler=None) -> dict:
    """GradCache (Gao et al., 2021): the step above for a batch larger than memory, with the same gradient."""
    # 1. Every chunk's embeddings without a graph, remembering the RNG state (dropout) each chunk started from
    states, embs = [], []
    with torch.no_grad():
        for k in range(len(spans.chunks)):
            states.append(rng_state(spans.device))
            embs.append(unwrap(model).chunk(spans, k, with_mlm=False)[0])
    # 2. The loss on the whole batch, and its gradient with respect to each embedding, back in the chunks' order
    emb = torch.cat(embs)[spans.unsort].requires_grad_()
    contrastive = contrastive_loss(emb, spans.n_anchors, cfg)
    grad = torch.autograd.grad(contrastive, emb)[0] if cfg.contrastive else torch.zeros_like(emb)
    grad = grad[spans.order]
    starts = np.cumsum([0] + [len(g) for g in spans.groups])  # chunk k's rows of `grad`: starts[k]:starts[k + 1]
    # 3. Each chunk again with a graph and the same dropout masks, backpropagating its cached gradient (and MLM):
    # the chain rule through the embeddings, one chunk in memory at a time. DDP all-reduces in the last backward
    # only, where every parameter must take part: a chunk with anchors (and so the MLM head) goes last.
    order = sorted(range(len(spans.groups)), key=lambda k: bool((spans.groups[k] < spans.n_anchors).any()))
    mlm = torch.zeros((), device=spans.device)
    for i, k in enumerate(order):
        set_rng_state(states[k], spans.device)
        with accumulate_locally(model, i < len(order) - 1):
            e, m = model(spans, [k])
            scaled((e * grad[starts[k]:starts[k + 1]]).sum() + m, scaler).backward()
        mlm = mlm + m.detach()
    return step_stats(spans, contrastive, mlm, world)


def accumulate_locally(model, local: bool):
    """DDP's no_sync: this backward accumulates its gradients here; the step's last one all-reduces them all."""
    return model.no_sync() if local and isinstance(model, DDP) else contextlib.nullcontext()


def rng_state(device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state, device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Slanted triangular (Howard & Ruder, 2018): a short linear rise over cut_frac of the steps, a long fall."""
    cut = max(1, math.floor(total * cfg.warmup_frac))
    p = step / cut if step < cut else 1 - (step - cut) / max(1, total - cut)
    return cfg.lr * (1 + p * (cfg.lr_ratio - 1)) / cfg.lr_ratio


def make_optimizer(encoder, cfg: TrainConfig, fused: bool):
    decay = [p for p in encoder.parameters() if p.dim() >= 2]
    rest = [p for p in encoder.parameters() if p.dim() < 2]  # biases and LayerNorms: no decay
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, eps=1e-6, fused=fused or None)


def load_optimizer(opt, saved: dict):
    """A stored optimizer state, run the way this device wants it: fused AdamW on a GPU even when the run began on a
    CPU, and the other way round (load_state_dict alone would bring back the stored `fused`)."""
    groups = [{**stored, "fused": ours["fused"], "foreach": ours["foreach"]}
              for stored, ours in zip(saved["param_groups"], opt.param_groups, strict=True)]
    opt.load_state_dict({**saved, "param_groups": groups})


def optimizer_step(opt, scaler, encoder, max_norm: float) -> torch.Tensor:
    """Clip the gradient to max_norm and step; returns its norm, on the device. fp16: the loss scale comes out
    first, and a step whose gradient overflowed is skipped, with a smaller scale for the next."""
    scaler.unscale_(opt)
    gnorm = torch.nn.utils.clip_grad_norm_(encoder.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return gnorm


# -----------------------------------------------------------------------------------------------
# The loop


class Terminated(Exception):
    """SIGTERM: what SLURM, Kubernetes and `timeout` send a job they are about to stop."""


class StopOnSigterm:
    """SIGTERM handled as Ctrl-C is, but using the grace period a scheduler gives: in training, the step under way
    ends, every rank agrees to stop after it, and it is checkpointed; before training, the run stops at once."""

    def __init__(self):
        self.asked = self.training = False

    def __call__(self, signum, frame):
        if not self.training:
            raise Terminated
        self.asked = True


@dataclass
class Run:
    """Everything the loop reads and advances."""
    cfg: TrainConfig
    out: Path
    encoder: nn.Module
    model: nn.Module  # what train_step runs: ChunkedEncoder(encoder) (compiled with --compile), in DDP under torchrun
    tok: object
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16's loss scale; disabled (a no-op) in every other precision
    batches: sampler.SpanBatches
    total: int
    step: int = 0
    best: float = -1.0
    latest_checkpoint: Path | None = None  # the newest checkpoint
    evaluate: object = None  # () -> STS-B dev Spearman, with --eval-data
    rank: int = 0
    world: int = 1
    stop: StopOnSigterm = field(default_factory=StopOnSigterm)  # SIGTERM: stop after the step under way


def train(run: Run):
    """§4: one step per batch, with the schedule, clipping, logs, evaluation and checkpoints."""
    cfg, t0, run.stop.training = run.cfg, time.time(), True
    clock = collections.deque([(t0, 0)], maxlen=RECENT + 1)  # (time, tokens so far) after each of the recent steps
    for batch in sampler.make_loader(run.batches, run.step, run.total, cfg.workers):
        # The slanted triangular schedule sets this step's learning rate
        for g in run.opt.param_groups:
            g["lr"] = lr_at(run.step, run.total, cfg)
        # Dropout draws from the global generator, seeded from (seed, rank, step): a resumed run replays exactly
        torch.manual_seed(int(np.random.SeedSequence([cfg.seed, run.rank, run.step]).generate_state(1)[0]))
        with failures_are_one_line(run):
            # Forward and backward of this rank's documents
            stats = train_step(run.model, batch, cfg, run.world, run.scaler)
            # Every rank holds the same gradient (DDP's average), clipped to norm 1.0, and takes the same update
            gnorm = optimizer_step(run.opt, run.scaler, run.encoder, cfg.max_grad_norm)
            # SIGTERM: every rank stops after the same step, the first any of them was told to stop at
            stop = torch.full((), float(run.stop.asked), device=gnorm.device)
            if run.world > 1:
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        # The step's numbers, read from the device at once: the one place a step waits for the GPU
        numbers = (stats["contrastive"], stats["mlm"], gnorm, stop)
        contrastive, mlm, gnorm, stop = torch.stack([torch.as_tensor(x, dtype=torch.float32, device=gnorm.device)
                                                     for x in numbers]).tolist()
        if not math.isfinite(contrastive + mlm):
            raise UserError(f"loss is {contrastive + mlm} at step {run.step + 1}; last good checkpoint: "
                            f"{run.latest_checkpoint or 'none yet'}")
        run.step += 1
        clock.append((time.time(), clock[-1][1] + stats["tokens"] * run.world))
        (t_old, n_old), (t_new, n_new) = clock[0], clock[-1]
        rec = dict(step=run.step, contrastive=round(contrastive, 6), mlm=round(mlm, 6),
                   lr=run.opt.param_groups[0]["lr"],
                   grad_norm=round(gnorm, 4) if math.isfinite(gnorm) else None,  # fp16: a skipped step's is inf
                   tokens_per_s=round((n_new - n_old) / (t_new - t_old)))
        if run.evaluate and ((cfg.eval_every and run.step % cfg.eval_every == 0) or run.step == run.total):
            score_and_keep_best(run, rec)
        if run.rank == 0:
            log(run, rec, time.time() - t0, (t_new - t_old) / (len(clock) - 1))
        if run.step % cfg.ckpt_every == 0 or run.step == run.total or stop:
            if run.rank == 0:
                run.latest_checkpoint = save_checkpoint(run)
            if run.world > 1:
                dist.barrier()
        if stop and run.step < run.total:
            raise Terminated
    if cfg.compile:
        graphs, gave_up = compiled_graphs()
        common.say(f"--compile: {graphs} graph(s) compiled" + (
            "; the recompile limit was reached, and the chunks after it ran eager" if gave_up else ""))


def compiled_graphs() -> tuple[int, bool]:
    """(graphs torch.compile has built in this process, whether it reached its recompile limit and fell back to eager).
    Spans gives every chunk the same kinds of input, so a run builds one graph, two with GradCache (with and without
    gradients)."""
    counters = torch._dynamo.utils.counters
    gave_up = any(k.startswith("Dynamo recompile limit") for k in counters["unimplemented"])
    return counters["stats"]["unique_graphs"], gave_up


@contextlib.contextmanager
def failures_are_one_line(run: Run):
    """A step that does not fit on the GPU stops the run with the way out, the last checkpoint as it was; a rank that
    is gone (killed, or out of memory) stops the others at their next collective. Each said by the rank that meets it,
    whichever that is."""
    try:
        yield
    except torch.OutOfMemoryError:
        cfg = run.cfg
        fix = f"--chunk-tokens {max(512, cfg.chunk_tokens // 4)}" if cfg.grad_cache else \
            "--grad-cache --chunk-tokens 4096"
        raise UserError(f"out of memory on {run.encoder.embeddings.word.weight.device} in step {run.step + 1} "
                        f"({cfg.docs_per_step // run.world} documents on this rank): pass {fix} (the same gradient, "
                        f"less memory), or give each GPU fewer documents (more GPUs, or a smaller --docs-per-step); "
                        f"last checkpoint: {run.latest_checkpoint or 'none yet'}", alone=True) from None
    except RuntimeError as e:  # NCCL's errors are DistErrors; gloo's plain RuntimeErrors that name gloo's source
        if run.world == 1 or not (isinstance(e, dist.DistError) or "gloo" in str(e)):
            raise
        raise UserError(f"rank {run.rank}: another rank stopped during step {run.step + 1} ({common.first_line(e)}); "
                        f"last checkpoint: {run.latest_checkpoint or 'none yet'}", alone=True) from None


def score_and_keep_best(run: Run, rec: dict):
    """STS-B dev Spearman into the record (rank 0), and the best model so far kept in out/best."""
    run.encoder.eval()
    rec["stsb_dev_spearman"] = run.evaluate() if run.rank == 0 else None
    run.encoder.train()
    if run.rank == 0 and rec["stsb_dev_spearman"] > run.best:
        run.best = rec["stsb_dev_spearman"]
        save_pretrained(run.encoder, run.tok, run.out / "best")


RECENT = 20  # steps over which tokens/s and the ETA are measured: the first minutes do not skew them


def log(run: Run, rec: dict, elapsed: float, seconds_per_step: float):
    """Every step into out/metrics.jsonl; every --log-every steps a line on stdout."""
    try:
        with open(run.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
    except OSError as e:  # a full disk, or an --out moved or deleted while the run trains
        raise UserError(f"{run.out / 'metrics.jsonl'}: cannot write ({e.strerror or e}); was --out moved or deleted "
                        f"while the run trained? last checkpoint: {run.latest_checkpoint or 'none yet'}") from None
    if run.step % run.cfg.log_every == 0 or run.step == run.total:
        sts = f" | STS-B dev {rec['stsb_dev_spearman']:.2f}" if "stsb_dev_spearman" in rec else ""
        print(f"step {run.step}/{run.total} | contrastive {rec['contrastive']:.4f} | mlm {rec['mlm']:.4f} | "
              f"lr {rec['lr']:.2e} | {rec['tokens_per_s']:,} tok/s | {elapsed:.0f}s elapsed | "
              f"ETA {seconds_per_step * (run.total - run.step):.0f}s{sts}", flush=True)


def save_checkpoint(run: Run) -> Path:
    """out/checkpoints/step-NNNNNNNN: the model in Hugging Face layout, and train_state.pt (optimizer, step, config)."""
    state = {"optimizer": run.opt.state_dict(), "step": run.step, "config": asdict(run.cfg), "best": run.best,
             **({"scaler": run.scaler.state_dict()} if run.scaler.is_enabled() else {})}
    return common.write_checkpoint(run.out, run.step, functools.partial(save_pretrained, run.encoder, run.tok), state,
                                   run.cfg.keep_ckpts)


@common.cli
def main(argv=None):
    cfg = common.parse_config(TrainConfig, argv, __doc__.split("\n\n")[0])
    stop = StopOnSigterm()
    handled = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
    previous = signal.signal(signal.SIGTERM, stop) if handled else None
    run, threads = None, torch.get_num_threads()
    try:
        proc = common.processes()
        run = setup(cfg, common.given_fields(argv), proc)
        run.stop = stop
        train(run)
        if run.rank == 0:
            finish(run)
        if run.world > 1:
            dist.barrier()  # no rank tears its connections down while another still uses them
    except (KeyboardInterrupt, Terminated) as e:  # Ctrl-C, SIGTERM: one line, the checkpoint to resume from
        raise stopped(run, isinstance(e, Terminated)) from None
    finally:
        if handled:  # torchrun's SIGTERM to the others when one rank fails must not end this one before its line
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        torch.set_num_threads(threads)
        common.release_run_folders()
        if dist.is_initialized():
            if run is not None:  # DDP holds the process group: freed at exit, after Python's teardown, it aborts
                run.model = None
                gc.collect()
            dist.destroy_process_group()
        if handled:
            signal.signal(signal.SIGTERM, previous)


def stopped(run: Run | None, sigterm: bool) -> UserError:
    """Ctrl-C (exit 130) or SIGTERM (exit 143, as a shell reports them; the step it came in was finished and
    checkpointed): where the run stopped, and how to go on."""
    what, code = ("terminated (SIGTERM)", 143) if sigterm else ("interrupted", 130)
    if run is None:
        return UserError(f"{what} before training began", code)
    hint = f" (continue with: {resume_command(run)})" if run.latest_checkpoint else ""
    where = f"after step {run.step}; last checkpoint: {run.latest_checkpoint or 'none yet'}"
    return UserError(f"{what} {where}{hint}", code)


def resume_command(run: Run) -> str:
    """How to go on with a stopped run: as it was started (one process, or torchrun with as many), with --resume. The
    rest of its flags are stored with it."""
    flags = f"train.py --out {run.out} --resume"
    if run.world == 1:
        return f"python {flags}"
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if machines == 1:
        return f"torchrun --nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', run.world)} {flags}"
    return f"the torchrun command the run was started with, on each of its {machines} machines, for {flags}"


# -----------------------------------------------------------------------------------------------
# Setup: processes, the run folder, the model, the data


@dataclass
class Resume:
    """The checkpoint a run continues from."""
    path: Path
    state: dict  # train_state.pt: optimizer, step, config, best
    model: tuple  # (encoder, tokenizer)

    @property
    def step(self) -> int:
        return self.state["step"]


def setup(cfg: TrainConfig, given: set, proc: common.Process) -> Run:
    """Everything is checked (flags, evaluation data, model, documents) before an earlier run is replaced, and all
    that may take long (a tokenizer, the corpus) is ready before the process group exists, whose collectives may wait
    only --ddp-timeout seconds."""
    rank, world, device = proc.rank, proc.world, proc.device
    cfg, out, resume_from = run_folder(cfg, given, proc)
    if cfg.docs_per_step % world:
        raise UserError(f"--docs-per-step {cfg.docs_per_step}: does not split over {world} ranks", code=2)
    torch.set_num_threads(cfg.threads or common.default_threads())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # free on Ampere and later
    pairs = evaluate_sts.load_stsb_dev(cfg.eval_data) if cfg.eval_data else None  # a bad path stops the run now
    encoder, tok = resume_from.model if resume_from else build_model(cfg, proc)
    if not resume_from and scratch(cfg.model) is None and not Path(cfg.model).expanduser().is_dir():
        cfg = replace(cfg, model=f"{cfg.model.partition('@')[0]}@{encoder.source.name}")  # the commit it started from
    encoder.to(device).train()
    batches = sampler.SpanBatches(corpus_for_run(cfg, tok, proc), tok, cfg, encoder.config.max_tokens, rank, world)
    total = cfg.steps or cfg.epochs * batches.steps_per_epoch
    if total > MAX_STEPS:
        raise UserError(f"--epochs {cfg.epochs}: {total:,} steps of {batches.steps_per_epoch:,} per epoch; a run "
                        f"takes at most {MAX_STEPS:,} (pass --steps)", code=2)
    if resume_from and resume_from.step >= total and not restarted():
        raise UserError(f"{out}: the run is at step {resume_from.step} of {total}; pass --steps N (more than "
                        f"{resume_from.step}) to train it further")
    # Rank 0 locks the run folder and clears or trims it; the others wait for that, or stop with its error
    common.store_broadcast(proc.store, "run-folder-ready", lambda: common.prepare_run_folder(
        out, resume_from.step if resume_from else None) or "", maker=rank == 0)
    common.init_process_group(proc, cfg.ddp_timeout)
    opt = make_optimizer(encoder, cfg, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=common.autocast_dtype(cfg.dtype, device) == torch.float16)
    model = ChunkedEncoder(encoder, compile=cfg.compile)
    if world > 1:
        model = data_parallel(model, device, cfg)
    run = Run(cfg, out, encoder, model, tok, opt, scaler, batches, total, rank=rank, world=world)
    if resume_from:
        load_optimizer(opt, resume_from.state["optimizer"])
        if scaler.is_enabled() and "scaler" in resume_from.state:
            scaler.load_state_dict(resume_from.state["scaler"])
        run.step, run.best = resume_from.step, resume_from.state.get("best", -1.0)
        run.latest_checkpoint = resume_from.path
        common.say(f"resuming at step {run.step} from {run.latest_checkpoint}")
    if pairs:  # scored as embed.py would embed on this device (its --dtype auto)
        run.evaluate = functools.partial(evaluate_sts.spearman_of, encoder, tok, pairs,
                                         dtype=common.autocast_dtype("auto", device, cpu_bf16=True))
    common.say(f"training {cfg.model} on {world} process(es), {device.type}: {total} steps of {cfg.docs_per_step} "
               f"documents, {total / batches.steps_per_epoch:.1f} passes over its {len(batches.docs):,} documents")
    return run


def data_parallel(model: ChunkedEncoder, device: torch.device, cfg: TrainConfig) -> DDP:
    """DDP(ChunkedEncoder): gradients all-reduced in buckets during backward, on this rank's GPU (by its index) or the
    CPU; the MLM head is unused under --no-mlm."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, find_unused_parameters=not cfg.mlm)


def run_folder(cfg: TrainConfig, given: set, proc: common.Process):
    """(the run's configuration, its folder, the checkpoint it continues from or None). Deletes nothing. Rank 0
    decides where the run starts (its newest good checkpoint, or none); every other rank loads that same checkpoint
    from its own --out, or the whole run stops before its first step, every rank with the same line."""
    if not cfg.data and not cfg.resume:
        cfg = demo_config(cfg, given, proc)
    mine = {}  # rank 0's checkpoint, read while deciding

    def decide() -> str:
        out, mine["resume"] = start_point(cfg)
        return json.dumps({"out": str(out), "step": mine["resume"].step if mine["resume"] else None})

    decision = json.loads(common.store_broadcast(proc.store, "run-folder", decide, maker=proc.rank == 0))
    # Each machine its own --out (one shared folder, or one each); with none given, the one rank 0 chose
    cfg = replace(cfg, model=cfg.model or "distilroberta-base", out=cfg.out or decision["out"])
    out, step, resume_from, problem = Path(cfg.out), decision["step"], mine.get("resume"), ""
    if step is not None and proc.rank != 0:
        path = out / "checkpoints" / f"step-{step:08d}"
        try:
            if not path.is_dir():
                raise UserError(f"{path}: not there")
            resume_from = Resume(path, common.read_train_state(path), load_pretrained(str(path), quiet=True))
        except UserError as e:
            problem = (f"rank {proc.rank} on machine {proc.node} cannot resume at step {step} as rank 0 does ({e}): "
                       f"--out must be one folder that every machine sees, or hold a copy of rank 0's checkpoint")
    said = common.every_rank_says(proc.store, "resume-read", problem, proc.rank, proc.world)
    if problems := [p for p in said if p]:
        raise UserError(problems[0], code=2)
    return (resumed_config(cfg, given, resume_from), out, resume_from) if resume_from else (cfg, out, None)


def start_point(cfg: TrainConfig) -> tuple[Path, Resume | None]:
    """Where the run starts, as rank 0 sees it: (its folder, its newest good checkpoint or None)."""
    if cfg.resume and not cfg.out:  # the newest of the default run folders: `python train.py --resume` after the demo
        cfg = replace(cfg, out=str(max(DEFAULT_OUTS, key=lambda d: common.newest_mtime(Path(d)))))
    out = Path(cfg.out or DEFAULT_OUTS[0])
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder", code=2)
    common.lock_run_folder(out, probe=True)  # a run still training there: refused now, before any work
    if cfg.resume or restarted():
        found = common.newest_checkpoint(out, lambda path: load_pretrained(str(path), quiet=True))
        if found:
            return out, Resume(*found)
        if not restarted():
            raise UserError(f"{out}: no checkpoint to resume from")
    # An earlier run is a checkpoint or a model; a run that stopped before its first checkpoint left only its log
    earlier = common.checkpoints(out) or any((out / d).exists() for d in ("model", "best"))
    if earlier and not (cfg.overwrite or restarted()):  # a restart before the first checkpoint starts afresh
        raise UserError(f"{out} holds an earlier run; pass --resume to continue it or --overwrite to replace it")
    return out, None


DEFAULT_OUTS = ("runs/declutr", "runs/demo")


def restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun --max-restarts


def resumed_config(cfg: TrainConfig, given: set, resume_from: Resume) -> TrainConfig:
    """The stored configuration, with the flags of RESUMABLE that the command line gives."""
    names = {f.name for f in fields(TrainConfig)}
    stored = TrainConfig(**{k: v for k, v in resume_from.state["config"].items() if k in names})
    if restarted():  # torchrun's restart: the same command line as the run it continues
        return replace(stored, resume=True)
    # a flag given with the value the run already has changes nothing: only a different value is refused
    if refused := sorted(n for n in given & names - RESUMABLE if getattr(cfg, n) != getattr(stored, n)):
        name = refused[0]
        flag = ("--no-" if getattr(cfg, name) is False else "--") + name.replace("_", "-")
        raise UserError(f"{flag} cannot change when resuming {cfg.out}: the run goes on as it was configured "
                        f"({name} = {getattr(stored, name)!r}); start a new run in another --out instead", code=2)
    return replace(stored, **{**{k: getattr(cfg, k) for k in given & RESUMABLE}, "resume": True, "out": cfg.out})


def build_model(cfg: TrainConfig, proc: common.Process):
    """(encoder, tokenizer); a scratch model's BPE is trained on the run's own documents by rank 0, and the others
    take it from there."""
    if (shape := scratch(cfg.model)) is None:
        return load_pretrained(cfg.model)

    def train_bpe() -> str:
        texts = common.document_texts(cfg.data, clean=not cfg.keep_whitespace)
        return scratch_tokenizer(shape, texts, quiet=False).to_str()

    tok = Tokenizer.from_str(common.store_broadcast(proc.store, "tokenizer", train_bpe, maker=proc.rank == 0))
    return scratch_encoder(shape, tok.get_vocab_size(), cfg.seed), tok


def scratch(model: str) -> str | None:
    """The shape of --model scratch:SHAPE (a random-init encoder, model.SHAPES), or None for a pretrained one."""
    return model.removeprefix("scratch:") if model.startswith("scratch:") else None


def corpus_for_run(cfg: TrainConfig, tok, proc: common.Process) -> sampler.Corpus:
    """One process per machine tokenises; the others wait for it, then read its cache."""

    def prepare() -> str:
        clean = not cfg.keep_whitespace
        return str(sampler.prepare_corpus(cfg.data, tok, cfg.cache_dir, clean=clean).dir)

    return sampler.Corpus(Path(common.store_broadcast(proc.store, f"corpus/{proc.node}", prepare, proc.local == 0)))


# -----------------------------------------------------------------------------------------------
# The end of a run


def finish(run: Run):
    """The final model in out/model, and what to do with it."""
    save_pretrained(run.encoder, run.tok, run.out / "model")
    best = f", the best by STS-B dev ({run.best:.2f}) in {run.out / 'best'}" if run.best >= 0 else ""
    print(f"done: the model is in {run.out / 'model'}{best}")
    print(f"embed text with it:\n  printf 'A man is playing a guitar.\\nA woman is singing.\\n' | "
          f"python embed.py --model {run.out / 'model'} - --output {run.out / 'embeddings.npy'}")
    print(f"evaluate it on STS-B dev:\n  python evaluate_sts.py --model {run.out / 'model'} --split dev"
          f"   # downloads the STS Benchmark once; or --data FOLDER holding sts-dev.csv")


# -----------------------------------------------------------------------------------------------
# `python train.py` with no data: a demo that needs nothing but Python. These replace the flags not given.

DEMO = dict(model="scratch:tiny", out="runs/demo", steps=600, lr=1e-3, min_span=16, max_span=64, log_every=50,
            ckpt_every=200)


def demo_config(cfg: TrainConfig, given: set, proc: common.Process) -> TrainConfig:
    cfg = replace(cfg, **{k: v for k, v in DEMO.items() if k not in given})  # --lr 5e-5 is 5e-5, the default or not
    # written once on each machine, by one process
    folder = common.store_broadcast(proc.store, f"demo-corpus/{proc.node}",
                                    lambda: str(common.demo_corpus(cfg.cache_dir)), proc.local == 0)
    cfg = replace(cfg, data=[folder])
    common.say(f"no --data: the demo, {cfg.model} on Python's own documentation ({cfg.data[0]})")
    return cfg


if __name__ == "__main__":
    main()
