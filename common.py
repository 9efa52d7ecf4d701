"""
common.py: plumbing the scripts share. A reader does not need this file to understand DeCLUTR, and it imports no
other file of the project.

One of each: the user-error type and the CLI wrapper that turns it into one line on stderr; the dataclass ->
command-line flags parser with its range checks; progress lines for the long phases; the atomic write (and JSON
and torch.save written with it), the cache folder, the offline switch; the reader of the user's documents (.txt,
.jsonl, gzip); token rows padded and copied to the device without waiting, and the precision --dtype means; and
the training run's plumbing: processes under torchrun meeting before their process group exists, checkpoints
written and found again, the run folder, the demo's documents.
"""
import argparse
import collections
import concurrent.futures
import contextlib
import fcntl
import functools
import gzip
import inspect
import io
import json
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
from dataclasses import MISSING, dataclass, field, fields
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist


class UserError(Exception):
    """Input that cannot be used (a path, a flag, a checkpoint); the message is one line meant for the user.
    Exit code 2 for a flag whose value is out of range (as argparse does), 1 for everything else. alone: under
    torchrun, this rank alone meets it (the others would stop on their own), so it says it whatever its rank."""

    def __init__(self, message: str, code: int = 1, alone: bool = False):
        super().__init__(message)
        self.code, self.alone = code, alone


def cli(main):
    """Wrap a script's main(argv): a UserError ends the process with `error: ...` on stderr and its exit code.
    Under torchrun every rank raises the same error, and only rank 0 prints it (unless it is the rank's alone)."""

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except UserError as e:
            say(f"error: {e}", file=sys.stderr, every_rank=e.alone)
            sys.exit(e.code)

    return wrapped


def say(*args, every_rank: bool = False, **kwargs):
    """print, by rank 0 alone: under torchrun every rank runs the same code, and one speaks for them all. The one
    way anything here prints."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------------------------
# Flags: one per config field, its comment as help, its range checked before any work


def bounded(default, low=None, high=None, strict: bool = False):
    """A config field whose value must lie in [low, high] ((low, high) when strict); either end may be open."""
    return field(default=default, metadata={"low": low, "high": high, "strict": strict})


def choice(default: str, *choices: str):
    return field(default=default, metadata={"choices": [default, *choices]})


def first_line(e: BaseException) -> str:
    """Another library's error message, as much of it as fits in our one line: its first sentence, without the
    [source file:line] that gloo's begin with."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()) or type(e).__name__
    return text.splitlines()[0].split(". ")[0][:200]


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise UserError(message, code=2)


