"""
support/quantize.py: embeddings as vector databases take them, int8 (4x smaller than float32) and binary (32x),
computed as sentence-transformers' quantize_embeddings computes them, so that the bytes are the same. embed.py writes
them (--output-dtype int8 | binary), evaluate_sts.py scores them side by side with float32 (--output-dtype).
"""
from pathlib import Path

import numpy as np

from support.cli import UserError
from support.files import write_atomic

PRECISIONS = ("int8", "binary")
CHUNK = 1 << 16  # rows at a time: memory stays bounded for outputs of any size


def ranges_of(rows) -> np.ndarray:
    """(2, d) float32: each dimension's lowest and highest value over every row (an array or a memmap)."""
    low = high = None
    for i in range(0, len(rows), CHUNK):
        part = np.asarray(rows[i:i + CHUNK], dtype=np.float32)
        low = part.min(0) if low is None else np.minimum(low, part.min(0))
        high = part.max(0) if high is None else np.maximum(high, part.max(0))
    return np.vstack((low, high)).astype(np.float32)


def quantize(rows, precision: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """int8: each dimension's range cut into 256 equal steps, its lowest value -128 and its highest 127; binary: a
    bit a dimension, 1 where the value is above 0, packed 8 to a byte (sentence-transformers' "ubinary")."""
    rows = np.asarray(rows, dtype=np.float32)
    if precision == "binary":
        return np.packbits(rows > 0, axis=-1)
    starts = ranges[0]
    steps = (ranges[1] - starts) / 255
    steps = np.where(steps == 0, 1, steps)  # a dimension that never varies: every value in its first step
    return (np.clip(np.floor((rows - starts) / steps), 0, 255) - 128).astype(np.int8)


def width(hidden: int, precision: str) -> int:
    return hidden if precision == "int8" else -(-hidden // 8)


def write_quantized(src: Path, out: Path, precision: str, ranges: np.ndarray | None):
    """The float32 rows of the .npy `src` written to `out` at `precision`, CHUNK rows at a time."""
    rows = np.load(src, mmap_mode="r")
    dtype = np.dtype(np.int8 if precision == "int8" else np.uint8)

    def write(tmp: Path):
        with open(tmp, "wb") as f:
            header = {"descr": dtype.str, "fortran_order": False, "shape": (len(rows), width(rows.shape[1], precision))}
            np.lib.format.write_array_header_1_0(f, header)
            for i in range(0, len(rows), CHUNK):
                f.write(quantize(rows[i:i + CHUNK], precision, ranges).tobytes())

    write_atomic(out, write)


def ranges_path(out: Path) -> Path:
    """Where an int8 output's ranges go: beside it, emb.npy -> emb.ranges.npy."""
    return out.with_name(out.name.removesuffix(".npy") + ".ranges.npy")


def read_ranges(path: Path, hidden: int) -> np.ndarray:
    """--ranges FILE: (2, hidden) floats, as embed.py writes them beside an int8 output; one line for anything else,
    saying what the file is and what --ranges takes. Never unpickled."""
    takes = f"--ranges takes the (2, {hidden}) .ranges.npy that embed.py --output-dtype int8 writes beside its output"
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise UserError(f"--ranges {path}: cannot be read ({e.strerror}); {takes}") from None
    if not head.startswith(b"\x93NUMPY"):  # an .npy file's magic
        raise UserError(f"--ranges {path}: {_what_file(head)}, not an .npy file; {takes}")
    try:
        r = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        what = "holds Python objects, which are never unpickled" if "pickle" in str(e) else f"cannot be read ({e})"
        raise UserError(f"--ranges {path}: {what}; {takes}") from None
    if r.shape != (2, hidden) or r.dtype.kind != "f" or not np.isfinite(r).all():
        raise UserError(f"--ranges {path}: holds {r.dtype} {r.shape}; a {hidden}-dimensional model's ranges are "
                        f"(2, {hidden}) finite floats, as embed.py writes them beside an int8 output")
    return r.astype(np.float32)


def _what_file(head: bytes) -> str:
    """What the first bytes of a file that is not an .npy say it is."""
    if not head:
        return "an empty file"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:  # not just a character cut at the end of what was read
            return "a binary file"
    return "a text file"


def similarities(a: np.ndarray, b: np.ndarray, precision: str) -> np.ndarray:
    """Row by row: cosine for float32 and int8 rows (as numbers), Hamming similarity (the share of equal bits) for
    binary ones."""
    if precision == "binary":
        return 1 - np.unpackbits(a ^ b, axis=-1).sum(1) / (8 * a.shape[1])
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def write_output(src: Path, out: Path, precision: str, ranges: np.ndarray | None = None):
    """A finished job's float32 rows (the .npy `src`) into `out` at `precision`. int8 without ranges given: the rows'
    own, written beside `out` first (ranges_path), for the queries embedded later (--ranges)."""
    if precision == "int8" and ranges is None:
        ranges = ranges_of(np.load(src, mmap_mode="r"))
        write_atomic(ranges_path(out), lambda tmp: tmp.write_bytes(_npy_bytes(ranges)))
    write_quantized(src, out, precision, ranges)


def _npy_bytes(a: np.ndarray) -> bytes:
    import io

    f = io.BytesIO()
    np.save(f, a)
    return f.getvalue()
