"""
support/embed_job.py: embed.py's job around the embedding, which a reader of the method can skip. The rows are
shared out in blocks of --block texts (fewer where the texts are long: embedding.block_rows) among torchrun's
processes (one plain process is the same job, on one), and a block is kept the moment it is done: its rows are
written where they belong in the output, under a temporary name, flushed to disk, then a line in its process's
record says so. A job stopped however it stops (SIGTERM, Ctrl-C, SIGKILL, a rank that dies) keeps every block
recorded; --resume embeds only the others, on however many processes it now has, and the output gets its name when
the last block is in. A block is batched the same way whichever process takes it, so the rows are those of one
uninterrupted process. While a job into out.npy runs:

    .out.npy.partial/          the job (out.npy itself appears only when complete)
      job.json                 what its rows depend on: the inputs (sizes, times), the model, the flags; the row count
      rows.npy                 .npy: the output at its full size, each block's rows written at their offset
      block-00000007.jsonl     .jsonl: one block's rows, named once written; joined in input order at the end
      done-R-HOST-PID          the blocks one process finished, a line each, written once their rows are on disk
      0-stdin.txt              standard input or a pipe, copied once (a job of one process; .jsonl: JSON lines)
      .declutr.lock            held by the job's first process while it runs: a second job into out.npy is refused

The processes meet in torchrun's store (support/processes.py), which hands out the blocks one at a time to whichever
asks first and counts the rows done; nothing else passes between them, so no collective has a timeout to outlast.
"""
import bisect
import contextlib
import hashlib
import io
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from support import cpu_layers, embedding, quantize
from support.cli import Progress, UserError, flag, say
from support.device import device_and_dtype, prefetched
from support.files import read_json, write_atomic, write_json
from support.processes import Process, made_once, processes
from support.runs import LOCK, holds, layout, lock_run_folder, release_run_folders, restarted
from support.stopping import StopOnSigterm, Terminated

HOST = socket.gethostname().split(".")[0] or "host"


@dataclass
class JobConfig:  # embed.py's flags for the job around the embedding: texts in, rows out, in blocks, resumable
    inputs: list = flag(list, ".txt (a text a line, empty lines too), .jsonl and .parquet (field text), - (stdin)")
    text_field: str = flag("text", "the field of a .jsonl line, the column of a .parquet file, that holds the text")
    output: str = flag("embeddings.npy", "written under a temporary name (.NAME.partial), renamed when complete")
    overwrite: bool = flag(False, "replace an --output that exists, or the unfinished job into it")
    resume: bool = flag(False, "continue the unfinished job into --output: only its missing blocks are embedded")
    output_dtype: str = flag("float32", "the rows written; float16 halves an .npy, int8 quarters it, binary (a bit a "
                                        "dimension) is 1/32", choices=("float32", "float16", "int8", "binary"))
    ranges: str = flag("", "int8: each dimension's range, a .ranges.npy embed.py wrote; default: this job's own, "
                           "written beside --output")
    format: str = flag("", "default: --output's extension", choices=("npy", "jsonl"))
    block: int = flag(16384, "texts read, sorted and embedded at a time (fewer where texts are long: about 32M "
                             "characters a block on average): bounds memory for inputs of any size", low=1)


def place(cfg):
    """Before anything loads: --model given and the paths usable (support.embedding.check_paths), then (this process:
    torchrun's RANK, LOCAL_RANK and WORLD_SIZE, or one plain process; its device; its dtype, None for fp32)."""
    if not cfg.model:
        raise UserError("no --model given: a hub id or a local Hugging Face directory")
    proc = processes()
    embedding.check_paths(cfg, Path(cfg.output), proc.world)
    asked = str(proc.device) if cfg.device == "auto" else cfg.device
    return (proc, *device_and_dtype(asked, cfg.dtype))


def job_folder(out: Path) -> Path:
    """Where a job into `out` keeps what it has done until the output is complete."""
    return out.with_name(f".{out.name}.partial")


