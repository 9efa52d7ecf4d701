"""
train.py: DeCLUTR's training loop. Contrastive loss on sampled spans plus MLM, on a CPU, a GPU, or many.

Paper §3 and §4: continue pretraining an encoder on unlabelled documents with NT-Xent over anchors and
positives (loss.py) sampled from the same documents (sampler.py), plus masked language modelling on the
anchors in the same forward pass; AdamW (lr 5e-5, weight decay 0.1 except biases and LayerNorms, eps 1e-6),
a slanted triangular schedule (cut_frac 0.1, ratio 32), gradients clipped to norm 1.0, N=16 documents a step.
Read from the top: the config, one step and what it is made of, the schedule and optimiser, the loop, then the
set-up; processes, the run folder, checkpoints and how a run starts and stops are support/'s.

    python train.py                                   # the demo: a tiny model learns from Python's own docs, ~2 min
    python train.py --model scratch:tiny --data docs/ --steps 200 --lr 1e-3 --out runs/tiny
    python train.py --model distilroberta-base --data docs/ --out runs/declutr-small
    torchrun --nproc_per_node=4 train.py --model distilroberta-base --data owt/ --out runs/declutr-small
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=run1 \\
        train.py --model roberta-base --data owt/ --out runs/declutr-base
    python train.py --out runs/declutr-small --resume          # continue from the newest checkpoint
"""
import contextlib
import functools
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch.nn.parallel import DistributedDataParallel as DDP

import evaluate_sts
import sampler
from loss import nt_xent
from model import (
    load_pretrained,
    mean_pool,
    save_pretrained,
    scratch_encoder,
    scratch_name,
    scratch_shape,
    scratch_tokenizer,
)
from support import card, demo, device, metrics, runs, stopping
from support.chunks import Spans
from support.cli import UserError, cli, flag, given_fields, parse_config
from support.corpus import document_texts
from support.device import autocast_dtype, cpu_threads, rng_state, set_rng_state, to_device
from support.processes import Process, corpus_for_run, data_parallel, made_once, processes

DISABLED = torch.amp.GradScaler("cpu", enabled=False)  # fp16's loss scale is off in every other precision
MAX_STEPS = 10**7  # a month of steps at a quarter of a second each: more is a typo, not a run


@dataclass
class TrainConfig(sampler.SamplerConfig, runs.RunConfig):  # and the spans' (sampler.py), the run's (support)
    # §3.2-3.3 and §4: the paper's hyperparameters
    temperature: float = flag(0.05, "tau of NT-Xent", low=0, high=10, strict=True)
    mlm: bool = flag(True, "--no-mlm: contrastive only (the paper's Fig. 3 ablation)")
    contrastive: bool = flag(True, "--no-contrastive: MLM only")
    lr: float = flag(5e-5, "AdamW's peak learning rate", low=0, high=1, strict=True)
    weight_decay: float = flag(0.1, "AdamW's, decoupled; not on biases and LayerNorms", low=0, high=1)
    warmup_frac: float = flag(0.1, "slanted triangular cut_frac", low=0, high=1)
    lr_ratio: float = flag(32.0, "slanted triangular: lowest lr is lr / ratio", low=1, high=1e6)
    max_grad_norm: float = flag(1.0, "gradients clipped to this norm", low=0, high=1e6, strict=True)
    steps: int = flag(0, "optimiser steps; 0: --epochs passes over the documents", low=0, high=MAX_STEPS)
    epochs: int = flag(1, "passes over the documents, when --steps is 0", low=1, high=10**6)
    # How a step runs: the same gradient, in less time or memory
    dtype: str = flag("auto", "auto: CPU fp32; GPU bf16, or fp16 (loss-scaled) without it",
                      choices=("auto", "fp32", "bf16", "fp16"))
    chunk_tokens: int = flag(16384, "spans run in length-sorted chunks of at most this many padded tokens", low=1)
    grad_cache: bool = flag(False, "GradCache: chunks forward without a graph, then backward chunk by chunk")
    compile: bool = flag(False, "torch.compile each chunk's forward: the encoder, pooling and the MLM head")

    def validate(self):
        sampler.SamplerConfig.validate(self)
        runs.RunConfig.validate(self)
        if not (self.mlm or self.contrastive):
            raise UserError("--no-mlm and --no-contrastive together leave nothing to train", code=2)
        if self.contrastive and self.docs_per_step * self.num_anchors < 2:
            raise UserError(f"--docs-per-step {self.docs_per_step} with --num-anchors {self.num_anchors}: the "
                            f"contrastive loss needs at least 2 anchors a step, or it has no negative", code=2)
        if (shape := scratch_name(self.model)) is not None:
            scratch_shape(shape, "--model scratch:")
        if self.compile:
            device.check_compile()


