"""
support/metrics.py: what a training run records of its steps, which train.py calls and a reader of the method can
skip. Every step a line in out/metrics.jsonl, every --log-every steps a line on stdout, and with --tensorboard the
same numbers as TensorBoard event files in out/tensorboard/. A resumed run goes on with the same curves:
metrics.jsonl is cut back to its checkpoint (support/runs.py), and TensorBoard forgets the steps after it.

    {"step": 0, "stsb_dev_spearman": 55.1}      with --eval-data: the model the run starts from
    {"step": 0, "spans_mrr": 26.1, ..., "bm25_spans_mrr": 25.0, ..., "tfidf_spans_mrr": 24.4, ...,
     "spans_bar": "bm25"}                       with --eval-docs or --holdout-docs: held-out span retrieval (MRR,
                                                R@1, R@10 x 100; alignment, uniformity), and at the start word
                                                overlap's (BM25, TF-IDF) and which of the two is the bar to beat
    {"step": 1, "contrastive": 2.77, "mlm": 8.31, "lr": 3.1e-05, "grad_norm": 4.2, "tokens": 19872,
     "tokens_per_s": 20353}                     a step (tokens: all ranks'; + stsb_dev_spearman where evaluated)

    tensorboard --logdir runs/                  # the runs under runs/, side by side
    python -m support.plot runs/demo            # a picture of one run, without TensorBoard
"""
import collections
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed

from support.cli import UserError, say
from support.retrieval import NAMES, few_words
from support.runs import last_checkpoint

METRICS, BOARD = "metrics.jsonl", "tensorboard"  # in the run folder
SPAN_FIGURES = ("mrr", "recall_at_1", "recall_at_10", "alignment", "uniformity")  # support.retrieval.span_retrieval's
# metrics.jsonl's numbers as TensorBoard's tags, named as the Hugging Face Trainer names its own
TAGS = {"contrastive": "train/contrastive", "mlm": "train/mlm", "lr": "train/learning_rate",
        "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s", "stsb_dev_spearman": "eval/stsb_dev",
        **{f"spans_{k}": f"eval/spans_{k}" for k in SPAN_FIGURES},
        **{f"{w}_spans_{k}": f"eval/{w}_spans_{k}" for w in ("bm25", "tfidf") for k in SPAN_FIGURES[:3]}}


def read_metrics(out: Path) -> list[dict]:
    """The run's records, in order; a line cut short by a kill is left out."""
    records = []
    if (out / METRICS).exists():
        for line in (out / METRICS).read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return [r for r in records if isinstance(r, dict) and "step" in r]


def evaluated(rec: dict) -> str:
    """A log line's evaluation: STS-B dev, held-out span retrieval's MRR (and at the start word overlap's, the
    stronger of BM25 and TF-IDF named as the bar to beat)."""
    out = f" | STS-B dev {rec['stsb_dev_spearman']:.2f}" if rec.get("stsb_dev_spearman") is not None else ""
    if "spans_mrr" in rec:
        out += f" | spans MRR {rec['spans_mrr']:.2f}, R@1 {rec['spans_recall_at_1']:.2f}"
    if "spans_bar" in rec:
        both = "; ".join(f"{NAMES[w]} {rec[f'{w}_spans_mrr']:.2f}, {rec[f'{w}_spans_recall_at_1']:.2f}"
                         for w in ("bm25", "tfidf"))
        out += f" ({both}; the bar: {NAMES[rec['spans_bar']]})"
        if few_words(rec.get("spans_words", math.nan)):
            out += f"; {few_words(rec['spans_words'])}"
    return out


def word_figures(words: dict) -> dict:
    """support.retrieval.word_overlap's answer as metrics.jsonl's numbers: bm25_spans_mrr, ..., tfidf_spans_mrr, ...,
    spans_bar (which of the two is the bar to beat) and spans_words (the mean words of a span)."""
    out = {f"{w}_spans_{k}": v for w in ("bm25", "tfidf") for k, v in words[w].items()}
    return out | {"spans_bar": words["bar"], "spans_words": round(words["words"], 2)}


