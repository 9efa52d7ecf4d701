"""
train.py: DeCLUTR's training loop: contrastive loss on sampled spans plus MLM, on CPUs and GPUs.

Paper §3 and §4: continue pretraining an encoder on unlabelled documents with NT-Xent over anchors
and positives (loss.py) sampled from the same documents (sampler.py), plus masked language modelling
on the anchors in the same forward pass; AdamW (lr 5e-5, weight decay 0.1 except biases and
LayerNorms, eps 1e-6), a slanted triangular schedule (cut_frac 0.1, ratio 32), gradients clipped to
norm 1.0, N=16 documents a step. Read from the top: the config, one step and what it is made of, the
schedule and optimiser, the loop, then the set-up; processes, the run folder, checkpoints and how a
run starts and stops are support/'s.

    python train.py                          # the demo: a tiny model learns from Python's own docs
    python train.py --model scratch:tiny --data docs/ --steps 200 --lr 1e-3 --out runs/tiny
    python train.py --model distilroberta-base --data docs/ --out runs/declutr-small
    torchrun --nproc_per_node=4 train.py --model distilroberta-base --data owt/ --out runs/small
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        --rdzv-id=run1 train.py --model roberta-base --data owt/ --out runs/declutr-base
    python train.py --out runs/declutr-small --resume    # continue from the newest checkpoint
"""
import contextlib
import math
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import evaluate_sts
import sampler
from embed import encode, max_seq_length
from loss import nt_xent
from model import Packing, load_pretrained, mean_pool, save_pretrained, scratch_encoder
from support import cpu_layers, demo, device, metrics, runs, stopping
from support.chunks import Chunks
from support.cli import UserError, cli, flag, given_fields, parse_config
from support.corpus import describe_files
from support.processes import Process, corpus_for_run, eval_documents, processes
from support.sts_files import load_stsb_dev
from support.threads import cpu_threads
from support.training import Run, evaluation, model_for_run

NO_SCALING = torch.amp.GradScaler("cpu", enabled=False)  # a loss scale that does nothing (not fp16)
MAX_STEPS = 10**7  # a month of steps at a quarter of a second each: more is a typo, not a run


@dataclass
class TrainConfig(sampler.SamplerConfig, runs.RunConfig):  # + the spans' and the run's settings
    # §3.2-3.3 and §4: the paper's hyperparameters
    temperature: float = flag(0.05, "tau of NT-Xent", low=0, high=10, strict=True)
    mlm: bool = flag(True, "--no-mlm: contrastive only (the paper's Fig. 3 ablation)")
    contrastive: bool = flag(True, "--no-contrastive: MLM only")
    lr: float = flag(5e-5, "AdamW's peak learning rate", low=0, high=1, strict=True)
    weight_decay: float = flag(0.1, "AdamW's; not on biases and LayerNorms", low=0, high=1)
    warmup_frac: float = flag(0.1, "slanted triangular cut_frac", low=0, high=1)
    lr_ratio: float = flag(32.0, "slanted triangular: lowest lr is lr / ratio", low=1, high=1e6)
    max_grad_norm: float = flag(1.0, "gradients clipped to this norm", low=0, high=1e6, strict=True)
    steps: int = flag(0, "optimiser steps; 0: --epochs passes", low=0, high=MAX_STEPS)
    epochs: int = flag(1, "passes over the documents, when --steps is 0", low=1, high=10**6)
    # How a step runs: the same gradient, in less time or memory
    dtype: str = flag("auto", "auto: CPU fp32; GPU bf16, or fp16 (loss-scaled) without it",
                      choices=("auto", "fp32", "bf16", "fp16"))
    chunk_tokens: int = flag(16384, "padded tokens a chunk of spans holds at most", low=1)
    grad_cache: bool = flag(False, "GradCache: the chunks' graphs one at a time, not all at once")
    compile: bool = flag(False, "torch.compile a chunk's forward: encoder, pooling, MLM head")

    def validate(self):
        sampler.SamplerConfig.validate(self)
        runs.RunConfig.validate(self)
        if self.compile:
            device.check_compile()
        if not (self.mlm or self.contrastive):
            raise UserError("--no-mlm and --no-contrastive together leave nothing to train", code=2)
        if self.contrastive and self.docs_per_step * self.num_anchors < 2:
            raise UserError(f"--docs-per-step {self.docs_per_step} with --num-anchors "
                            f"{self.num_anchors}: the contrastive loss needs at least 2 anchors a "
                            f"step, or it has no negative", code=2)
        if (shape := demo.scratch_name(self.model)) is not None:
            demo.scratch_shape(shape, "--model scratch:")