def parse_config(cls, argv=None, doc: str = "", positional: tuple = ()):
    """A config dataclass from the command line: one flag per field (or a positional list for the fields named in
    `positional`), the field's comment as its help, every default shown by --help. Ranges and choices are checked
    here, then the class's own validate(), so that a bad value stops the run before any work."""
    # A field's help is the comment on its line in the class's source (`lr: float = 5e-5  # the help`), read here
    notes = {}  # each field's comment, a subclass's over its base's (TrainConfig extends SamplerConfig)
    for klass in reversed([k for k in cls.__mro__ if k is not object]):
        notes.update(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(klass), re.M))
    ap, lists = OneLineParser(description=doc, allow_abbrev=False), set()
    for f in fields(cls):
        if f.name in positional:
            ap.add_argument(f.name, nargs="+", help=notes.get(f.name, ""))
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        kw = dict(default=default, help=(notes.get(f.name, "") + " (default: %(default)s)").strip())
        if f.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, list):  # --data a b, or --model a --model b
            kw.update(nargs="+", type=str, action="extend", default=None)
            lists.add(f.name)
        else:
            kw["type"] = type(default) if default is not None else str
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        ap.add_argument("--" + f.name.replace("_", "-"), **kw)
    cfg = cls(**{k: [] if k in lists and v is None else v for k, v in vars(ap.parse_args(argv)).items()})
    for f in fields(cls):
        _check_range(f, getattr(cfg, f.name))
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def _check_range(f, value):
    """A number inside its field's range; nan and inf never are (a float flag accepts them unless refused here)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    low, high, strict = f.metadata.get("low"), f.metadata.get("high"), f.metadata.get("strict")
    # written as what is allowed, so that nan (false in every comparison) is refused
    above = low is None or (value > low if strict else value >= low)
    below = high is None or (value < high if strict else value <= high)
    if above and below and math.isfinite(value):
        return
    finite = ", and finite" if isinstance(value, float) else ""
    low, high = (f"{x:g}" if isinstance(x, float) else x for x in (low, high))
    if low is not None and high is not None:
        want = f"between {low} and {high}" + (", both excluded" if strict else "")
    elif low is not None:
        want = (f"greater than {low}" if strict else f"at least {low}") + finite
    elif high is not None:
        want = (f"less than {high}" if strict else f"at most {high}") + finite
    else:
        want = "a finite number"
    raise UserError(f"--{f.name.replace('_', '-')} {value}: must be {want}", code=2)


def given_fields(argv=None) -> set[str]:
    """The config fields named on the command line (`--lr 1e-3`, `--lr=1e-3`, `--no-mlm` all name theirs)."""
    argv = sys.argv[1:] if argv is None else argv
    names = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    return {n.removeprefix("no_") for n in names} | names


# -----------------------------------------------------------------------------------------------
# Progress of the long phases


class Progress:
    """A long phase's progress on stderr: it says what it does when it starts, then a live line on a terminal, or
    otherwise a plain line every `every` seconds (DECLUTR_PROGRESS_EVERY overrides 10), then how it ended."""

    def __init__(self, label: str, start: str, quiet: bool = False):
        self.label, self.quiet, self.tty = label, quiet, sys.stderr.isatty()
        self.every = float(os.environ.get("DECLUTR_PROGRESS_EVERY", "10"))
        self.t0 = self.last = time.time()
        self.note(start)

    def __call__(self, text: str):
        """Report `text` (where the phase is) if a report is due."""
        now = time.time()
        if self.tty and now - self.last >= 0.2:
            self.last = now
            if not self.quiet:
                say(f"\r{self.label}: {text}\033[K", end="", file=sys.stderr)
        elif not self.tty and now - self.last >= self.every:
            self.last = now
            self.note(f"{text} ({now - self.t0:.0f}s)")

    @contextlib.contextmanager
    def ticking(self, status):
        """Report status() every second (so, when due) while a call that reports nothing runs (it must release the
        GIL, as the tokenizers library's trainer does). The first chance comes at once, so that even a call shorter
        than a second has one (a report only if one is due: with the default `every`, none)."""
        stop = threading.Event()

        def tick():
            self(status())
            while not stop.wait(1.0):
                self(status())

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def note(self, text: str):
        """A line now (over the live line, on a terminal): the phase begins, ends, or moves on."""
        if not self.quiet:
            say(("\r\033[K" if self.tty else "") + f"{self.label}: {text}", file=sys.stderr)


# -----------------------------------------------------------------------------------------------
# Files


def write_atomic(path: Path, write, keep_existing: bool = False):
    """Call write(tmp) on a temporary name beside `path` (a file or a folder), then rename it into place: readers
    see the old version or the whole new one, never a part, and a crash midway leaves `path` as it was (its
    temporary is removed by the next write into the same folder). A full disk or a read-only folder is a
    UserError naming `path`. keep_existing: a folder that another process finished first (a cache) is kept."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.tmp")
    try:
        remove_stale_temporaries(path.parent)
        write(tmp)
        if tmp.is_dir() and path.is_dir() and not keep_existing:
            shutil.rmtree(path)  # a rename cannot replace a folder that holds files
        try:
            os.replace(tmp, path)
        except OSError:
            if not (keep_existing and path.is_dir()):
                raise
    except OSError as e:
        raise UserError(f"{path}: cannot write ({e.strerror or e})") from None
    except UserError as e:  # from a write_atomic inside this one: name the file where it would have been
        raise UserError(str(e).replace(str(tmp), str(path)), e.code) from None
    finally:  # a clean-up that fails (a read-only folder) must not hide the error it cleans up after
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


_HOST = socket.gethostname().split(".")[0] or "host"
_TEMPORARY = re.compile(r"^\..+\.(?P<host>[^.]+)\.(?P<pid>\d+)\.tmp$")