@contextlib.contextmanager
def started(cfg, proc: Process, model, *, device, dtype, max_tokens: int, argv, runs: str = ""):
    """The job, begun or resumed, for embed.py to fill block by block; on the way out the output named (by rank 0,
    once every process is done), or, however the job stops, one line: the rows kept and the command that continues.
    runs: what the forward runs (support.device.runs_as), said in the job's first line."""
    handled = threading.current_thread() is threading.main_thread()  # where Python lets a handler be set
    previous = signal.signal(signal.SIGTERM, StopOnSigterm()) if handled else None  # SIGTERM raises Terminated
    job = Job(cfg, proc, model, device, dtype, max_tokens, argv)
    job.runs = runs
    try:
        job.begin()
        yield job
        job.finish()
    except (KeyboardInterrupt, Terminated) as e:
        sigterm = isinstance(e, Terminated)
        raise job.stopped("terminated (SIGTERM)" if sigterm else "interrupted", 143 if sigterm else 130) from None
    except OSError as e:  # a full disk, a folder gone
        raise job.stopped(f"{job.out}: cannot write ({e.strerror or e})", 1, alone=True) from None
    except UserError as e:
        raise job.stopped(str(e), e.code, alone=e.alone) from None
    finally:
        job.close()
        if handled:
            signal.signal(signal.SIGTERM, previous)


