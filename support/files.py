"""
support/files.py: files that appear whole or not at all. The atomic write (a temporary beside the target, renamed
into place; what a killed writer left is removed by the next), JSON read and written with it, the cache folder, a
folder made or one line saying why it cannot be, the files under a folder (its links followed), what a path is, and
the offline switch.
"""
import contextlib
import json
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from support.cli import UserError


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


def read_json(path: Path, default=None):
    """The parsed file, `default` when it is absent (and a default is given), a UserError when it is unreadable."""
    if not path.exists() and default is not None:
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read JSON ({e})") from None


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


def files_under(root: Path) -> list[Path]:
    """Every file under root, sorted, links to folders followed (Path.rglob does not follow them before Python 3.13,
    and a corpus kept as links to its parts lost them silently): each real folder is read once, so a link back up
    the tree is not followed round, and a folder reached by two links gives its files once."""
    seen, found = set(), []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            subfolders[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        found += [p for p in (Path(folder) / n for n in names) if p.is_file()]
    return sorted(found)


def path_kind(path: Path) -> str:
    """What a path is, in a user's words: file, folder, pipe, character device, block device, socket, missing."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return "missing"
    kinds = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "pipe"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")


def check_out_folder(out: Path, overwrite: bool) -> Path:
    """A folder to write a model into: not a file, and not holding files already unless --overwrite."""
    if out.exists() and not out.is_dir():  # as train.py says it of its --out
        raise UserError(f"--out {out}: is a file, not a folder", code=2)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out}: holds files already; pass --overwrite to replace them")
    return out