def remove_stale_temporaries(folder: Path):
    """Remove what write_atomic left in `folder` from a process of this machine that is no longer running (one
    killed midway): a half-written corpus, checkpoint or output."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        m = _TEMPORARY.match(p.name)
        if m and m["host"] == _HOST and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_json(path: Path, obj):
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def cache_dir(override: str = "") -> Path:
    """Where tokenised corpora, the demo's documents and downloads are kept: $XDG_CACHE_HOME/declutr by default."""
    return Path(override or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "declutr")


def writable_cache(override: str = "") -> Path:
    """The cache folder, made if need be; if it cannot be written, one line saying what to do about it."""
    hint = "choose a --cache-dir you can write" if override else "pass --cache-dir with a folder you can write"
    return make_dirs(cache_dir(override), hint)


def make_dirs(folder: Path, hint: str = "") -> Path:
    """mkdir -p, or one line saying why the folder cannot be written (and `hint`: what to do instead)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        writable = os.access(folder, os.W_OK)
        why = "read-only"
    except OSError as e:
        writable, why = False, e.strerror or str(e)
    if not writable:
        raise UserError(f"{folder}: cannot write there ({why})" + (f"; {hint}" if hint else ""))
    return folder


def offline() -> bool:
    """HF_HUB_OFFLINE, as huggingface_hub reads it: no download of models or datasets is attempted."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def read_json(path: Path, default=None):
    """The parsed file, `default` when it is absent (and a default is given), a UserError when it is unreadable."""
    if not path.exists() and default is not None:
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read JSON ({e})") from None


# -----------------------------------------------------------------------------------------------
# The user's documents: .txt (a document per file) and .jsonl (a document per line, field "text"), maybe gzipped


SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")


def list_files(paths) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"{p}: no such file or directory")
    if not files:
        raise UserError(f"no .txt or .jsonl files (optionally .gz) under {', '.join(map(str, paths))}")
    return files


def clean_text(text: str) -> str:
    """The original DeCLUTR's cleaning: every run of whitespace (spaces, tabs, newlines) becomes one space. Without it
    a byte-level BPE spends about a tenth of its tokens on whitespace, which would count toward span lengths and be
    MLM targets."""
    return " ".join(text.split())


def json_text(line: str):
    """The string field "text" of one JSONL line, or None when the line is not an object that has one."""
    try:
        text = json.loads(line).get("text")
    except (json.JSONDecodeError, AttributeError):
        return None
    return text if isinstance(text, str) else None


def read_documents(files, stats, clean: bool = True):
    """Yield each document's text (cleaned unless clean=False); count in `stats` what is skipped (empty, binary,
    malformed) and what was repaired (undecodable bytes)."""
    for f in files:
        replaced = 0
        try:
            with gzip.open(f) if f.name.endswith(".gz") else open(f, "rb") as raw:
                if b"\x00" in raw.peek(8192)[:8192]:  # binary, as git and grep decide it
                    stats["binary"] += 1
                    continue
                # newline=None turns CRLF and CR into LF; a byte that is not UTF-8 comes in as a stand-in (below)
                lines = io.TextIOWrapper(raw, encoding="utf-8", errors="surrogateescape", newline=None)
                raws = (line for line in lines if line.strip()) if ".jsonl" in f.name else [lines.read()]
                for text in raws:  # a .jsonl file is streamed line by line: it may be larger than memory
                    text, n = UNDECODABLE.subn("\ufffd", text)
                    replaced += n
                    text = json_text(text) if ".jsonl" in f.name else text
                    if text is None:
                        stats["malformed"] += 1
                    elif not text.strip():
                        stats["empty"] += 1
                    else:
                        yield clean_text(text) if clean else text.replace("\r\n", "\n").replace("\r", "\n")
        except (OSError, EOFError) as e:
            raise UserError(f"{f}: cannot read ({e})") from None
        stats["files_repaired"] += replaced > 0
        stats["bytes_replaced"] += replaced


# surrogateescape's stand-ins for the bytes that are not UTF-8, one per byte: each becomes U+FFFD
UNDECODABLE = re.compile("[\udc80-\udcff]")


def document_texts(paths, max_chars: int = 64 << 20, clean: bool = True):
    """The documents' texts, up to `max_chars` characters in all: what the BPE tokenizer of a model trained from
    scratch learns from (64M characters are plenty for its vocabulary), cleaned as the corpus is."""
    stats = collections.Counter()
    for text in read_documents(list_files(paths), stats, clean):
        yield text[:max_chars]
        max_chars -= len(text)
        if max_chars <= 0:
            return