class Job:
    """One embedding job as this process takes part in it: the blocks it embeds, where their rows go, and what the
    whole job has kept."""

    def __init__(self, cfg, proc: Process, model, device, dtype, max_tokens: int, argv):
        self.cfg, self.proc, self.argv = cfg, proc, list(sys.argv[1:] if argv is None else argv)
        self.out, self.size = Path(cfg.output), cfg.block
        self.folder = job_folder(self.out)
        self.hidden, self.npy = model.config.hidden_size, cfg.format == "npy"
        self.dtype = np.dtype("<f2" if cfg.output_dtype == "float16" else "<f4")  # int8, binary: made at the end
        self.ranges = quantize.read_ranges(Path(cfg.ranges), self.hidden) if cfg.ranges else None
        self.rows_from = rows_depend_on(cfg, model, device, dtype, max_tokens)
        self.rows = self.kept_before = 0
        self.plan = self.record = self.fd = self.progress = None
        self.runs = ""  # what the forward runs, for the first line

    # --- the job begun, or resumed ---------------------------------------------------------------

    def begin(self):
        """Rank 0 sets the job up (or finds it, with --resume) and says what is left; the others wait for it."""
        self.plan = json.loads(made_once(self.proc, "embed-job", self._prepare))
        self.rows, self.kept_before = self.plan["rows"], self.plan["kept"]
        self.size = self.plan.get("block", self.size)  # rank 0's: every process cuts the blocks alike
        self.copies = {k: Path(v) for k, v in self.plan["copies"].items()}
        self.progress = JobProgress(self)
        if self.plan["complete"]:
            return
        try:
            self.record = open(self.folder / f"done-{self.proc.rank}-{HOST}-{os.getpid()}", "a", encoding="utf-8")
            self.fd = os.open(self.folder / "rows.npy", os.O_WRONLY) if self.npy else None
        except FileNotFoundError as e:
            raise UserError(f"rank {self.proc.rank} on machine {self.proc.node} cannot write into the job's folder "
                            f"({e.filename}: not there): --output must be in a folder that every machine sees",
                            alone=True) from None
        self.header = len(npy_header(self.rows, self.hidden, self.dtype))

    def _prepare(self) -> str:
        """Rank 0: the job's folder made, or found and checked for --resume; what is left to do, as JSON."""
        cfg, out, folder = self.cfg, self.out, self.folder
        if folder.is_dir():  # a job still running there keeps all it has
            lock_run_folder(folder, said_as=f"--output {out}")
        partial = (folder / "job.json").exists()
        resume = (cfg.resume or restarted()) and partial
        if not partial and out.exists() and not cfg.overwrite:  # --resume of a job that is complete
            return json.dumps(dict(rows=0, kept=0, todo=[], copies={}, complete=True))
        if partial and not (cfg.resume or restarted() or cfg.overwrite):
            saved = read_json(folder / "job.json")
            kept = self.kept(saved["rows"], saved.get("block_rows", saved.get("--block", self.size)))
            raise UserError(f"--output {out}: a job into it stopped with {kept:,} of "
                            f"{saved['rows']:,} rows kept in {folder}; pass --resume to continue it, or --overwrite "
                            f"to start afresh")
        try:
            return json.dumps(self._resumed() if resume else self._fresh())
        except BaseException:
            # A job that never began leaves nothing behind; but only the job that holds the folder's lock may
            # remove it: a job refused at the lock leaves the other's, which another embed.py may have begun in the
            # same instant, as it is
            if not resume and holds(folder):
                release_run_folders()
                shutil.rmtree(folder, ignore_errors=True)
            raise

    def _fresh(self) -> dict:
        cfg, folder = self.cfg, self.folder
        # The folder locked before anything in it changes: two jobs started at one instant both find no folder,
        # and the one refused here must not have touched what the other has begun
        folder.mkdir(exist_ok=True)
        lock_run_folder(folder, said_as=f"--output {self.out}")
        for p in folder.iterdir():  # --overwrite of a partial job: its blocks go, its lock (held here) stays
            if p.name != LOCK:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        copies = embedding.spooled(cfg.inputs, folder, cfg.text_field)
        rows, chars = embedding.count_rows(cfg.inputs, copies, cfg.text_field)
        if rows == 0:
            raise UserError(f"{', '.join(cfg.inputs)}: no texts")
        self.size = embedding.block_rows(cfg.block, rows, chars)
        write_json(folder / "job.json", {"rows": rows, "block_rows": self.size,
                                         "inputs": describe_inputs(cfg.inputs, copies), **self.rows_from})
        if self.npy:  # the whole output at once, sparse: each block's rows then go where they belong
            need, free = rows * self.hidden * self.dtype.itemsize, shutil.disk_usage(folder).free
            if need > free:  # said now, not after hours
                raise UserError(f"--output {self.out}: needs {size(need)}, and {size(free)} are free there")
            with open(folder / "rows.npy", "wb") as f:
                f.write(header := npy_header(rows, self.hidden, self.dtype))
                f.truncate(len(header) + need)
        blocks = -(-rows // self.size)
        return dict(rows=rows, block=self.size, kept=0, todo=[[0, blocks]],
                    copies={k: str(v) for k, v in copies.items()}, complete=False)

    def _resumed(self) -> dict:
        cfg, folder = self.cfg, self.folder
        saved = read_json(folder / "job.json")
        copies = embedding.spooled(cfg.inputs, folder, cfg.text_field)  # stdin again: checked against the first
        check_unchanged(saved, {"inputs": describe_inputs(cfg.inputs, copies), **self.rows_from}, self.out)
        rows, self.size = saved["rows"], saved.get("block_rows", self.size)  # a job before block_rows: --block
        done = recorded(folder, -(-rows // self.size), self.npy)
        missing = sorted(set(range(-(-rows // self.size))) - done)
        return dict(rows=rows, block=self.size, kept=self.kept(rows), todo=ranges(missing),
                    copies={k: str(v) for k, v in copies.items()}, complete=False)

    # --- the blocks ------------------------------------------------------------------------------

    def blocks(self, tokenize, ahead: bool):
        """(block, tokenize(its texts)) for each block this process takes, in input order. ahead: the next block is
        read and tokenised in a thread while this one is embedded (the tokenizer releases the GIL), which pays on a
        GPU; on a CPU the two would only share the same cores."""
        texts = embedding.blocks(self.cfg.inputs, self.copies, self.size, self.claims(), self.cfg.text_field)
        work = lambda item: (item[0], tokenize(item[1]))  # noqa: E731
        return prefetched(texts, work) if ahead else map(work, texts)

    def claims(self):
        """The blocks this process takes, one at a time, as it becomes free: the store hands each of the blocks left
        to whichever process asks first, so a process given long texts takes fewer blocks."""
        todo = self.plan["todo"]
        starts = np.cumsum([0] + [end - start for start, end in todo]).tolist()
        n, i = starts[-1], -1
        while (i := i + 1 if self.proc.store is None else self.proc.store.add("embed/claimed", 1) - 1) < n:
            k = bisect.bisect_right(starts, i) - 1
            yield todo[k][0] + i - starts[k]

    def write(self, block: int, rows: np.ndarray):
        """A block's rows (block_rows x hidden, float32) on disk where they belong, flushed, then recorded."""
        rows = rows.astype(self.dtype)
        if self.npy:
            data = memoryview(rows.tobytes())
            offset = self.header + block * self.size * self.hidden * self.dtype.itemsize
            while data:  # one pwrite writes at most 2 GB
                n = os.pwrite(self.fd, data, offset)
                data, offset = data[n:], offset + n
            os.fdatasync(self.fd)
        else:
            part = self.folder / part_name(block)
            with open(tmp := part.with_name(part.name + ".tmp"), "wb") as f:
                f.writelines((json.dumps({"embedding": [round(float(x), 7) for x in e]}) + "\n").encode()
                             for e in rows)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, part)
        self.record.write(f"{block}\n")  # only now is the block kept
        self.record.flush()
        os.fsync(self.record.fileno())
        self.progress.block_done(len(rows))

    # --- the end ---------------------------------------------------------------------------------

    def finish(self):
        """This process is done; rank 0 waits for the others, then names the output and removes the job's folder."""
        if self.plan["complete"]:
            say(f"embedding: nothing to resume: {self.out} exists, and no job into it is unfinished", file=sys.stderr)
            return
        if self.proc.store is not None:
            self.proc.store.add("embed/finished", 1)
            if self.proc.rank != 0:
                return
            while int(self.proc.store.add("embed/finished", 0)) < self.proc.world:
                self.progress.report()
                time.sleep(0.1)
        blocks = -(-self.rows // self.size)
        if missing := sorted(set(range(blocks)) - recorded(self.folder, blocks, self.npy)):
            raise UserError(f"{self.folder}: {len(missing)} block(s) were not written (the first: {missing[0]}); "
                            f"another job may be writing into it")
        if self.npy and self.cfg.output_dtype in quantize.PRECISIONS:  # every row is in: int8's ranges are known
            quantize.write_output(self.folder / "rows.npy", self.out, self.cfg.output_dtype, self.ranges)
        elif self.npy:
            os.replace(self.folder / "rows.npy", self.out)
        else:
            write_atomic(self.out, lambda tmp: join_parts(self.folder, blocks, tmp))
        shares = blocks_by_rank(self.folder)
        release_run_folders()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.progress.done(shares if self.proc.world > 1 else "")

    def kept(self, rows: int, size: int = 0) -> int:
        """The rows of the blocks recorded in the job's folder (of `size` rows each: the job's --block)."""
        size = size or self.size
        return sum(min(size, rows - b * size) for b in recorded(self.folder, -(-rows // size), self.npy))

    def stopped(self, what: str, code: int, alone: bool = False) -> UserError:
        """The job's last line: what stopped it, the rows kept and the command that continues; a job that kept
        nothing leaves nothing (rank 0 removes its folder)."""
        if self.plan is None or self.plan["complete"]:
            return UserError(what, code, alone)
        kept = self.kept(self.rows) if self.folder.is_dir() else 0
        if kept == 0:
            if self.proc.rank == 0:
                release_run_folders()
                shutil.rmtree(self.folder, ignore_errors=True)
            return UserError(f"{what}; no block was finished, and nothing is kept", code, alone)
        return UserError(f"{what}; {kept:,} of {self.rows:,} rows kept in {self.folder} (continue with: "
                         f"{self.continue_command()})", code, alone)

    def continue_command(self) -> str:
        """The command as it was given, with --resume: on as many processes as now, or any other number."""
        args = [a for a in self.argv if a not in ("--overwrite", "--no-overwrite", "--resume", "--no-resume")]
        script = sys.argv[0] if sys.argv[0].endswith("embed.py") else "embed.py"
        flags = shlex.join([script, *args, "--resume"])
        world, machines = layout(self.proc.world).values()
        if world == 1:
            return f"python {flags}"
        if machines == 1:
            return f"torchrun --nproc_per_node={world} {flags}"
        return f"the torchrun command the job was started with, on each of its {machines} machines, for {flags}"

    def close(self):
        if self.record is not None:
            self.record.close()
        if self.fd is not None:
            os.close(self.fd)
        self.record = self.fd = None
        release_run_folders()


# -----------------------------------------------------------------------------------------------
# What a job is, on disk


def rows_depend_on(cfg, model, device, dtype, max_tokens: int) -> dict:
    """What a job's rows depend on besides its inputs, by the flag that sets each: a --resume that changes any of
    them is refused, as its rows would be two jobs' (the CPU threads are the user's to keep: docs/reference.md)."""
    files = sorted(Path(model.source).glob("*.safetensors"))
    weights = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return {"--model": {"folder": str(Path(model.source).resolve()), "weights": weights}, "--long": cfg.long,
            "--normalize": cfg.normalize, "--dtype": str(dtype).removeprefix("torch.") if dtype else "float32",
            "--device": device.type, "--batch-tokens": cfg.batch_tokens, "--block": cfg.block, "--format": cfg.format,
            "--output-dtype": cfg.output_dtype, "the model's length": max_tokens,
            **({"--text-field": cfg.text_field} if cfg.text_field != "text" else {}),  # as jobs before it had none
            # --no-onednn where it changes what runs (in bf16, where oneDNN's products would be swapped in)
            **({"--no-onednn": True} if not cfg.onednn and cpu_layers.chosen(device, dtype)[0] else {})}


def describe_inputs(inputs, copies: dict) -> list:
    """Each input as the job knows it: its path, size and time; standard input and pipes by their copy's size and
    hash (a pipe's path says nothing of what it carried)."""
    out = []
    for p in inputs:
        if p in copies:
            digest = hashlib.sha256()
            with open(copies[p], "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            out.append({"path": p, "size": copies[p].stat().st_size, "sha256": digest.hexdigest()})
        else:
            st = Path(p).stat()
            out.append({"path": str(Path(p).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def check_unchanged(saved: dict, now: dict, out: Path):
    """--resume goes on only with the inputs, model and flags the job began with; else one line saying what changed."""
    was, are = [i["path"] for i in saved["inputs"]], [i["path"] for i in now["inputs"]]
    if was != are:
        raise UserError(f"--resume: the job into {out} began with the inputs {', '.join(was)}, not "
                        f"{', '.join(are)}; give the same, or pass --overwrite to start afresh", code=2)
    for a, b in zip(saved["inputs"], now["inputs"], strict=True):
        if a != b:
            how = f"{a['size']:,} bytes then, {b['size']:,} now" if a["size"] != b["size"] else (
                "modified since" if "mtime_ns" in a else "another content of the same size")
            raise UserError(f"--resume: {a['path']} changed since the job into {out} began ({how}): its rows "
                            f"would not be one input's; pass --overwrite to start afresh")
    for name, value in now.items():
        if name != "inputs" and saved.get(name) != json.loads(json.dumps(value)):
            then = saved.get(name)
            if name == "--model":
                said = (f"{value['folder']} is not the model the job began with ({then['folder']})"
                        if then["folder"] != value["folder"] else f"{value['folder']}: its weights changed")
            else:
                said = f"{name} was {then!r} when the job began, {value!r} now"
            raise UserError(f"--resume: {said}: the rows would not be one job's; run it as it began, or pass "
                            f"--overwrite to start afresh", code=2)


def recorded(folder: Path, blocks: int, npy: bool) -> set[int]:
    """The blocks the job's records say are done (a line cut short by a kill is not; a .jsonl block also needs its
    part)."""
    done = set()
    for p in folder.glob("done-*"):
        for line in p.read_text(encoding="utf-8", errors="replace").split("\n")[:-1]:
            if line.isdigit() and int(line) < blocks:
                done.add(int(line))
    return done if npy else {b for b in done if (folder / part_name(b)).exists()}


def blocks_by_rank(folder: Path) -> str:
    """How this run's processes shared the blocks out, from their records: "16, 14" (a block done twice counts twice;
    a rank's earlier processes, before a resume, count with it)."""
    counts = {}
    for p in folder.glob("done-*"):
        rank = int(p.name.split("-")[1])
        counts[rank] = counts.get(rank, 0) + p.read_text(encoding="utf-8", errors="replace").count("\n")
    return ", ".join(f"{counts.get(r, 0)}" for r in range(max(counts, default=-1) + 1))


def ranges(blocks: list[int]) -> list[list[int]]:
    """[[start, end), ...] of a sorted list of block indices: a job's blocks left, small enough to pass round."""
    out = []
    for b in blocks:
        if out and out[-1][1] == b:
            out[-1][1] += 1
        else:
            out.append([b, b + 1])
    return out


def part_name(block: int) -> str:
    return f"block-{block:08d}.jsonl"


def npy_header(rows: int, hidden: int, dtype: np.dtype) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": dtype.str, "fortran_order": False, "shape": (rows, hidden)})
    return f.getvalue()


def join_parts(folder: Path, blocks: int, tmp: Path):
    """A .jsonl job's blocks, in input order, into one file."""
    with open(tmp, "wb") as f:
        for b in range(blocks):
            with open(folder / part_name(b), "rb") as part:
                shutil.copyfileobj(part, f, 1 << 20)


# -----------------------------------------------------------------------------------------------
# The whole job's progress


class JobProgress:
    """The job's progress, said by its first process: rows done of all (those kept from before counted), rows/s
    since this run began, and the time left. Each process adds the rows of the blocks it finishes to a count in the
    store; the first process adds what it has done of its block under way."""

    def __init__(self, job: Job):
        self.job, self.store, self.n, self.kept = job, job.proc.store, job.rows, job.kept_before
        self.finished = self.partial = self.windows = 0  # this run's blocks done (all processes), this block's texts
        self.asked = 0.0
        kept = f"; {self.kept:,} kept from before, {self.n - self.kept:,} to go" if self.kept else ""
        on = f" on {job.proc.world} processes" if job.proc.world > 1 else ""
        quiet = job.proc.rank != 0 or job.plan["complete"]
        runs = f" {job.runs}" if job.runs else ""
        self.line = Progress("embedding", f"{self.n:,} texts with {job.cfg.model}{runs}, into {job.out}{on}{kept}",
                             quiet)

    def __call__(self, texts: int, windows: int):  # embed.py's, after each batch: texts finished, windows they took
        self.partial, self.windows = self.partial + texts, self.windows + windows
        self.report()

    def block_done(self, rows: int):
        self.partial = 0
        if self.store is None:
            self.finished += rows
        else:
            self.store.add("embed/rows", rows)

    def done_rows(self) -> int:
        if self.store is not None and time.time() - self.asked >= 0.5:  # a round trip to the store, twice a second
            self.finished, self.asked = int(self.store.add("embed/rows", 0)), time.time()
        return self.kept + self.finished + self.partial

    def report(self):
        if self.line.quiet:
            return
        done, seconds = self.done_rows(), time.time() - self.line.t0
        rate = (done - self.kept) / max(seconds, 1e-9)
        eta = f", ETA {duration((self.n - done) / rate)}" if rate > 0 else ""
        windows = f" ({self.windows:,} windows)" if self.job.cfg.long == "chunk" and self.job.proc.world == 1 else ""
        self.line(f"{done:,}/{self.n:,} texts{windows}, {rate:,.0f} texts/s{eta}")

    def done(self, shares: str):
        seconds = time.time() - self.line.t0
        kept = f"; {self.kept:,} kept from before" if self.kept else ""
        shares = f"; blocks by rank: {shares}" if shares else ""
        what = {"int8": " int8", "binary": " bits"}.get(self.job.cfg.output_dtype, "")
        self.line.note(f"wrote {self.job.out}: {self.n:,} x {self.job.hidden}{what} ({seconds:.1f}s, "
                       f"{(self.n - self.kept) / max(seconds, 1e-9):,.0f} texts/s{kept}{shares})")


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def size(n: int) -> str:
    """Bytes as a person reads them: 512.1 kB, 307.2 GB (powers of 1000, as df -H and disk makers count)."""
    unit = next((u for u in ("TB", "GB", "MB", "kB") if n >= 1000 ** ("kMGT".index(u[0]) + 1)), "B")
    return f"{n:,} B" if unit == "B" else f"{n / 1000 ** ('kMGT'.index(unit[0]) + 1):,.1f} {unit}"
