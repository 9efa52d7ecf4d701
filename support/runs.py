"""
support/runs.py: a training run's plumbing, which train.py calls and a reader of the method can skip (its processes
are support/processes.py's). The run folder, its lock, its log and its checkpoints; where a run starts (afresh, or
at rank 0's newest good checkpoint, the same on every rank) and which flags a resume may change; and the one line a
command that continues a run. How a run stops is support/stopping.py's. A run folder:

    .declutr.lock                    who holds it while a run trains: pid, machine, since when, the command
    metrics.jsonl                    a line a step: losses, lr, grad norm, tokens (support/metrics.py)
    tensorboard/                     the same as TensorBoard's events (--tensorboard)
    checkpoints/step-00000500/       model.safetensors, config.json, tokenizer.json, ..., train_state.pt
    model/                           the final model, Hugging Face layout, and its model card (README.md)
    best/                            the best model by STS-B dev or held-out span retrieval (--best-by), and its card
"""
import fcntl
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from support.card import BEST_BY
from support.cli import UserError, first_line, flag, say
from support.corpus import data_files, describe_files, what_changed
from support.demo import demo_config, scratch_name
from support.device import device_name
from support.files import make_dirs, remove_stale_temporaries, write_atomic
from support.processes import Process, every_rank_says, init_process_group, made_once
from support.threads import usable_cpus


@dataclass
class RunConfig:  # train.py's flags for the run around the method: its folder, logs, checkpoints and processes
    out: str = flag("", "checkpoints, metrics.jsonl, and the final model in out/model; empty: runs/declutr (runs/demo)")
    resume: bool = flag(False, "continue the newest checkpoint in out (runs/declutr or runs/demo) as it was configured")
    any_world_size: bool = flag(False, "--resume on other processes than the run had (every later step then differs)")
    changed_data: bool = flag(False, "--resume though the files behind --data changed since the run's checkpoint "
                                     "(said in one line)")
    overwrite: bool = flag(False, "start afresh in an out that holds an earlier run")
    log_every: int = flag(10, "steps between log lines (metrics.jsonl has every step)", low=1)
    eval_data: str = flag("", "STS-B folder or sts-dev.csv: dev Spearman at every eval, best model kept in out/best")
    eval_docs: list = flag(list, "held-out span retrieval at every eval on these documents, not trained on: does each "
                                 "span find the span that lay near it (MRR)? Beat the start's and BM25's (step 0)")
    holdout_docs: float = flag(0.0, "held-out span retrieval (as --eval-docs) on this share of --data's documents, "
                                    "kept out of training", low=0, high=0.5)
    span_pairs: int = flag(4000, "held-out span retrieval's query-target pairs", low=1, high=20000)
    eval_every: int = flag(0, "steps between evaluations (0: only at the end)", low=0)
    best_by: str = flag("", "out/best by STS-B dev (stsb) or held-out span retrieval's MRR (spans); default: stsb "
                            "with --eval-data", choices=("", "stsb", "spans"))
    ckpt_every: int = flag(500, "steps between checkpoints", low=1)
    keep_ckpts: int = flag(2, "the newest checkpoints kept", low=1)
    workers: int = flag(2, "DataLoader worker processes per rank", low=0)
    threads: int = flag(0, "torch CPU threads per rank; 0: its share of the cores free when it starts", low=0,
                        high=usable_cpus(), why="the CPUs this process may use")
    ddp_timeout: int = flag(1800, "seconds a collective waits for the other ranks before the job stops",
                            low=1, high=604800)
    tensorboard: bool = flag(False, "metrics.jsonl's numbers also as TensorBoard events in out/tensorboard")

    def validate(self):
        if self.resume and self.overwrite:
            raise UserError("--resume and --overwrite: continue the run, or replace it, not both", code=2)
        if self.eval_docs and self.holdout_docs:
            raise UserError("--eval-docs and --holdout-docs: held-out spans come from one or the other", code=2)
        if self.best_by == "stsb" and not self.eval_data:
            raise UserError("--best-by stsb needs --eval-data (STS-B dev)", code=2)
        if self.best_by == "spans" and not (self.eval_docs or self.holdout_docs):
            raise UserError("--best-by spans needs --eval-docs or --holdout-docs", code=2)

    @property
    def best_key(self) -> str | None:
        """The evaluation's figure that picks out/best: --best-by's, else STS-B dev, else span retrieval's MRR."""
        by = self.best_by or ("stsb" if self.eval_data else "spans" if self.eval_docs or self.holdout_docs else "")
        return {"stsb": "stsb_dev_spearman", "spans": "spans_mrr"}.get(by)