# Flags that --resume takes from the command line, as they do not change the model's trajectory; any other is refused
RESUMABLE = runs.RESUMABLE | {"steps", "epochs", "cache_dir"}


# -----------------------------------------------------------------------------------------------
# One step (§3): embed every span, NT-Xent between anchors and their positives, MLM on the anchors, one backward.
# The spans come cut into chunks of similar length (support/chunks.py: each chunk's ids, mask, real-token positions
# and MLM targets), so that a 40-token positive never waits on a 500-token anchor; the encoder runs them all in one
# forward (ChunkedEncoder, below), and what comes out is one embedding per span, as if the batch had run whole.


def train_step(model, batch, cfg: TrainConfig, world: int = 1, scaler=DISABLED) -> dict:
    """Forward and backward of this rank's documents; leaves the step's gradient in .grad. `model` is
    ChunkedEncoder(encoder), under torchrun in the DDP that setup() builds (DDP averages the gradients)."""
    # The spans in chunks of similar length, each chunk's inputs on the device (support/chunks.py)
    spans = Spans(batch, cfg, unwrap(model).encoder)
    # §3.3: MLM is a mean over the masked tokens of every rank's anchors: one count for the step
    mlm_weight = mlm_mean_weight(spans.n_masked, world, spans.device)
    if cfg.grad_cache:
        return grad_cache_step(model, spans, mlm_weight, cfg, world, scaler)
    # §3.1: every span's mean-pooled embedding, and §3.3: each chunk's summed MLM loss of the anchors' masked tokens
    with spans.compute:
        emb, mlm_sums = model(spans.chunks)  # (S, H) in the chunks' order, a scalar a chunk
    # Back to the batch's order: the A·N anchors, then the P positives of each anchor in turn
    emb = emb[spans.unsort]
    # §3.2: NT-Xent between each anchor and the mean of its positives, every other span a negative
    contrastive = contrastive_loss(emb, spans.n_anchors, cfg)
    # §3.3: one objective, contrastive plus the MLM mean, one backward
    mlm = sum(m * mlm_weight for m in mlm_sums)
    scaler.scale(contrastive + mlm).backward()
    return step_stats(spans, contrastive, mlm, world)


def contrastive_loss(emb, n_anchors: int, cfg: TrainConfig):
    if not cfg.contrastive:
        return emb.new_zeros(())
    anchors, positives = emb[:n_anchors], emb[n_anchors:]
    return nt_xent(anchors, positives.view(n_anchors, cfg.num_positives, -1), cfg.temperature)  # (M, d), (M, P, d)


def mlm_mean_weight(n_masked: int, world: int, device) -> torch.Tensor:
    """What this rank's summed MLM loss is multiplied by to make the global mean: 1 / the masked tokens of every
    rank, times world, as DDP averages the gradients over ranks."""
    count = to_device(np.asarray(n_masked, dtype=np.float32), device)
    if world > 1:
        dist.all_reduce(count)
    return world / count.clamp(min=1)


