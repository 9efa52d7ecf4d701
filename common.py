"""
common.py: plumbing the scripts share. A reader does not need this file to understand DeCLUTR.

One of each: the user-error type and the CLI wrapper that turns it into one line on stderr, the dataclass ->
command-line flags parser with its range checks, the atomic write (and JSON written with it), the cache folder,
the offline switch and the JSON reader.
"""
import argparse
import functools
import inspect
import json
import os
import re
import shutil
import socket
import sys
from dataclasses import MISSING, field, fields
from pathlib import Path


class UserError(Exception):
    """Input that cannot be used (a path, a flag, a checkpoint); the message is one line meant for the user.
    Exit code 2 for a flag whose value is out of range (as argparse does), 1 for everything else."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def cli(main):
    """Wrap a script's main(argv): a UserError ends the process with `error: ...` on stderr and its exit code.
    Under torchrun every rank raises the same error, and only rank 0 prints it."""

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except UserError as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(e.code)

    return wrapped


# -----------------------------------------------------------------------------------------------
# Flags: one per config field, its comment as help, its range checked before any work


def bounded(default, low=None, high=None, strict: bool = False):
    """A config field whose value must lie in [low, high] ((low, high) when strict); either end may be open."""
    return field(default=default, metadata={"low": low, "high": high, "strict": strict})


def choice(default: str, *choices: str):
    return field(default=default, metadata={"choices": [default, *choices]})


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise UserError(message, code=2)


def parse_config(cls, argv=None, doc: str = "", positional: tuple = ()):
    """A config dataclass from the command line: one flag per field (or a positional list for the fields named in
    `positional`), the field's comment as its help, every default shown by --help. Ranges and choices are checked
    here, then the class's own validate(), so that a bad value stops the run before any work."""
    notes = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
    ap, lists = _Parser(description=doc, allow_abbrev=False), set()
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
    low, high, strict = f.metadata.get("low"), f.metadata.get("high"), f.metadata.get("strict")
    too_low = low is not None and (value <= low if strict else value < low)
    too_high = high is not None and (value >= high if strict else value > high)
    if not (too_low or too_high):
        return
    if low is not None and high is not None:
        want = f"between {low} and {high}" + (", both excluded" if strict else "")
    elif low is not None:
        want = f"greater than {low}" if strict else f"at least {low}"
    else:
        want = f"less than {high}" if strict else f"at most {high}"
    raise UserError(f"--{f.name.replace('_', '-')} {value}: must be {want}", code=2)


def given_fields(argv=None) -> set[str]:
    """The config fields named on the command line (`--lr 1e-3`, `--lr=1e-3`, `--no-mlm` all name theirs)."""
    argv = sys.argv[1:] if argv is None else argv
    names = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    return {n.removeprefix("no_") for n in names} | names


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
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
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