# The flags that --resume takes from the command line (any other is refused): where the run reads, logs, evaluates
# and checkpoints; not what decides which documents train, nor what best/ is best by. Of these, train.py's --steps and
# --epochs replan the schedule, --any-world-size and --changed-data let every later step differ from the run's own
# (each said when it does), and --threads may move a CPU sum's last digits
RESUMABLE = {f.name for f in fields(RunConfig)} - {"overwrite", "holdout_docs", "best_by"}
RESUMABLE |= {"steps", "epochs", "cache_dir"}


# -----------------------------------------------------------------------------------------------
# The run folder: its lock, its checkpoints, and what a new or resumed run does to it

LOCK = ".declutr.lock"  # in --out: who holds the run folder (pid, machine, since when, the command)
EARLIER_RUN = ("checkpoints", "model", "best")  # what an earlier run leaves, besides its log
_held = {}  # the run folders this process holds: resolved path -> its open lock file


def step_folder(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


def checkpoints(out: Path) -> list[Path]:
    d = out / "checkpoints"
    if not d.exists():
        return []
    return sorted(p for p in d.glob("step-*")
                  if re.fullmatch(r"step-\d{8}", p.name) and (p / "train_state.pt").exists())


def newest_mtime(out: Path) -> float:
    return max((p.stat().st_mtime for p in checkpoints(out)), default=-1.0)


def write_checkpoint(out: Path, step: int, write_model, state: dict, keep: int) -> Path:
    """out/checkpoints/step-NNNNNNNN: write_model(folder) writes the model's files, train_state.pt holds `state`
    (optimizer, step, config). The folder appears whole or not at all; the newest `keep` checkpoints are kept."""
    final = step_folder(out, step)

    def write(folder: Path):
        write_model(folder)
        # Serialised in memory, then written by Python: a full disk is then the OSError that says so (torch.save
        # straight into a file reports it as "unexpected pos")
        buffer = io.BytesIO()
        torch.save(state, buffer)
        (folder / "train_state.pt").write_bytes(buffer.getbuffer())

    make_dirs(final.parent)
    write_atomic(final, write)
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old)
    return final


def read_checkpoint(path: Path, load_model) -> tuple[dict, tuple]:
    """(train state, load_model(path)) of a checkpoint folder; a UserError naming what does not read back."""
    return read_train_state(path), load_model(str(path))


def read_train_state(path: Path) -> dict:
    try:  # tensors and plain data only
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: the unpickler and the zip reader raise many kinds
        raise UserError(f"{path / 'train_state.pt'}: not readable ({first_line(e)})") from None
    if not isinstance(state, dict) or not {"optimizer", "step", "config"} <= set(state):
        raise UserError(f"{path / 'train_state.pt'}: not a train state of this project")
    return state