def step_stats(spans, contrastive, mlm, world: int) -> dict:
    """The step's losses for the log, left on the device (the loop reads them once): contrastive (the same on every
    rank) and MLM averaged over ranks."""
    mlm_log = mlm.detach() / world if spans.mlm else torch.zeros((), device=spans.device)
    if world > 1:
        dist.all_reduce(mlm_log)
    return dict(tokens=int(spans.lengths.sum()), contrastive=contrastive.detach(), mlm=mlm_log)


def chunk_forward(encoder, ids, mask, positions, mlm_at, mlm_targets):
    """One chunk of spans -> their embeddings (g, H) and the summed MLM loss of the anchors' masked tokens among them.
    What --compile compiles: the encoder, the pooling and the MLM head in one graph."""
    h = encoder(ids, mask, positions)  # (g, T, H)
    # §3.1: a span's embedding is the mean of its token states
    emb = mean_pool(h, mask).float()  # (g, H)
    if mlm_at is None:
        return emb, emb.new_zeros(())
    # §3.3: the MLM head on the K masked tokens only, from the same forward pass
    logits = encoder.mlm_logits(h.flatten(0, 1)[mlm_at])  # (K, V)
    return emb, F.cross_entropy(logits.float(), mlm_targets, reduction="sum")


class ChunkedEncoder(nn.Module):
    """The encoder over several chunks of spans in one forward. Under DDP a step is then one forward and one
    backward, during which DDP all-reduces the gradients in buckets as they become ready."""

    def __init__(self, encoder, compile: bool = False):
        super().__init__()
        self.encoder = encoder
        self.chunk_forward = device.compiled(chunk_forward) if compile else chunk_forward

    def forward(self, chunks):
        outs = [self.chunk_forward(self.encoder, *chunk) for chunk in chunks]
        return torch.cat([e for e, _ in outs]), [m for _, m in outs]  # (S, H) in the chunks' order, MLM sums


def unwrap(model) -> ChunkedEncoder:  # the ChunkedEncoder itself, also from inside setup()'s DDP
    return model.module if isinstance(model, DDP) else model


def grad_cache_step(model, spans: Spans, mlm_weight, cfg: TrainConfig, world: int = 1, scaler=DISABLED) -> dict:
    """GradCache (Gao et al., 2021): the step above for a batch larger than memory, with the same gradient."""
    # 1. Every chunk's embeddings without a graph, remembering the RNG state (dropout) each chunk started from
    states, embs, inner = [], [], unwrap(model)
    with torch.no_grad(), spans.compute:
        for chunk in spans.chunks:
            states.append(rng_state(spans.device))
            embs.append(inner.chunk_forward(inner.encoder, *chunk._replace(mlm_at=None))[0])
    # 2. The loss on the whole batch, and its gradient with respect to each embedding, back in the chunks' order
    emb = torch.cat(embs)[spans.unsort].requires_grad_()
    contrastive = contrastive_loss(emb, spans.n_anchors, cfg)
    grad = torch.autograd.grad(contrastive, emb)[0] if cfg.contrastive else torch.zeros_like(emb)
    grad = grad[spans.order]
    starts = np.cumsum([0] + [len(rows) for rows in spans.rows])  # chunk k's rows of `grad`: starts[k]:starts[k + 1]
    # 3. Each chunk again with a graph and the same dropout masks, backpropagating its cached gradient (and MLM):
    # the chain rule through the embeddings, one chunk in memory at a time. DDP all-reduces in the last backward
    # only, where every parameter must take part: a chunk with anchors (and so the MLM head) goes last.
    order = sorted(range(len(spans.rows)), key=lambda k: bool((spans.rows[k] < spans.n_anchors).any()))
    mlm = torch.zeros((), device=spans.device)
    for i, k in enumerate(order):
        set_rng_state(states[k], spans.device)
        with accumulate_locally(model, i < len(order) - 1):
            with spans.compute:
                e, (m,) = model([spans.chunks[k]])
            m = m * mlm_weight
            scaler.scale((e * grad[starts[k]:starts[k + 1]]).sum() + m).backward()
        mlm = mlm + m.detach()
    return step_stats(spans, contrastive, mlm, world)


