"""
common.py: plumbing the scripts share. A reader does not need this file to understand DeCLUTR.

One of each: the user-error type and the CLI wrapper that turns it into one line on stderr, the dataclass ->
command-line flags parser, the atomic write (and JSON written with it), the cache folder, the offline switch and
the JSON reader.
"""
import argparse
import functools
import inspect
import json
import os
import re
import shutil
import sys
from dataclasses import MISSING, fields
from pathlib import Path


class UserError(Exception):
    """Input that cannot be used (a path, a flag, a checkpoint); the message is one line meant for the user."""


def cli(main):
    """Wrap a script's main(argv): a UserError ends the process with `error: ...` on stderr and exit code 1.
    Under torchrun every rank raises the same error, and only rank 0 prints it."""

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except UserError as e:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(1)

    return wrapped


def parse_config(cls, argv=None, doc: str = "", positional: tuple = ()):
    """A config dataclass from the command line: one flag per field (or a positional list for the fields named in
    `positional`), the field's comment as its help, every default shown by --help."""
    notes = dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))
    ap, lists = argparse.ArgumentParser(description=doc), set()
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
    args = vars(ap.parse_args(argv))
    return cls(**{k: [] if k in lists and v is None else v for k, v in args.items()})


def write_atomic(path: Path, write, keep_existing: bool = False):
    """Call write(tmp) on a temporary name beside `path` (a file or a folder), then rename it into place: readers
    see the old version or the whole new one, never a part, and a crash midway leaves `path` as it was.
    keep_existing: a folder that another process finished first (the same content, a cache) is kept as it is."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if tmp.is_dir() and path.is_dir() and not keep_existing:
            shutil.rmtree(path)  # a rename cannot replace a folder that holds files
        try:
            os.replace(tmp, path)
        except OSError:
            if not (keep_existing and path.is_dir()):
                raise
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def write_json(path: Path, obj):
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2) + "\n"))


def cache_dir(override: str = "") -> Path:
    """Where tokenised corpora, the demo's documents and downloads are kept: $XDG_CACHE_HOME/declutr by default."""
    return Path(override or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "declutr")


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