def prepare_run_folder(out: Path, resume_step: int | None):
    """Lock the run folder for this run, then clear an earlier run (--overwrite) or cut metrics.jsonl back to the
    checkpoint a resumed run continues."""
    make_dirs(out)
    lock_run_folder(out)  # before anything in it changes: a run still training there keeps all it has
    if resume_step is None:  # the earlier run's model folders, and its log in every form (support/metrics.py)
        for name in (*EARLIER_RUN, "tensorboard"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in ("metrics.jsonl", "metrics.png"):
            (out / name).unlink(missing_ok=True)
    elif (out / "metrics.jsonl").exists():  # forget the steps after the checkpoint: they run again
        kept = "".join(line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()
                       if _step_of(line) <= resume_step)
        write_atomic(out / "metrics.jsonl", lambda tmp: tmp.write_text(kept))
    remove_stale_temporaries(out / "checkpoints")


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill
        return math.inf


def lock_run_folder(out: Path, probe: bool = False, said_as: str = ""):
    """An exclusive lock on a run folder until the process ends (or release_run_folders): a second run into the same
    --out, or --resume of a run still training there, is refused with one line naming the holder. The lock is the
    operating system's (flock), held by an open file, not the file's existence: a process that is killed (SIGKILL,
    a power loss) holds nothing any more, and the next run takes the folder. probe: refuse if it is held, write
    nothing. said_as: what the line calls the folder (embed.py's job folder is its --output's)."""
    path, key = out / LOCK, str(out.resolve())
    if key in _held or (probe and not path.exists()):
        return
    try:
        f = open(path, "r" if probe else "a+", encoding="utf-8")
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not said which"
        f.close()
        said_as = said_as or f"--out {out}"
        raise UserError(f"{said_as}: another run is using it ({holder}); wait for it to end, or choose another "
                        f"{said_as.split()[0]}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot lock the run folder ({e.strerror or e})") from None
    if probe:
        f.close()  # and with it the lock
        return
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)}\n")
    f.flush()
    _held[key] = f


def holds(out: Path) -> bool:
    """Whether this process holds the run folder's lock (lock_run_folder's)."""
    return str(out.resolve()) in _held


def release_run_folders():
    """Give up every run folder this process holds (a run's end; the process's end does the same)."""
    for f in _held.values():
        f.close()
    _held.clear()


# -----------------------------------------------------------------------------------------------
# Where a run starts, decided by rank 0 and followed by every rank

DEFAULT_OUTS = ("runs/declutr", "runs/demo")


@dataclass
class Resume:
    """The checkpoint a run continues from."""
    path: Path
    state: dict  # train_state.pt: optimizer, step, config, best
    model: tuple  # (encoder, tokenizer)
    restart: bool = False  # a torchrun --max-restarts round, which continues on its own

    @property
    def step(self) -> int:
        return self.state["step"]


def restarted() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0  # torchrun --max-restarts


def run_folder(cfg, given: set, proc: Process, load_model, resumable: set = RESUMABLE):
    """(the run's configuration, its folder, the checkpoint it continues from or None): the demo's settings without
    --data, torch's CPU threads set (run_threads), and the documents' files checked. Deletes nothing. Rank 0
    decides where the run starts (its newest good checkpoint, or none); every other rank loads that same checkpoint
    from its own --out, or the whole run stops before its first step, every rank with the same line. load_model(path)
    -> (encoder, tokenizer); resumable: the fields a resume may take from the command line."""
    if not cfg.data and not cfg.resume:
        cfg = demo_config(cfg, given, proc)
    restart, resume_from = restarted(), None

    def decide() -> str:
        nonlocal resume_from
        out, resume_from = start_point(cfg, load_model, restart)
        if resume_from and not restart:  # rank 0's files, as its checkpoints recorded them
            check_documents(resume_from, out, cfg.changed_data)
        return f"{out}\n{resume_from.step if resume_from else ''}"

    out, step = made_once(proc, "run-folder", decide).split("\n")
    # Each machine its own --out (one shared folder, or one each); with none given, the one rank 0 chose
    cfg = replace(cfg, model=cfg.model or "distilroberta-base", out=cfg.out or out)
    out, problem = Path(cfg.out), ""
    if step and proc.rank != 0:
        path = step_folder(out, int(step))
        try:
            if not path.is_dir():
                raise UserError(f"{path}: not there")
            resume_from = Resume(path, *read_checkpoint(path, load_model), restart=restart)
        except UserError as e:
            problem = (f"rank {proc.rank} on machine {proc.node} cannot resume at step {step} as rank 0 does ({e}): "
                       f"--out must be one folder that every machine sees, or hold a copy of rank 0's checkpoint")
    if problems := [p for p in every_rank_says(proc, "resume-read", problem) if p]:
        raise UserError(problems[0], code=2)
    if resume_from and not restart:  # torchrun's elastic restarts go on with the processes they have
        check_world(resume_from, proc.world, out, cfg.any_world_size)
    cfg = resumed_config(cfg, given, resume_from, resumable) if resume_from else cfg
    if cfg.docs_per_step % proc.world:
        raise UserError(f"--docs-per-step {cfg.docs_per_step}: does not split over {proc.world} ranks", code=2)
    cfg = replace(cfg, threads=run_threads(cfg, "threads" in given, resume_from, proc))  # stored with the run
    data_files(cfg.data, cfg.text_field)  # what the documents need (pyarrow for Parquet), before any model loads
    if cfg.eval_docs:
        data_files(cfg.eval_docs, cfg.text_field)
    return cfg, out, resume_from


