"""
support/training.py: the run around train.py's loop, which a reader of the method can skip. A Run holds what the loop
steps (the model, the optimizer, the batches) and does what each step leaves to be done (after_step): the ranks'
agreement to stop after a SIGTERM, the step's numbers into metrics.jsonl, read once the next step is on its way so
that a GPU never waits for the log, the evaluation and the best model, checkpoints and their barrier; and a failure as
one line. The run folder, resuming and processes are support/runs.py's and support/processes.py's.
"""
import contextlib
import functools
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from support import card, demo, metrics, retrieval, runs, stopping
from support.cli import say
from support.device import autocast_dtype, say_compiled
from support.processes import Process, gather_rows, same_weights
from support.workers import prefetched_batches


@dataclass
class Run:
    """Everything the loop reads and advances, and what it hands each step to."""
    cfg: object  # train.TrainConfig
    out: Path
    model: nn.Module  # what train_step runs: ChunkedEncoder(encoder) (compiled with --compile), in DDP under torchrun
    # (train.setup wraps it)
    encoder: nn.Module  # the model.Encoder inside it, which checkpoints save
    tok: object
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16's loss scale; disabled (a no-op) in every other precision
    batches: object  # sampler.SpanBatches
    total: int  # the run's steps
    save_model: object = None  # (encoder, tokenizer, folder) -> Hugging Face layout (model.save_pretrained)
    proc: Process = field(default_factory=lambda: Process(0, 0, 1, torch.device("cpu")))  # rank, world, device
    step: int = 0
    best: float = -1.0
    latest_checkpoint: Path | None = None  # the newest checkpoint
    machines: list = field(default_factory=list)  # where its steps ran, for the model card (support/runs.machines)
    log: metrics.Log | None = None  # metrics.jsonl and the lines on stdout (TensorBoard's too), while the loop runs
    evaluate: object = None  # (start) -> {figure: value}: STS-B dev (--eval-data), held-out spans (--eval-docs ...)
    loader: object = None  # the batches' iterator, while the loop runs
    stop: stopping.StopOnSigterm = field(default_factory=stopping.StopOnSigterm)  # SIGTERM: stop after this step
    before: metrics.Figures | None = None  # the step before, whose numbers are read once the next is on its way
    documents: list = field(default_factory=list)  # the files behind --data (support.corpus.describe_files)
    held_out_below: float | None = None  # --holdout-docs' point (support.corpus.held_out), kept for a resume

    def begin(self, resume_from, evaluate, lr_at, most_steps: int):
        """The run made ready to step: where its model came from pinned, its length checked, its folder prepared and
        the process group up (support/runs.py), a checkpoint's state restored, the plan said (train.setup then puts
        DDP around the model).
        evaluate: (start: bool) -> the evaluation's figures, called on every rank, or None; lr_at(step, total) -> the
        learning rate."""
        cfg, proc = self.cfg, self.proc
        if not resume_from and demo.scratch_name(cfg.model) is None and not Path(cfg.model).expanduser().is_dir():
            self.cfg = cfg = replace(cfg, model=f"{cfg.model.partition('@')[0]}@{self.encoder.source.name}")  # commit
        self.machines = runs.machines(resume_from, proc, autocast_dtype(cfg.dtype, proc.device))
        runs.check_length(self.total, self.batches.steps_per_epoch, cfg, resume_from, most_steps)
        runs.begin(proc, self.out, resume_from, cfg.ddp_timeout)
        if resume_from:  # the optimizer, the loss scale, the step and the best score, as the checkpoint has them
            self.step, self.best, self.latest_checkpoint = runs.restore(resume_from, self.opt, self.scaler)
            runs.say_replanned(resume_from, self.total, self.batches.steps_per_epoch, lr_at)
        self.evaluate = evaluate or None
        runs.say_plan(cfg, proc, self.total, self.batches.steps_per_epoch, len(self.batches.docs))

    def steps(self):
        """The batches of the steps left, made ahead by the DataLoader's workers; the starting model scored first
        (with --eval-data or held-out spans, beside word overlap's), and what --compile built said last."""
        self.stop.training = True
        self.log = metrics.Log(self, self.cfg.log_every, self.cfg.tensorboard)  # close() closes it
        if self.evaluate and self.step == 0:  # the start's score, beside the run's (every rank shares the work)
            with self.stop.at_once():
                start = {"step": 0, **self.evaluate(True)}
            if self.proc.rank == 0:
                self.log.write(start)
        # Resuming at step k needs nothing of the steps before k (sampler.SpanBatches); close() ends the workers
        self.loader = prefetched_batches(self.batches, range(self.step, self.total), self.cfg.workers)
        yield from self.loader
        if self.cfg.compile:
            say_compiled()

    def failures(self):
        """A step that does not fit in memory, or a rank gone, as one line (support/stopping.py)."""
        return stopping.failures_are_one_line(self)

    def after_step(self, lr: float, stats: dict, gnorm: torch.Tensor):
        """The ranks agree whether to stop; the step's numbers leave for the host, and the step before's are logged now,
        while this one runs on the GPU; evaluation, a checkpoint or a stop waits for this step's at once."""
        cfg = self.cfg
        with self.failures():
            # SIGTERM: every rank stops after the same step, the first any of them was told to stop at
            stop = stopping.agreed_stop(self, gnorm.device)
            self.step += 1
            this = metrics.Figures(self.step, lr, stats["tokens"] * self.proc.world, stats["contrastive"],
                                   stats["mlm"], gnorm, stop)
            stop = self.before is not None and self.log_step(self.before)
            self.before = this
            saved = self.step % cfg.ckpt_every == 0 or self.step == self.total
            evaluated = self.evaluate and (cfg.eval_every and self.step % cfg.eval_every == 0
                                           or self.step == self.total)
            if stop or saved or evaluated:  # each needs this step's weights and numbers: the host waits for them here
                stop = self.log_step(this, evaluated) or stop
                self.before = None
                if stop or saved:
                    self.save_checkpoint()
        if stop and self.step < self.total:
            raise stopping.Terminated

    def log_step(self, figures: metrics.Figures, evaluate: bool = False) -> bool:
        """A step's numbers into metrics.jsonl (rank 0), with its STS-B dev score where it is evaluated; whether the
        ranks agreed to stop after it."""
        contrastive, mlm, gnorm, stop = figures.read()
        stopping.check_finite(self, contrastive + mlm, figures.step)
        rec = self.log.record(figures.step, figures.lr, contrastive, mlm, gnorm, figures.tokens)
        if evaluate and not stop:  # a step the ranks stop after is checkpointed at once, not evaluated
            self.score_and_keep_best(rec)
        if self.proc.rank == 0:  # every step into out/metrics.jsonl, every --log-every steps a line
            self.log.write(rec)
        return bool(stop)

    def score_and_keep_best(self, rec: dict):
        """The evaluation's figures into the record (rank 0 writes it), and the best model so far by --best-by's kept
        in out/best."""
        with self.stop.at_once():  # SIGTERM stops an evaluation where it is
            rec.update(self.evaluate(False))  # dropout off (embed.encode's)
        key = self.cfg.best_key
        if self.proc.rank == 0 and rec.get(key) is not None and rec[key] > self.best:
            self.best = rec[key]
            self.hand_over(self.out / "best", [*metrics.read_metrics(self.out), rec], best=True)

    def hand_over(self, folder: Path, records: list[dict], best: bool = False):
        """A model folder the run hands over (out/model, out/best): the weights in Hugging Face layout, and the model
        card (README.md) of what the run did to them, from its config and metrics.jsonl (support/card.py)."""
        self.save_model(self.encoder, self.tok, folder)
        card.write_card(folder, self.cfg, records, self.machines, len(self.batches.docs), self.total, best)

    def save_checkpoint(self):
        """out/checkpoints/step-NNNNNNNN, written by rank 0 while the others wait: the model in Hugging Face layout,
        and train_state.pt (optimizer, step, config). Under torchrun every rank's weights are first checked against
        rank 0's, which go to every rank where they differ (support.processes.same_weights)."""
        if self.proc.world > 1:
            same_weights(self.encoder, self.opt, self.step)
        if self.proc.rank == 0:
            state = {"optimizer": self.opt.state_dict(), "step": self.step, "config": asdict(self.cfg),
                     "best": self.best, "processes": runs.layout(self.proc.world), "machines": self.machines,
                     "documents": self.documents, "held_out_by": "content", "held_out_below": self.held_out_below}
            if self.scaler.is_enabled():
                state["scaler"] = self.scaler.state_dict()
            self.latest_checkpoint = runs.write_checkpoint(  # whole, whatever the other ranks do next
                self.out, self.step, functools.partial(self.save_model, self.encoder, self.tok), state,
                self.cfg.keep_ckpts)
        if self.proc.world > 1:
            dist.barrier()
        self.latest_checkpoint = runs.step_folder(self.out, self.step)  # each machine's last line names it

    def finish(self):
        """The final model in out/model and what to do with it (rank 0); no rank tears its connections down while
        another still uses them."""
        if self.proc.rank == 0:
            self.hand_over(self.out / "model", metrics.read_metrics(self.out))
            runs.say_done(self.out, self.best, self.cfg.best_key)
        if self.proc.world > 1:
            dist.barrier()

    def close(self):
        """However the run ends: the last step's numbers logged (they wait for the next step to be on its way, so a
        stop between the two would leave metrics.jsonl a step short of the step the run says it stopped after), the
        loader's workers ended now, and DDP, which holds the process group, let go of."""
        if self.loader is not None:
            self.loader.close()
        if self.log is not None and self.before is not None:
            with contextlib.suppress(Exception):  # never in the way of what ends the run
                self.log_step(self.before)
            self.before = None
        if self.log is not None:
            self.log.close()
        self.model = self.loader = self.log = None