# -----------------------------------------------------------------------------------------------
# Token rows onto the device: padding, page-locked copies, the next batch made while this one runs, precision


def pad_rows(rows, pad_id: int, width: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token id rows of any lengths -> (B, T) int64 ids padded on the right to the longest (or to `width`, if wider),
    and their 0/1 mask."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    ids = np.full((len(rows), max(width, int(lengths.max(initial=0)))), pad_id, dtype=np.int64)
    mask = (np.arange(ids.shape[1])[None] < lengths[:, None]).astype(np.int64)
    if len(rows):
        ids[mask.astype(bool)] = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    return ids, mask


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device. To a GPU from page-locked memory and without waiting: the copy runs while the host
    goes on, and the GPU never waits for the host to stage it (torch's pinned-memory cache keeps the buffer until the
    copy is done)."""
    if not array.flags.c_contiguous or min(array.strides, default=0) < 0:  # a reversed view, even of one element
        array = array.copy()
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def prefetched(items, work):
    """work(item) for each item, in order, the next one computed in a thread while the caller uses this one."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ahead = None
        for item in items:
            nxt = pool.submit(work, item)
            if ahead is not None:
                yield ahead.result()
            ahead = nxt
        if ahead is not None:
            yield ahead.result()


@dataclass
class Precision:  # train.py's --dtype
    dtype: str = choice("auto", "fp32", "bf16", "fp16")  # auto: CPU fp32; GPU bf16, or fp16 (loss-scaled) without it


@dataclass
class OnDevice:  # embed.py's and evaluate_sts.py's: a score is that of the embeddings embed.py writes
    dtype: str = choice("auto", "fp32", "bf16", "fp16")  # auto: bf16 if the GPU/CPU has it; else GPU fp16, CPU fp32
    device: str = "auto"  # auto (a GPU if torch sees one, else the CPU), cpu, cuda, cuda:1 ...
    threads: int = bounded(0, 0)  # torch CPU threads; 0: the cores free when it starts (as train.py's)


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX, or AVX512-BF16); elsewhere oneDNN emulates it, about 400x
    slower than fp32 (a 2048^2 matmul on an AVX2-only AMD EPYC: 0.27 against 113 GFLOP/s)."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def autocast_dtype(name: str, device: torch.device, cpu_bf16: bool = False):
    """--dtype as the dtype autocast computes in (None: fp32, no autocast). auto: bf16 on a GPU with bf16 tensor cores,
    fp16 on one without (a T4, a V100; the original DeCLUTR trained in fp16, loss-scaled); on a CPU, bf16 where it
    multiplies bf16 in hardware and `cpu_bf16` asks for it (embedding), else fp32 (training)."""
    if name == "auto" and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "auto" and cpu_bf16 and cpu_has_bf16():
        return torch.bfloat16
    return {"auto": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def autocast(dtype, device: torch.device):
    """Mixed precision in `dtype` (autocast_dtype's) on the device; fp32 (None) is no autocast at all."""
    if dtype in (None, torch.float32):
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def pick_device(name: str) -> torch.device:
    """--device: auto, cpu, cuda or cuda:N, as a device this torch has; a GPU always by its index (NCCL and DDP want
    one)."""
    try:
        device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UserError(f"--device {name}: not a device this project runs on (auto, cpu, cuda, cuda:N)", code=2)
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise UserError(f"--device {name}: this torch sees no GPU (torch.cuda.is_available() is False)", code=2)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UserError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)", code=2)
    return torch.device("cuda", index)


# -----------------------------------------------------------------------------------------------
# The training run: processes under torchrun, checkpoints, the run folder, the demo's documents (train.py)
# out/checkpoints/step-00000500/{model.safetensors, config.json, tokenizer.json, train_state.pt}


@dataclass
class Process:
    """This process among torchrun's: its ranks, its device, and the store where the processes meet."""
    rank: int
    local: int  # rank on this machine
    world: int
    device: torch.device
    store: object = None  # None for one process
    node: str = "0"  # torchrun's GROUP_RANK: which machine