def start_point(cfg, load_model, restart: bool) -> tuple[Path, Resume | None]:
    """Where the run starts, as rank 0 sees it: (its folder, its newest good checkpoint or None)."""
    if cfg.resume and not cfg.out:  # the newest of the default run folders: `python train.py --resume` after the demo
        cfg = replace(cfg, out=str(max(DEFAULT_OUTS, key=lambda d: newest_mtime(Path(d)))))
    out = Path(cfg.out or DEFAULT_OUTS[0])
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file, not a folder", code=2)
    lock_run_folder(out, probe=True)  # a run still training there: refused now, before any work
    if cfg.resume or restart:
        for path in reversed(checkpoints(out)):  # the newest that reads back whole
            try:
                return out, Resume(path, *read_checkpoint(path, load_model), restart=restart)
            except UserError as e:
                say(f"warning: {e}; resuming from the checkpoint before it", file=sys.stderr)
        if not restart:  # a restart before the first checkpoint starts afresh
            raise UserError(f"{out}: no checkpoint to resume from")
    # An earlier run is a checkpoint or a model; a run that stopped before its first checkpoint left only its log
    earlier = checkpoints(out) or any((out / name).exists() for name in EARLIER_RUN[1:])
    if earlier and not (cfg.overwrite or restart):
        raise UserError(f"{out} holds an earlier run; pass --resume to continue it or --overwrite to replace it")
    return out, None


def resumed_config(cfg, given: set, resume_from: Resume, resumable: set):
    """The stored configuration, with the flags of `resumable` that the command line gives; any other flag given
    with a value other than the run's is refused."""
    names = {f.name for f in fields(cfg)}
    stored = type(cfg)(**{k: v for k, v in resume_from.state["config"].items() if k in names})
    if resume_from.restart:  # torchrun's restart: the same command line as the run it continues
        return replace(stored, resume=True)
    # a flag given with the value the run already has changes nothing: only a different value is refused
    if refused := sorted(n for n in given & names - resumable if getattr(cfg, n) != getattr(stored, n)):
        name = refused[0]
        flag = ("--no-" if getattr(cfg, name) is False else "--") + name.replace("_", "-")
        raise UserError(f"{flag} cannot change when resuming {cfg.out}: the run goes on as it was configured "
                        f"({name} = {getattr(stored, name)!r}); start a new run in another --out instead", code=2)
    return replace(stored, **{**{k: getattr(cfg, k) for k in given & resumable}, "resume": True, "out": cfg.out})


def run_threads(cfg, given: bool, resume_from: Resume | None, proc: Process) -> int:
    """torch's CPU threads for the run, set here and stored in its checkpoints: a sum split over another number of
    threads rounds differently, so on a CPU the count is part of the run's trajectory. A resumed run keeps its own
    (said in one line when --threads asks for another); a new one takes --threads, or rank 0's share of the cores
    free when it started, on every rank alike."""
    had = resume_from.state["config"].get("threads", 0) if resume_from else 0  # 0: stored before it was resolved
    if given and had and cfg.threads not in (0, had):
        say(f"warning: --threads {cfg.threads}: the run trained with {had} CPU thread(s) per rank, and its steps "
            f"from here differ from the run's own in the last digits (sums in another order); pass --threads {had} "
            f"to continue it exactly", file=sys.stderr)
    threads = cfg.threads or had or int(made_once(proc, "threads", lambda: str(torch.get_num_threads())))
    torch.set_num_threads(threads)
    return threads


def layout(world: int) -> dict:
    """The processes a run trains with, stored in its checkpoints: how many, on how many machines."""
    return {"world": world, "machines": int(os.environ.get("GROUP_WORLD_SIZE", "1"))}


