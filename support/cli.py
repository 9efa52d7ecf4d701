"""
support/cli.py: the command line. One error type whose message is one line for the user, the wrapper that prints it
and sets the exit code, the one way anything prints (rank 0 speaks for all), config dataclasses as flags with their
ranges checked before any work, and progress lines for the long phases.
"""
import argparse
import contextlib
import functools
import importlib
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import MISSING, field, fields


class UserError(Exception):
    """Input that cannot be used (a path, a flag, a checkpoint); the message is one line meant for the user.
    Exit code 2 for a flag whose value is out of range (as argparse does), 1 for everything else. alone: under
    torchrun, this rank alone meets it (the others would stop on their own), so it says it whatever its rank."""

    def __init__(self, message: str, code: int = 1, alone: bool = False):
        super().__init__(message)
        self.code, self.alone = code, alone


def cli(main):
    """Wrap a script's main(argv): a UserError ends the process with `error: ...` on stderr and its exit code, Ctrl-C
    with `error: interrupted` and 130.
    Under torchrun every rank raises the same error, and the first process of each machine prints it, so that every
    machine's log says what stopped it and what to do there (a rank's own error, `alone`, by that rank)."""

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main(argv)
        except UserError as e:
            say(f"error: {e}", file=sys.stderr, every_rank=e.alone, every_machine=True)
            sys.exit(e.code)
        except KeyboardInterrupt:  # Ctrl-C: one line and 130, as a shell reports it (train.py's names its checkpoint)
            say("error: interrupted", file=sys.stderr, every_machine=True)
            sys.exit(130)

    return wrapped


def bench(main):
    """A benchmark's main() (bench/): cli()'s one line for a UserError and Ctrl-C, and one line too for what a
    benchmark checks less carefully than the scripts do before it starts: a path that is missing, not writable or a
    folder where a file should be (an OSError), and a step it runs as a process of its own that failed (that process
    has said why)."""

    @functools.wraps(main)
    def wrapped(argv=None):
        try:
            return main()
        except OSError as e:
            if isinstance(e, (FileExistsError, NotADirectoryError)) and os.path.isfile(e.filename or ""):
                raise UserError(f"{e.filename}: is a file, where a folder should be") from None
            raise UserError(f"{e.filename}: {e.strerror}" if e.filename else str(e)) from None
        except subprocess.CalledProcessError as e:
            raise UserError(f"{step_name(e.cmd)} stopped with exit code {e.returncode}: {step_why(e)}") from None

    return cli(wrapped)


def shared_assets(root) -> str:
    """Where a benchmark's --shared points by default: DECLUTR_SHARED, as the tests read it, else the shared folder
    beside the checkout `root`."""
    return os.environ.get("DECLUTR_SHARED") or os.path.join(os.path.dirname(root), "shared")


def step_name(cmd) -> str:
    """A step a benchmark ran as a process, as a reader knows it: the script and its first argument, not the text of
    an embedded `python -c` program."""
    args = [str(c) for c in cmd] if isinstance(cmd, (list, tuple)) else str(cmd).split()
    if args[1:2] == ["-c"]:  # a program that runs a command (bench/_measure.py's timer) is named by that command
        return step_name(args[3:]) if args[3:] else "a python -c step"
    return " ".join(os.path.basename(a) for a in args[:3]) + " ..."


def step_why(e: subprocess.CalledProcessError) -> str:
    """The last line the failed step wrote, where it was captured (else it is above, on the terminal)."""
    for out in (e.stderr, e.output):
        text = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
        if lines := [line.strip() for line in text.splitlines() if line.strip()]:
            return lines[-1][:300]
    return "its output above says why"


def optional(module: str, install: str = ""):
    """A package this project does not require, imported, or one line naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"this needs {module}, which is not installed: pip install {install or module}") from None


def say(*args, every_rank: bool = False, every_machine: bool = False, **kwargs):
    """print, by rank 0 alone (every_machine: by the first process of each machine): under torchrun every rank runs
    the same code, and one speaks for them all. The one way anything here prints."""
    if every_rank or os.environ.get("LOCAL_RANK" if every_machine else "RANK", "0") == "0":
        print(*args, **kwargs, flush=True)


# -----------------------------------------------------------------------------------------------
# Flags: one per config field, its help and range given by flag(), its range checked before any work


def flag(default, help: str, low=None, high=None, strict: bool = False, choices=None, why: str = ""):
    """A config field and its flag: the default (`list`: an empty list), the flag's help, and the range its value must
    lie in ([low, high], or (low, high) when strict; either end may be open; `why`: what sets it, for the error) or the
    choices it must be one of."""
    meta = {"help": help, "low": low, "high": high, "strict": strict, "why": why} | (
        {"choices": list(choices)} if choices else {})
    return field(default_factory=list, metadata=meta) if default is list else field(default=default, metadata=meta)


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
    `positional`), its help from flag(), every default shown by --help. Ranges and choices are checked
    here, then the class's own validate(), so that a bad value stops the run before any work."""
    ap, lists = config_parser(cls, doc, positional)
    cfg = cls(**{k: [] if k in lists and v is None else v for k, v in vars(ap.parse_args(argv)).items()})
    for f in fields(cls):
        _check_range(f, getattr(cfg, f.name))
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def given_fields(cls, argv=None) -> set[str]:
    """The config fields that the command line names (`--lr 1e-3`, `--lr=1e-3`, `--no-mlm`): the same flags parsed
    again with no defaults, so that only what was given is left."""
    return set(vars(config_parser(cls, suppress=True)[0].parse_args(argv)))


def config_parser(cls, doc: str = "", positional: tuple = (), suppress: bool = False):
    """(the parser of cls's flags, the names of its list fields). A field's help is its metadata's (flag()); --help
    lists a class's own fields before those it inherits."""
    ap, lists = OneLineParser(description=doc, allow_abbrev=False), set()
    depth = {name: i for i, k in reversed(list(enumerate(cls.__mro__))) for name in getattr(k, "__annotations__", {})}
    for f in sorted(fields(cls), key=lambda f: depth[f.name]):
        help_ = f.metadata.get("help", "")
        if f.name in positional:
            ap.add_argument(f.name, nargs="+", help=help_)
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        kw = dict(default=default, help=(help_ + " (default: %(default)s)").strip())
        if f.type is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, list):  # --data a b, or --model a --model b
            kw.update(nargs="+", type=str, action="extend", default=None)
            lists.add(f.name)
        else:
            kw["type"] = type(default) if default is not None else str
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        if suppress:
            kw["default"] = argparse.SUPPRESS
        ap.add_argument("--" + f.name.replace("_", "-"), **kw)
    return ap, lists


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
    why = f" ({f.metadata['why']})" if f.metadata.get("why") else ""
    raise UserError(f"--{f.name.replace('_', '-')} {value}: must be {want}{why}", code=2)


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