# -----------------------------------------------------------------------------------------------
# One step (§3): embed every span, NT-Xent between each anchor and its positives, MLM on the
# anchors, one backward


def train_step(model, batch, cfg: TrainConfig, world: int = 1, scaler=NO_SCALING) -> dict:
    """Forward and backward of this rank's documents; leaves the step's gradient in .grad. `model`
    is ChunkedEncoder(encoder), under torchrun inside the DDP that setup() wraps it in."""
    encoder = unwrap(model).encoder
    dev = next(encoder.parameters()).device
    # §3.3: the anchors go in MLM-corrupted: their masked tokens are predicted from the forward
    # that embeds them
    anchors = batch["mlm_inputs"] if cfg.mlm else batch["anchors"]
    # §3.2: the positives serve the contrastive loss alone; MLM alone needs none
    n_anchors = len(anchors)
    P = cfg.num_positives if cfg.contrastive else 0
    positives = batch["positives"][:n_anchors * P]
    positive_lengths = batch["positive_lengths"][:n_anchors * P]
    # One list of spans, the A·N anchors first, then the P positives of each anchor in turn, cut
    # into chunks within a token budget; on a CPU of similar length, so that a 40-token positive
    # never waits on a 500-token anchor (support/chunks.py; on a GPU a chunk more costs more)
    chunks = Chunks(groups=[(anchors, batch["anchor_lengths"]), (positives, positive_lengths)],
                    mlm_labels=batch["mlm_labels"] if cfg.mlm else None, budget=cfg.chunk_tokens,
                    device=dev, pad_id=encoder.config.pad_token_id)
    # What the chunks run in: autocast in --dtype's precision (CPU fp32, GPU bf16), and the
    # attention kernels support/device.py allows (flash, memory-efficient, math; never cuDNN's)
    precision = device.compute(device.autocast_dtype(cfg.dtype, dev), dev)
    # §3.3: MLM is a mean over the masked tokens of every rank's anchors: one count for the step.
    # Under torchrun a step has three all-reduces besides DDP's gradients and the gather's
    # (loss.py): this count, the MLM loss the log reports (metrics.step_losses), and the ranks'
    # agreement to stop (support/stopping.agreed_stop)
    mlm_weight = mlm_mean_weight(chunks.n_masked, world, dev)
    if cfg.grad_cache:
        return grad_cache_step(model, chunks, precision, n_anchors=n_anchors, P=P,
                               mlm_weight=mlm_weight, temperature=cfg.temperature,
                               with_mlm=cfg.mlm, world=world, scaler=scaler)
    # §3.1: every span's mean-pooled embedding, in the batch's order; §3.3: the anchors' MLM loss,
    # the same forward. With --no-mlm the MLM head takes no part in it, which DDP is told (setup())
    with precision:
        emb, mlm = model(chunks.inputs, chunks.unsort, with_mlm=cfg.mlm, mlm_weight=mlm_weight)
    # §3.2: NT-Xent between each anchor and the mean of its P positives, all else negatives
    contrastive = contrastive_loss(emb, n_anchors, P, cfg.temperature)  # emb: (S, H)
    # One objective, one backward. Under torchrun DDP averages the ranks' gradients, and that
    # average is exactly the gradient of one process holding the whole batch: the contrastive loss
    # is the same on every rank, over every rank's embeddings, and the gather's backward sums each
    # embedding's gradient over the ranks (loss.py); the MLM term is weighted by world over all
    # ranks' masked tokens (mlm_mean_weight)
    scaler.scale(contrastive + mlm).backward()
    return metrics.step_losses(contrastive, mlm, int(chunks.lengths.sum()), world, cfg.mlm)