def machines(resume_from: Resume | None, proc: Process, dtype: torch.dtype | None) -> list[dict]:
    """Where the run's steps ran, stored in its checkpoints for its model card: the earlier processes' (from the
    checkpoint a run resumes), then this one's from its first step on, in `dtype` (autocast's; None: fp32)."""
    earlier = resume_from.state.get("machines", []) if resume_from else []
    step = resume_from.step if resume_from else 0
    dtype = str(dtype or torch.float32).removeprefix("torch.")
    return [*[m for m in earlier if m["from_step"] < step],
            {"from_step": step, **layout(proc.world), "device": device_name(proc.device), "dtype": dtype}]


def check_documents(resume_from: Resume, out: Path, allowed: bool):
    """A run resumed on other documents than it trained on (a file added, removed or changed behind --data, whose
    cache key then says so) would go on with another corpus, and --holdout-docs with documents it may have trained
    on: refused, or said once when allowed. A checkpoint from before this was stored: as it is."""
    before = resume_from.state.get("documents")
    if before is None:
        return
    config = resume_from.state["config"]
    changed = what_changed(before, describe_files(config["data"]))
    if not changed:
        return
    if not allowed:
        raise UserError(f"{out}: the files behind --data changed since the run's checkpoint ({changed}): its steps "
                        f"from here would train on other documents; put them back as they were, or pass "
                        f"--changed-data to go on with them", code=2)
    say(f"warning: {out}: the files behind --data changed since the run's checkpoint ({changed}); going on with "
        f"them (--changed-data)", file=sys.stderr)


def check_world(resume_from: Resume, world: int, out: Path, allowed: bool):
    """A run resumed on another number of processes goes on differently from its own (each rank draws its own
    documents and dropout): refused with the command that continues it exactly, or said once when allowed."""
    had = resume_from.state.get("processes")
    if had is None or had["world"] == world:  # a checkpoint from before this was stored: as it is
        return
    if not allowed:
        raise UserError(f"{out}: the run was trained by {had['world']} process(es), this is {world}, and every later "
                        f"step would differ from the run's own; continue it with: "
                        f"{resume_command(out, had['world'], had['machines'])} (or pass --any-world-size to go on "
                        f"with {world} all the same)", code=2)
    say(f"warning: {out}: the run was trained by {had['world']} process(es) and goes on with {world} "
        f"(--any-world-size): every step from here differs from the run's own", file=sys.stderr)


def say_replanned(resume_from: Resume, total: int, steps_per_epoch: int, lr_at):
    """A resume that changes --steps or --epochs plans the learning-rate schedule again over the new total, as
    transformers' Trainer does; said once, with the lr the next step has. lr_at(step, total) -> lr."""
    stored = resume_from.state["config"]
    before, step = stored["steps"] or stored["epochs"] * steps_per_epoch, resume_from.step
    if before != total and not resume_from.restart:
        say(f"the run goes on to {total:,} steps (it was planned for {before:,}): its learning-rate schedule is "
            f"planned again over {total:,}, and step {step + 1} trains at lr {lr_at(step, total):.2e} (step {step} "
            f"had {lr_at(step - 1, before):.2e})")


def check_length(total: int, steps_per_epoch: int, cfg, resume_from: Resume | None, most: int):
    """A run of `total` steps that can be trained: at most `most`, and not before the step a resume starts at (at
    it: nothing left to train, the run finishes from its checkpoint)."""
    if total > most:
        raise UserError(f"--epochs {cfg.epochs}: {total:,} steps of {steps_per_epoch:,} per epoch; a run takes at "
                        f"most {most:,} (pass --steps)", code=2)
    if resume_from and resume_from.step > total and not resume_from.restart:
        raise UserError(f"{cfg.out}: the run is at step {resume_from.step} of {total}; pass --steps N (more than "
                        f"{resume_from.step}) to train it further")
    if resume_from and resume_from.step == total:  # stopped after its last checkpoint, before its model was written
        say(f"{cfg.out}: the run trained all its {total:,} steps; its last checkpoint ({resume_from.path.name}) is "
            f"its final model (pass --steps N, more than {total:,}, to train it further)")