def accumulate_locally(model, local: bool):
    """DDP's no_sync: this backward accumulates its gradients here; the step's last one all-reduces them all."""
    return model.no_sync() if local and isinstance(model, DDP) else contextlib.nullcontext()


# -----------------------------------------------------------------------------------------------
# The schedule and the optimiser (§4)


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


@dataclass
class Run:
    """Everything the loop reads and advances."""
    cfg: TrainConfig
    out: Path
    model: nn.Module  # what train_step runs: ChunkedEncoder(encoder) (compiled with --compile), in DDP under torchrun
    encoder: nn.Module  # the model.Encoder inside it, which checkpoints save
    tok: object
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16's loss scale; disabled (a no-op) in every other precision
    batches: sampler.SpanBatches
    total: int  # the run's steps
    proc: Process = field(default_factory=lambda: Process(0, 0, 1, torch.device("cpu")))  # rank, world, device
    step: int = 0
    best: float = -1.0
    latest_checkpoint: Path | None = None  # the newest checkpoint
    machines: list = field(default_factory=list)  # where its steps ran, for the model card (support/runs.machines)
    log: metrics.Log | None = None  # metrics.jsonl and the lines on stdout (TensorBoard's too), while the loop runs
    evaluate: object = None  # () -> STS-B dev Spearman, with --eval-data
    loader: object = None  # the batches' iterator, while the loop runs
    stop: stopping.StopOnSigterm = field(default_factory=stopping.StopOnSigterm)  # SIGTERM: stop after this step

    def close(self):
        """However the run ends: the loader's workers ended now, and DDP, which holds the process group, let go of."""
        if self.loader is not None:
            self.loader.close()
        if self.log is not None:
            self.log.close()
        self.model = self.loader = self.log = None


def train(run: Run):
    """§4: one step per batch, with the schedule, clipping, logs, evaluation and checkpoints."""
    cfg, run.stop.training = run.cfg, True
    run.log = metrics.Log(run, cfg.log_every, cfg.tensorboard)  # lifetime() closes it
    if run.evaluate and run.step == 0 and run.proc.rank == 0:  # the start's score, which the run's are read against
        run.log.write({"step": 0, "stsb_dev_spearman": run.evaluate()})
    run.loader = sampler.make_loader(run.batches, run.step, run.total, cfg.workers)  # lifetime() closes it
    before = None  # the step before: its numbers are read once this one is on its way, so the GPU never waits on them
    for batch in run.loader:
        with stopping.failures_are_one_line(run):
            this = take_step(run, batch)
            stop = before is not None and log_step(run, before)
            before = this
            saved = run.step % cfg.ckpt_every == 0 or run.step == run.total
            evaluated = run.evaluate and (cfg.eval_every and run.step % cfg.eval_every == 0 or run.step == run.total)
            if stop or saved or evaluated:  # each needs this step's weights and numbers: the host waits for them here
                stop = log_step(run, this, evaluated) or stop
                before = None
                if stop or saved:
                    save_checkpoint(run)
        if stop and run.step < run.total:
            raise stopping.Terminated
    if cfg.compile:
        device.say_compiled()