# -----------------------------------------------------------------------------------------------
# The step's forward, chunk by chunk: the encoder, the pooling (§3.1) and the MLM head (§3.3) in
# one pass


def chunk_forward(encoder, ids, mask, positions, masked_at, masked_ids):
    """One chunk of g spans (support.chunks.Chunk: ids and mask (g, T); positions (n,), the real
    tokens' flat places; masked_at, masked_ids (K,), or None: no MLM) -> embeddings (g, H), summed
    MLM loss. What --compile compiles: the encoder, the pooling and the MLM head in one graph."""
    h = encoder(ids, mask, Packing(*ids.shape, positions, mask))  # (g, T, H)
    # §3.1: a span's embedding is the mean of its token states
    emb = mean_pool(h, mask).float()  # (g, H)
    if masked_at is None:
        return emb, emb.new_zeros(())
    # §3.3: the MLM head on the K masked tokens only, from the same forward pass
    logits = encoder.mlm_logits(h.flatten(0, 1)[masked_at])  # (K, V)
    return emb, F.cross_entropy(logits.float(), masked_ids, reduction="sum")


class ChunkedEncoder(nn.Module):
    """The encoder over several chunks of spans in one forward. Under DDP a step is then one forward
    and one backward, during which DDP all-reduces the gradients in buckets as they become ready."""

    def __init__(self, encoder, compile: bool = False):
        super().__init__()
        self.encoder = encoder
        # --compile: torch.compile with dynamic shapes, one graph for chunks of every shape
        # (dynamo's duck sizing off, a process-wide setting: support/device.py's compiled)
        self.chunk_forward = device.compiled(chunk_forward) if compile else chunk_forward

    def forward(self, inputs, unsort=None, *, with_mlm: bool = False, mlm_weight=None):
        """inputs: the chunks' (support.chunks.Chunk) -> (S, H) embeddings, in the batch's order
        where `unsort` gives it, and the MLM loss: each chunk's sum times mlm_weight (0 without)."""
        outs = [self.chunk_forward(self.encoder, *(c if with_mlm else c._replace(masked_at=None)))
                for c in inputs]
        emb = torch.cat([e for e, _ in outs])  # (S, H)
        mlm = sum(m * mlm_weight for _, m in outs) if with_mlm else emb.new_zeros(())
        return (emb if unsort is None else emb[unsort]), mlm


def contrastive_loss(emb, n_anchors: int, P: int, temperature: float):
    """NT-Xent over the first n_anchors rows of emb (S, H) and, after them, each anchor's P
    positives in turn."""
    if P == 0:
        return emb.new_zeros(())
    anchors, positives = emb[:n_anchors], emb[n_anchors:]
    return nt_xent(anchors, positives.view(n_anchors, P, -1), temperature)  # (n, d), (n, P, d)


def mlm_mean_weight(n_masked: int, world: int, dev) -> torch.Tensor:
    """What this rank's summed MLM loss is multiplied by to make the global mean: 1 / the masked
    tokens of every rank, times world, as DDP averages the gradients over ranks."""
    count = device.to_device(np.asarray(n_masked, dtype=np.float32), dev)
    if world > 1:
        dist.all_reduce(count)
    return world / count.clamp(min=1)


def unwrap(model) -> ChunkedEncoder:  # the ChunkedEncoder itself, also from inside setup()'s DDP
    return model.module if isinstance(model, DDP) else model