class Log:
    """A run's record of each step (metrics.jsonl, and TensorBoard's events with --tensorboard), written by rank 0,
    and its line on stdout every --log-every steps; tokens/s and the ETA over the last RECENT steps, so that the
    first minutes do not skew them."""

    RECENT = 20

    def __init__(self, run, log_every: int, tensorboard: bool = False):
        self.run, self.every, self.t0 = run, log_every, time.time()
        self.clock = collections.deque([(self.t0, 0)], maxlen=self.RECENT + 1)  # (time, tokens) after recent steps
        self.board = Board.open(run.out, run.step) if tensorboard and run.proc.rank == 0 else None

    def record(self, step: int, lr: float, contrastive: float, mlm: float, gnorm: float, tokens: int) -> dict:
        self.clock.append((time.time(), self.clock[-1][1] + tokens))
        (t_old, n_old), (t_new, n_new) = self.clock[0], self.clock[-1]
        return dict(step=step, contrastive=round(contrastive, 6), mlm=round(mlm, 6),
                    lr=lr,
                    grad_norm=round(gnorm, 4) if math.isfinite(gnorm) else None,  # fp16: a skipped step's is inf
                    tokens=tokens, tokens_per_s=round((n_new - n_old) / (t_new - t_old)))

    def write(self, rec: dict):
        run = self.run
        try:
            with open(run.out / METRICS, "a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as e:  # a full disk, or an --out moved or deleted while the run trains
            raise UserError(f"{run.out / METRICS}: cannot write ({e.strerror or e}); was --out moved or deleted "
                            f"while the run trained? last checkpoint: {last_checkpoint(run)}") from None
        line = rec["step"] % self.every == 0 or rec["step"] == run.total
        if self.board:  # on disk by each checkpoint: a run killed after it resumes with every step before it
            self.board.add(rec, flush=line or rec["step"] % run.cfg.ckpt_every == 0)
        if not line:
            return
        if "contrastive" not in rec:
            print(f"step 0/{run.total}{evaluated(rec)}: the model the run starts from", flush=True)
            return
        (t_old, _), (t_new, _) = self.clock[0], self.clock[-1]
        eta = (t_new - t_old) / (len(self.clock) - 1) * (run.total - rec["step"])
        print(f"step {rec['step']}/{run.total} | contrastive {rec['contrastive']:.4f} | mlm {rec['mlm']:.4f} | "
              f"lr {rec['lr']:.2e} | {rec['tokens_per_s']:,} tok/s | {time.time() - self.t0:.0f}s elapsed | "
              f"ETA {eta:.0f}s{evaluated(rec)}", flush=True)

    def close(self):
        if self.board:
            self.board.close()
        self.board = None


def step_losses(contrastive, mlm, tokens: int, world: int, with_mlm: bool) -> dict:
    """A step's losses for the log, left on the device (the run reads them once the next step is on its way):
    contrastive (the same on every rank) and MLM averaged over the ranks, and this rank's tokens."""
    mlm_log = mlm.detach() / world if with_mlm else torch.zeros((), device=contrastive.device)
    if world > 1:
        torch.distributed.all_reduce(mlm_log)
    return dict(tokens=tokens, contrastive=contrastive.detach(), mlm=mlm_log)


class Figures:
    """One step's numbers for the log (its losses, gradient norm and the ranks' agreed stop), sent to the host without
    waiting. train.py reads step k's once it has launched step k+1: reading them at once would leave the GPU idle while
    the host logs, then the host idle while the GPU starts the next step. read() waits for this step's copy alone."""

    def __init__(self, step: int, lr: float, tokens: int, *values):
        self.step, self.lr, self.tokens, self.event = step, lr, tokens, None
        device = values[-1].device
        numbers = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=device) for v in values])
        if device.type != "cuda":
            self.host = numbers
            return
        # Into page-locked memory, behind the step on the GPU's stream; an event marks when it has arrived
        self.host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
        self.host.copy_(numbers, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def read(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Board:
    """--tensorboard: metrics.jsonl's numbers as TensorBoard scalars, through torch.utils.tensorboard."""

    @classmethod
    def open(cls, out: Path, step: int):
        """The writer for a run at `step`, or None with one line when the tensorboard package is not installed."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch's writer needs the tensorboard package, which is not a requirement of ours
            say("warning: --tensorboard: the tensorboard package is not installed (pip install tensorboard); the run "
                f"goes on, its numbers in {out / METRICS}", file=sys.stderr)
            return None
        folder = out / BOARD
        earlier = sorted(folder.glob("events.out.tfevents.*")) if folder.is_dir() else []
        # TensorBoard reads the files in name order, which begins with the second each was made: a file made within
        # the second of an earlier one could sort before it, and that file's purge (below) would come too soon
        while earlier and int(time.time()) <= int(earlier[-1].name.split(".")[3]):
            time.sleep(0.05)
        # A resumed run: TensorBoard drops the steps after the checkpoint from the earlier files (they run again)
        board = cls(SummaryWriter(str(folder), purge_step=step + 1 if earlier else None))
        if not earlier:  # --tensorboard first given on --resume: the steps before it, from metrics.jsonl
            for rec in read_metrics(out):
                board.add(rec)
        return board

    def __init__(self, writer):
        self.writer = writer

    def add(self, rec: dict, flush: bool = False):
        for key, tag in TAGS.items():
            if rec.get(key) is not None:
                self.writer.add_scalar(tag, rec[key], rec["step"])
        if flush:
            self.writer.flush()

    def close(self):
        self.writer.close()