def take_step(run: Run, batch) -> metrics.Figures:
    """One optimiser step, launched: on a GPU the host goes on while it runs. Returns its numbers, on their way."""
    cfg, rank, world = run.cfg, run.proc.rank, run.proc.world
    # The slanted triangular schedule sets this step's learning rate
    lr = lr_at(run.step, run.total, cfg)
    for g in run.opt.param_groups:
        g["lr"] = lr
    # Dropout draws from the global generator, seeded from (seed, rank, step): a resumed run replays exactly
    torch.manual_seed(int(np.random.SeedSequence([cfg.seed, rank, run.step]).generate_state(1)[0]))
    # Forward and backward of this rank's documents
    stats = train_step(run.model, batch, cfg, world, run.scaler)
    # Every rank holds the same gradient (DDP's average), clipped to norm 1.0, and takes the same update
    gnorm = optimizer_step(run.opt, run.scaler, run.encoder, cfg.max_grad_norm)
    # SIGTERM: every rank stops after the same step, the first any of them was told to stop at
    stop = stopping.agreed_stop(run, gnorm.device)
    run.step += 1
    return metrics.Figures(run.step, lr, stats["tokens"] * world, stats["contrastive"], stats["mlm"], gnorm, stop)


def log_step(run: Run, figures: metrics.Figures, evaluate: bool = False) -> bool:
    """A step's numbers into metrics.jsonl (rank 0), with its STS-B dev score where it is evaluated; whether the
    ranks agreed to stop after it."""
    contrastive, mlm, gnorm, stop = figures.read()
    stopping.check_finite(run, contrastive + mlm, figures.step)
    rec = run.log.record(figures.step, figures.lr, contrastive, mlm, gnorm, figures.tokens)
    if evaluate:
        score_and_keep_best(run, rec)
    if run.proc.rank == 0:  # every step into out/metrics.jsonl, every --log-every steps a line
        run.log.write(rec)
    return bool(stop)


def score_and_keep_best(run: Run, rec: dict):
    """STS-B dev Spearman into the record (rank 0), and the best model so far kept in out/best."""
    rec["stsb_dev_spearman"] = run.evaluate() if run.proc.rank == 0 else None  # dropout off (embed.encode's)
    if run.proc.rank == 0 and rec["stsb_dev_spearman"] > run.best:
        run.best = rec["stsb_dev_spearman"]
        hand_over(run, run.out / "best", [*metrics.read_metrics(run.out), rec], best=True)


def hand_over(run: Run, folder: Path, records: list[dict], best: bool = False):
    """A model folder the run hands over (out/model, out/best): the weights in Hugging Face layout, and the model card
    (README.md) of what the run did to them, from its config and metrics.jsonl (support/card.py)."""
    save_pretrained(run.encoder, run.tok, folder)
    card.write_card(folder, run.cfg, records, run.machines, len(run.batches.docs), run.total, best)


def save_checkpoint(run: Run):
    """out/checkpoints/step-NNNNNNNN, written by rank 0 while the others wait: the model in Hugging Face layout, and
    train_state.pt (optimizer, step, config)."""
    if run.proc.rank == 0:
        state = {"optimizer": run.opt.state_dict(), "step": run.step, "config": asdict(run.cfg), "best": run.best,
                 "processes": runs.layout(run.proc.world), "machines": run.machines}
        if run.scaler.is_enabled():
            state["scaler"] = run.scaler.state_dict()
        run.latest_checkpoint = runs.write_checkpoint(run.out, run.step, functools.partial(
            save_pretrained, run.encoder, run.tok), state, run.cfg.keep_ckpts)  # whole, whatever the others do next
    if run.proc.world > 1:
        dist.barrier()
    run.latest_checkpoint = runs.step_folder(run.out, run.step)  # each machine's last line names it


# -----------------------------------------------------------------------------------------------
# Setting a run up: the model, the data, the optimiser, every process in its place (support/runs.py and
# support/processes.py; how a run stops: support/stopping.py)


@cli
def main(argv=None):
    cfg = parse_config(TrainConfig, argv, __doc__.split("\n\n")[0])
    with stopping.lifetime() as life, cpu_threads(cfg.threads):  # Ctrl-C and SIGTERM: one line; threads as they were
        life.run = run = setup(cfg, given_fields(TrainConfig, argv), processes())
        run.stop = life.stop
        train(run)
        if run.proc.rank == 0:  # the final model in out/model, and what to do with it
            hand_over(run, run.out / "model", metrics.read_metrics(run.out))
            runs.say_done(run.out, run.best)
        if run.proc.world > 1:
            dist.barrier()  # no rank tears its connections down while another still uses them