def grad_cache_step(model, chunks: Chunks, precision, *, n_anchors: int, P: int, mlm_weight,
                    temperature: float, with_mlm: bool, world: int = 1, scaler=NO_SCALING) -> dict:
    """GradCache (Gao et al., 2021): train_step for a batch larger than memory, with the same
    gradient. `precision`: what the chunks run in (train_step's)."""
    # 1. Every chunk's embeddings without a graph (round DDP, whose hooks belong to a backward), and
    # the random state its dropout starts from
    states, embs = [], []
    with torch.no_grad(), precision:
        for chunk in chunks.inputs:
            states.append(device.rng_state(chunks.device))
            embs.append(unwrap(model)([chunk])[0])
    # 2. The contrastive loss of the whole batch, and its gradient with respect to every embedding;
    # chunk k's rows of it
    emb = torch.cat(embs)[chunks.unsort].requires_grad_()  # (S, H)
    contrastive = contrastive_loss(emb, n_anchors, P, temperature)
    grad = torch.autograd.grad(contrastive, emb)[0] if P else torch.zeros_like(emb)
    grads = grad[chunks.sort].split([len(rows) for rows in chunks.rows])
    # 3. Each chunk again, with a graph and the same dropout, backpropagating its rows of that
    # gradient (and its MLM): the chain rule through the embeddings, one chunk in memory at a time.
    # DDP all-reduces in the last backward only, where every parameter must take part: a chunk with
    # anchors (which use the MLM head) goes last.
    def has_anchors(k):
        return bool((chunks.rows[k] < n_anchors).any())

    backward_order = sorted(range(len(chunks.inputs)), key=has_anchors)
    mlm = torch.zeros((), device=chunks.device)
    for i, k in enumerate(backward_order):
        device.set_rng_state(states[k], chunks.device)
        with accumulate_locally(model, i < len(backward_order) - 1):
            with precision:
                e, m = model([chunks.inputs[k]], with_mlm=with_mlm, mlm_weight=mlm_weight)
            scaler.scale((e * grads[k]).sum() + m).backward()
        mlm = mlm + m.detach()
    return metrics.step_losses(contrastive, mlm, int(chunks.lengths.sum()), world, with_mlm)


def accumulate_locally(model, local: bool):
    """DDP's no_sync: this backward accumulates its gradients here; the step's last one all-reduces
    them all."""
    return model.no_sync() if local and isinstance(model, DDP) else contextlib.nullcontext()


# -----------------------------------------------------------------------------------------------
# The schedule and the optimiser (§4)


def lr_at(step: int, total: int, lr: float, cut_frac: float, ratio: float) -> float:
    """Slanted triangular (Howard & Ruder, 2018): a short linear rise over cut_frac of the steps, a
    long fall to lr / ratio."""
    cut = max(1, math.floor(total * cut_frac))
    p = step / cut if step < cut else 1 - (step - cut) / max(1, total - cut)
    return lr * (1 + p * (ratio - 1)) / ratio


def make_optimizer(encoder, lr: float, weight_decay: float, fused: bool):
    """AdamW with eps 1e-6, as the original; no weight decay on biases and LayerNorms (the 1-d
    parameters)."""
    decay = [p for p in encoder.parameters() if p.dim() >= 2]
    rest = [p for p in encoder.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, eps=1e-6, fused=fused or None)