def model_for_run(cfg, proc: Process, resume_from, *, load_pretrained, make_encoder):
    """(encoder, tokenizer): the checkpoint's on --resume; a random-init shape (--model scratch:SHAPE) whose BPE rank 0
    trains on the documents (make_encoder: model.scratch_encoder); or a pretrained one (load_pretrained: model's),
    said where it ships no MLM head and MLM is on."""
    if resume_from:
        return resume_from.model
    if demo.scratch_name(cfg.model):
        return demo.scratch_model(cfg, proc, make_encoder)
    encoder, tok = load_pretrained(cfg.model, quiet=True)
    if encoder.fresh_head and cfg.mlm:
        # From a sentence encoder that ships no head (all-MiniLM-L6-v2), MLM's first gradients are a random head's,
        # and its masked anchors inputs the encoder never saw: on held-out books it ended below its start where
        # contrastive alone rose (docs/ablation.md)
        say(f"{cfg.model}: no MLM head in the checkpoint, a fresh one made; from a sentence encoder, --no-mlm did "
            f"better on held-out documents (docs/ablation.md)", file=sys.stderr)
    return encoder, tok


def evaluation(run: Run, held, pairs, *, encode, spearman_of, span_lengths: tuple[int, int]):
    """The run's evaluation, (start: bool) -> figures, or None where it has nothing to score: held-out span retrieval
    on --holdout-docs' or --eval-docs' documents (`held`, support.processes.EvalDocuments; its pairs drawn here once,
    `span_lengths` long, the same at every evaluation), every rank embedding its share, the start compared with word
    overlap; and STS-B dev's Spearman (`pairs`, --eval-data's) on rank 0. Handed in: embed.encode,
    evaluate_sts.spearman_of."""
    cfg, proc, encoder, tok = run.cfg, run.proc, run.encoder, run.tok
    spans = None
    if held:
        spans = retrieval.run_spans(held, tok, span_lengths, cfg.span_pairs, clean=not cfg.keep_whitespace,
                                    field=cfg.text_field)
    if not (pairs or spans):
        return None

    def evaluate(start: bool) -> dict:
        # In the precision embed.py would use (bf16 on a CPU with AMX), with model.py's own layers: embed.py's CPU
        # swap (support/cpu_layers.py) would lay the weights out again at every evaluation
        dtype, figures = autocast_dtype("auto", proc.device, cpu_bf16=True), {}
        if spans:
            found = retrieval.span_retrieval(encode, encoder, tok, *spans, dtype=dtype,
                                             share=(proc.rank, proc.world, gather_rows))
            figures |= {f"spans_{k}": v for k, v in found.items()}
            if start:
                figures |= metrics.word_figures(retrieval.word_overlap(*spans))
        if pairs and proc.rank == 0:  # STS-B dev
            figures["stsb_dev_spearman"] = spearman_of(encoder, tok, pairs, dtype=dtype)
        return figures

    return evaluate