def setup(cfg: TrainConfig, given: set, proc: Process) -> Run:
    """Everything is checked (flags, evaluation data, model, documents) before an earlier run is replaced, and all
    that may take long (a tokenizer, the corpus) is ready before the process group exists, whose collectives may wait
    only --ddp-timeout seconds."""
    if not cfg.data and not cfg.resume:
        cfg = demo.demo_config(cfg, given, proc)
    cfg, out, resume_from = runs.run_folder(cfg, given, proc, lambda path: load_pretrained(str(path), quiet=True),
                                            RESUMABLE)
    cfg = replace(cfg, threads=runs.run_threads(cfg, "threads" in given, resume_from, proc))  # stored with the run
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # free on Ampere and later
    pairs = evaluate_sts.load_stsb_dev(cfg.eval_data) if cfg.eval_data else None  # a bad path stops the run now
    encoder, tok = resume_from.model if resume_from else build_model(cfg, proc)
    if not resume_from and scratch_name(cfg.model) is None and not Path(cfg.model).expanduser().is_dir():
        cfg = replace(cfg, model=f"{cfg.model.partition('@')[0]}@{encoder.source.name}")  # the commit it started from
    encoder.to(proc.device).train()
    batches = sampler.SpanBatches(corpus_for_run(cfg, tok, proc), tok, cfg, encoder.config.max_tokens,
                                  proc.rank, proc.world)
    opt = make_optimizer(encoder, cfg, fused=proc.device.type == "cuda")
    scaler = torch.amp.GradScaler(proc.device.type, enabled=autocast_dtype(cfg.dtype, proc.device) == torch.float16)
    model = ChunkedEncoder(encoder, compile=cfg.compile)
    total = cfg.steps or cfg.epochs * batches.steps_per_epoch
    run = Run(cfg, out, model, encoder, tok, opt, scaler, batches, total, proc)
    run.machines = runs.machines(resume_from, proc, autocast_dtype(cfg.dtype, proc.device))
    runs.check_length(run.total, batches.steps_per_epoch, cfg, resume_from, MAX_STEPS)
    runs.begin(proc, out, resume_from, cfg.ddp_timeout)
    if proc.world > 1:
        run.model = data_parallel(model, proc.device, find_unused=not cfg.mlm)  # no MLM: its head is unused
    if resume_from:  # the optimizer, the loss scale, the step and the best score, as the checkpoint has them
        run.step, run.best, run.latest_checkpoint = runs.restore(resume_from, opt, scaler)
        runs.say_replanned(resume_from, run.total, batches.steps_per_epoch, lambda s, t: lr_at(s, t, cfg))
    if pairs:  # scored as embed.py would embed on this device (its --dtype auto)
        run.evaluate = functools.partial(evaluate_sts.spearman_of, encoder, tok, pairs,
                                         dtype=autocast_dtype("auto", proc.device, cpu_bf16=True))
    runs.say_plan(cfg, proc, run.total, batches.steps_per_epoch, len(batches.docs))
    return run


def build_model(cfg: TrainConfig, proc: Process):
    """(encoder, tokenizer); a scratch model's BPE is trained on the run's own documents by rank 0, and the others
    take it from there."""
    if (shape := scratch_name(cfg.model)) is None:
        return load_pretrained(cfg.model)
    bpe = made_once(proc, "tokenizer", lambda: scratch_tokenizer(  # trained by rank 0 alone, the others wait
        shape, document_texts(cfg.data, clean=not cfg.keep_whitespace), quiet=False).to_str())
    tok = Tokenizer.from_str(bpe)
    return scratch_encoder(shape, tok.get_vocab_size(), cfg.seed), tok


if __name__ == "__main__":
    main()