def optimizer_step(opt, scaler, encoder, max_norm: float) -> torch.Tensor:
    """Clip the gradient to max_norm and step; returns its norm, on the device. fp16: the loss scale
    comes out first, and a step whose gradient overflowed is skipped, with a smaller scale for the
    next."""
    scaler.unscale_(opt)
    gnorm = torch.nn.utils.clip_grad_norm_(encoder.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return gnorm


# -----------------------------------------------------------------------------------------------
# The loop (§4): the run (support/training.py) logs each step, evaluates, checkpoints, and stops
# where it is told


def train(run: Run):
    cfg = run.cfg
    for batch in run.steps():
        # Out of memory, or a rank gone: one line, the last checkpoint as it was
        with run.failures():
            # The slanted triangular schedule sets this step's learning rate
            lr = lr_at(run.step, run.total, cfg.lr, cfg.warmup_frac, cfg.lr_ratio)
            for g in run.opt.param_groups:
                g["lr"] = lr
            # Dropout draws from the global generator, seeded from (seed, rank, step): a resumed run
            # replays exactly
            seeds = np.random.SeedSequence([cfg.seed, run.proc.rank, run.step])
            torch.manual_seed(int(seeds.generate_state(1)[0]))
            # Forward and backward of this rank's documents
            stats = train_step(run.model, batch, cfg, run.proc.world, run.scaler)
            # Every rank holds the same gradient (DDP's average), clipped to --max-grad-norm (the
            # paper's 1.0), and takes the same update; each checkpoint re-syncs weights that drifted
            gnorm = optimizer_step(run.opt, run.scaler, run.encoder, cfg.max_grad_norm)
        run.after_step(lr, stats, gnorm)


@cli
def main(argv=None):
    cfg = parse_config(TrainConfig, argv, __doc__.split("\n\n")[0])
    # Ctrl-C and SIGTERM end the run with one line, SIGTERM once the step under way is checkpointed
    # (support/stopping.py owns the handler); the CPU threads as they were afterwards
    with stopping.lifetime() as life, cpu_threads(cfg.threads):
        run = life.watch(setup(cfg, given_fields(TrainConfig, argv), processes()))
        train(run)
        run.finish()


# -----------------------------------------------------------------------------------------------
# Setting a run up: the model, the data, the optimiser, every process in its place (support/runs.py,
# support/processes.py; how a run stops: support/stopping.py)


def setup(cfg: TrainConfig, given: set, proc: Process) -> Run:
    """Everything is checked (flags, evaluation data, model, documents) before an earlier run is
    replaced, and all that may take long (a tokenizer, the corpus) is ready before the process group
    exists, whose collectives may wait only --ddp-timeout seconds."""
    cfg, out, resume_from = runs.run_folder(cfg, given, proc, partial(load_pretrained, quiet=True))
    pairs = load_stsb_dev(cfg.eval_data) if cfg.eval_data else None  # a bad path stops the run now
    # The model: the checkpoint's, a pretrained one, or a random-init shape whose BPE rank 0 trains
    # on the documents
    encoder, tok = model_for_run(cfg, proc, resume_from, load_pretrained=load_pretrained,
                                 make_encoder=scratch_encoder)
    encoder.to(proc.device).train()
    # On a CPU, short rows' attention written out (support/cpu_layers.py): the evaluation's, and
    # ModernBERT's in training too, as it has no attention dropout
    cpu_layers.short_rows(encoder)
    corpus = corpus_for_run(cfg, tok, proc)
    # --holdout-docs' or --eval-docs' documents, or None (a resumed run keeps the ones it had)
    held = eval_documents(cfg, tok, proc, corpus, resume_from.state if resume_from else None)
    batches = sampler.SpanBatches(corpus, tok, cfg, encoder.config.max_tokens, rank=proc.rank,
                                  world_size=proc.world, held_out=held.held_out if held else ())
    opt = make_optimizer(encoder, cfg.lr, cfg.weight_decay, fused=proc.device.type == "cuda")
    # On an Ampere or later GPU, fp32's products in TF32 (inputs rounded to 10 bits, sums in fp32):
    # several times faster; loss.py's similarities, which bf16 autocast leaves in fp32, too
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    fp16 = device.autocast_dtype(cfg.dtype, proc.device) == torch.float16
    run = Run(cfg=cfg, out=out, model=ChunkedEncoder(encoder, compile=cfg.compile), encoder=encoder,
              tok=tok, opt=opt, scaler=torch.amp.GradScaler(proc.device.type, enabled=fp16),
              batches=batches, total=cfg.steps or cfg.epochs * batches.steps_per_epoch,
              save_model=save_pretrained, proc=proc, documents=describe_files(cfg.data, corpus),
              held_out_below=held.below if held else None)
    # STS-B dev and held-out span retrieval, each where the run has it, embedded as embed.py does
    evaluate = evaluation(run, held, pairs, encode=encode, spearman_of=evaluate_sts.spearman_of,
                          span_lengths=evaluate_sts.span_lengths(max_seq_length(encoder)))
    # The process group comes up here (support/runs.py)
    run.begin(resume_from, evaluate,
              partial(lr_at, lr=cfg.lr, cut_frac=cfg.warmup_frac, ratio=cfg.lr_ratio), MAX_STEPS)
    if proc.world > 1:
        # Every rank's gradients averaged in buckets during backward, on this rank's GPU (by its
        # index) or the CPU. With --no-mlm the MLM head takes no part in a step: DDP must be told
        # (find_unused_parameters), or the next step fails for the head's gradients, never reduced
        run.model = DDP(run.model, device_ids=proc.device_ids, find_unused_parameters=not cfg.mlm)
    return run


if __name__ == "__main__":
    main()