def processes() -> Process:
    """This process as torchrun started it, or one plain process. One GPU per process; no process group yet."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    world, device = int(os.environ.get("WORLD_SIZE", "1")), torch.device("cpu")
    if torch.cuda.is_available():
        gpus, here = torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if here > gpus:  # every rank of the machine says so, rank 0 among them (only rank 0 prints)
            raise UserError(f"{here} processes on this machine but {gpus} GPU(s): start one process per GPU "
                            f"(torchrun --nproc_per_node={gpus})", code=2)
        device = pick_device(f"cuda:{local}")
        torch.cuda.set_device(device)
    return Process(rank, local, world, device, rendezvous(rank, world), os.environ.get("GROUP_RANK", "0"))


def rendezvous(rank: int, world: int):
    """The key-value store where torchrun's processes meet, before any process group exists; None for one process."""
    if world == 1:
        return None
    # torchrun's agent keeps its store across --max-restarts rounds: a prefix per round keeps restarted
    # workers from reading the addresses that the workers before them published.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent, timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"declutr/round-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_process_group(proc: Process, timeout_s: int):
    """NCCL on GPUs, gloo on CPUs, for processes that met in a store (torchrun's; none for one plain process); a
    collective that waits longer than timeout_s for another rank stops the job. The GPU is named with its index, as
    NCCL's process group must be bound to one device (processes() sets it)."""
    if proc.store is not None:
        cuda = proc.device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", store=proc.store, rank=proc.rank, world_size=proc.world,
                                timeout=timedelta(seconds=timeout_s), device_id=proc.device if cuda else None)


def store_broadcast(store, key: str, make, maker: bool) -> str:
    """make() (a string) on the one process that is `maker`; the others wait for it in the store, however long it
    takes: tokenising a corpus or training a tokenizer can take hours, longer than any collective may wait, so no
    process group exists yet. The maker's UserError is raised on every process that waits."""
    if store is None:
        return make()
    if maker:
        try:
            value = make()
        except UserError as e:
            store.set(key, f"error:{e.code}:{e}")
            raise
        store.set(key, "value:" + value)
        return value
    kind, value = _wait(store, key).split(":", 1)
    if kind == "error":
        code, message = value.split(":", 1)
        raise UserError(message, int(code))
    return value


def every_rank_says(store, key: str, what: str, rank: int, world: int) -> list[str]:
    """Every rank's `what`, in rank order, on every rank: each waits until all have said theirs."""
    if store is None:
        return [what]
    store.set(f"{key}/{rank}", what)
    return [_wait(store, f"{key}/{r}", f"rank {r}, saying its {key},") for r in range(world)]


def _wait(store, key: str, who: str = "") -> str:
    try:
        store.wait([key], timedelta(days=7))
    except dist.DistError as e:
        raise UserError(f"{who or f'the process preparing {key}'} stopped before it was done "
                        f"({first_line(e)})") from None
    return store.get(key).decode()