def begin(proc: Process, out: Path, resume_from: Resume | None, ddp_timeout: int):
    """Rank 0 locks the run folder and clears or trims it (the others wait for that, or stop with its error); then
    the process group, whose collectives wait at most ddp_timeout seconds."""
    step = resume_from.step if resume_from else None
    made_once(proc, "run-folder-ready", lambda: prepare_run_folder(out, step) or "")
    init_process_group(proc, ddp_timeout)


def say_done(out: Path, best: float, key: str | None):
    """Where the model is, and the commands to embed text with it and evaluate it."""
    kept = f", the best by {BEST_BY[key]} ({best:.2f}) in {out / 'best'}" if best >= 0 and key else ""
    print(f"done: the model is in {out / 'model'}{kept}")
    print(f"embed text with it:\n  printf 'A man is playing a guitar.\\nA woman is singing.\\n' | "
          f"python embed.py --model {out / 'model'} - --output {out / 'embeddings.npy'}")
    print(f"evaluate it on STS-B dev:\n  python evaluate_sts.py --model {out / 'model'} --split dev"
          f"   # downloads the STS Benchmark once; or --data FOLDER holding sts-dev.csv")
    print(f"its card, for the hub: {out / 'model' / 'README.md'}; a picture of the run:\n  python -m support.plot {out}"
          f"   # {out / 'metrics.png'}")


def last_checkpoint(run) -> str:
    return str(run.latest_checkpoint or "none yet")


def resume_command(out: Path, world: int, machines: int) -> str:
    """How to go on with a run: as it was started (one process, or torchrun with as many), with --resume. The rest
    of its flags are stored with it."""
    flags = f"train.py --out {out} --resume"
    if world == 1:
        return f"python {flags}"
    if machines == 1:
        return f"torchrun --nproc_per_node={world} {flags}"
    return f"the torchrun command the run was started with, on each of its {machines} machines, for {flags}"


def load_optimizer(opt, saved: dict):
    """A stored optimizer state, run the way this device wants it: fused AdamW on a GPU even when the run began on a
    CPU, and the other way round (load_state_dict alone would bring back the stored `fused`)."""
    groups = [{**stored, "fused": ours["fused"], "foreach": ours["foreach"]}
              for stored, ours in zip(saved["param_groups"], opt.param_groups, strict=True)]
    opt.load_state_dict({**saved, "param_groups": groups})


def restore(resume_from: Resume, opt, scaler) -> tuple[int, float, Path]:
    """The checkpoint's optimizer and loss scale loaded; (its step, its best score, its folder)."""
    load_optimizer(opt, resume_from.state["optimizer"])
    if scaler.is_enabled() and "scaler" in resume_from.state:
        scaler.load_state_dict(resume_from.state["scaler"])
    say(f"resuming at step {resume_from.step} from {resume_from.path}")
    return resume_from.step, resume_from.state.get("best", -1.0), resume_from.path


def say_plan(cfg, proc: Process, total: int, steps_per_epoch: int, documents: int):
    """The run's plan in one line; and on a CPU, a pretrained model on glibc's malloc, how to keep memory flat."""
    say(f"training {cfg.model} on {proc.world} process(es), {proc.device.type}: {total} steps of "
        f"{cfg.docs_per_step} documents, {total / steps_per_epoch:.1f} passes over its {documents:,} documents")
    if proc.device.type == "cpu" and scratch_name(cfg.model) is None and allocator() == "glibc":
        say("note: on a CPU, glibc's malloc lets a run's memory grow step by step (all-MiniLM-L6-v2: 3.3 GB to 4.9 in "
            "60 steps); LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian's libtcmalloc-minimal4) holds it near 3 GB "
            "(docs/measurements.md#memory)", file=sys.stderr)


def allocator(maps_file: str = "/proc/self/maps") -> str:
    """The malloc this process runs on: "tcmalloc" or "jemalloc" where one was LD_PRELOAD'ed (its library is mapped),
    else "glibc"; "" where there is no /proc/self/maps to tell."""
    try:
        maps = Path(maps_file).read_text()
    except OSError:
        return ""
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in maps), "glibc")