def prepare_run_folder(out: Path, resume_step: int | None):
    """Lock the run folder for this run, then clear an earlier run (--overwrite) or cut metrics.jsonl back to the
    checkpoint a resumed run continues."""
    make_dirs(out)
    lock_run_folder(out)  # before anything in it changes: a run still training there keeps all it has
    if resume_step is None:
        for p in (out / "checkpoints", out / "model", out / "best"):
            shutil.rmtree(p, ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    elif (out / "metrics.jsonl").exists():  # forget the steps after the checkpoint: they run again
        kept = "".join(line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()
                       if _step_of(line) <= resume_step)
        write_atomic(out / "metrics.jsonl", lambda tmp: tmp.write_text(kept))
    remove_stale_temporaries(out / "checkpoints")


LOCK = ".declutr.lock"  # in --out: who holds the run folder (pid, machine, since when, the command)
_held = {}  # the run folders this process holds: resolved path -> its open lock file


def lock_run_folder(out: Path, probe: bool = False):
    """An exclusive lock on a run folder until the process ends (or release_run_folders): a second run into the same
    --out, or --resume of a run still training there, is refused with one line naming the holder. The lock is the
    operating system's (flock), held by an open file, not the file's existence: a process that is killed (SIGKILL,
    a power loss) holds nothing any more, and the next run takes the folder. probe: refuse if it is held, write
    nothing."""
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
        raise UserError(f"--out {out}: another run is using it ({holder}); wait for it to end, or choose another "
                        f"--out") from None
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


def release_run_folders():
    """Give up every run folder this process holds (a run's end; the process's end does the same)."""
    for f in _held.values():
        f.close()
    _held.clear()


def _step_of(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):  # a line cut short by a kill
        return math.inf


def default_threads() -> int:
    """This rank's share of the cores that are free when it starts, at least one. torch's threads meet at a barrier
    after every operation, so one that shares its core with a busy process makes the others wait for it: on 2 cores
    beside one busy process, 2 threads ran at 0.4 of their idle speed and 1 thread at 0.6 of it; alone, 2 threads are
    1.9x 1 (all-MiniLM-L6-v2 in bf16, docs/measurements.md). A core counts as free when it was idle at least 3/4 of
    the moment measured."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return max(1, int(free_cores(cpus) + 0.25) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def free_cores(cpus, seconds: float = 0.1) -> float:
    """How many of these CPUs sat idle over the next `seconds` (this process sleeps meanwhile), by /proc/stat; all
    of them where that cannot be read (not Linux)."""
    try:
        before = _cpu_times(cpus)
        time.sleep(seconds)
        after = _cpu_times(cpus)
    except (OSError, ValueError, KeyError):
        return float(len(cpus))
    free = 0.0
    for cpu in cpus:
        idle, total = (a - b for a, b in zip(after[cpu], before[cpu], strict=True))
        free += idle / total if total > 0 else 1.0
    return free


def _cpu_times(cpus) -> dict[int, tuple[int, int]]:
    """{cpu: (idle ticks, all ticks)} since boot: /proc/stat's cpuN lines (user, nice, system, idle, iowait, irq,
    softirq, steal, ...)."""
    times = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(t) for t in ticks[:8]]
                times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return {cpu: times[cpu] for cpu in cpus}


@contextlib.contextmanager
def cpu_threads(n: int):
    """torch's CPU threads while a script runs: n, or default_threads(); as they were afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or default_threads())
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    final = out / "checkpoints" / f"step-{step:08d}"

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


def newest_checkpoint(out: Path, load_model):
    """(path, train state, load_model(path)) of the newest checkpoint that reads back whole, or None; one that does
    not is named, and the one before it used."""
    for path in reversed(checkpoints(out)):
        try:
            return path, read_train_state(path), load_model(path)
        except UserError as e:
            say(f"warning: {e}; resuming from the checkpoint before it", file=sys.stderr)
    return None


def read_train_state(path: Path) -> dict:
    try:  # tensors and plain data only
        state = torch.load(path / "train_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: the unpickler and the zip reader raise many kinds
        raise UserError(f"{path / 'train_state.pt'}: not readable ({first_line(e)})") from None
    if not isinstance(state, dict) or not {"optimizer", "step", "config"} <= set(state):
        raise UserError(f"{path / 'train_state.pt'}: not a train state of this project")
    return state


def demo_corpus(cache: str) -> Path:
    """Text that every Python installation carries, one document per file: the language reference's help
    topics (pydoc_data) and the docstrings of each standard-library module, read with ast (nothing imported)."""
    import ast
    import sysconfig
    from pydoc_data.topics import topics

    root = cache_dir(cache) / "demo-corpus"
    if root.exists():
        return root
    progress = Progress("demo", f"collecting Python's help topics and docstrings into {root}")
    docs = {f"topic-{k}": v for k, v in topics.items()}
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if {"test", "tests", "idlelib", "site-packages"} & set(f.parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs["module-" + "-".join(f.with_suffix("").parts[-2:])] = "\n\n".join(
            d for n in ast.walk(tree) if isinstance(n, kinds) and (d := ast.get_docstring(n)))

    def write(folder: Path):
        folder.mkdir(parents=True)
        for name, text in docs.items():
            if len(text) > 2000:
                (folder / f"{name}.txt").write_text(text, encoding="utf-8")

    writable_cache(cache)
    write_atomic(root, write, keep_existing=True)  # the folder appears whole, or not at all
    progress.note(f"{len(list(root.glob('*.txt')))} documents ({time.time() - progress.t0:.1f}s)")
    return root
