"""
support/corpus.py: the user's documents, read once and kept as token ids. Files are .txt (a document each), .jsonl
(a document per line, field "text" or --text-field), maybe gzipped, .parquet (a document a row, the same column, read
a row group at a time: pyarrow only then), or folders of them; each document is cleaned as the original
DeCLUTR cleans it, tokenised with the model's own tokenizer on every core, and written as one flat token file plus
document offsets, read back as a numpy memmap and cached by the files' names, sizes and times, the cleaning and the
tokenizer. Also the demo's documents: text every Python installation carries.
"""
import array
import collections
import gzip
import hashlib
import io
import itertools
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from support.cli import Progress, UserError, first_line, say
from support.files import files_under, path_kind, remove_stale_temporaries, writable_cache, write_atomic

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".parquet")


def list_files(paths) -> list[Path]:
    files = []
    for p in map(Path, paths):
        kind = path_kind(p)
        if kind == "folder":
            files += [f for f in files_under(p) if f.name.endswith(SUFFIXES)]
        elif kind == "file":
            files.append(p)
        elif kind == "missing":
            raise UserError(f"{p}: no such file or directory")
        else:  # a pipe (<(zcat docs.jsonl.gz)), /dev/null: read once, and with no name to tell its format by
            raise UserError(f"{p}: is a {kind}, not a file of documents; documents are .txt or .jsonl files (maybe "
                            f".gz: `--data docs.jsonl.gz` reads it as it is) or folders of them, each read more than "
                            f"once: save it to a file first")
    if not files:
        raise UserError(f"no .txt, .jsonl (optionally .gz) or .parquet files under {', '.join(map(str, paths))}")
    return files


def data_files(paths, field: str = "text") -> list[Path]:
    """list_files(paths), each Parquet file's column checked (pyarrow installed, the column there, strings), reading
    only their footers: what the documents need, said before a model loads or a corpus is prepared."""
    files = list_files(paths)
    for f in files:
        if f.name.endswith(".parquet"):
            parquet_file(f, field)
    return files


def clean_text(text: str) -> str:
    """The original DeCLUTR's cleaning: every run of whitespace (spaces, tabs, newlines) becomes one space. Without it
    a byte-level BPE spends about a tenth of its tokens on whitespace, which would count toward span lengths and be
    MLM targets."""
    return " ".join(text.split())


def json_text(line: str, field: str = "text"):
    """The string field `field` of one JSONL line, or None when the line is not an object that has one."""
    try:
        text = json.loads(line).get(field)
    except (json.JSONDecodeError, AttributeError):
        return None
    return text if isinstance(text, str) else None


def open_bytes(f: Path):
    """A file's bytes, gunzipped if its name ends in .gz."""
    return gzip.open(f) if f.name.endswith(".gz") else open(f, "rb")


def utf16(name: str, head: bytes) -> str:
    """One line where a file whose first bytes are `head` is UTF-16, not UTF-8, and how to convert it; else "". Told
    by its byte-order mark (Windows' Notepad and PowerShell write one), or without one by a NUL byte in every other
    place and few between (UTF-16 of Latin letters: "a" is 61 00 little-endian), which UTF-8 would read as text."""
    marks = {b"\xff\xfe": "FF FE", b"\xfe\xff": "FE FF"}
    if head[:2] in marks:
        return (f"{name}: UTF-16 (its byte-order mark {marks[head[:2]]}), not UTF-8: save it as UTF-8 "
                f"(iconv -f UTF-16 -t UTF-8 {name})")
    pairs = len(head) // 2
    zeros = {"LE": head[1:2 * pairs:2].count(0), "BE": head[0:2 * pairs:2].count(0)}
    for order, other in (("LE", "BE"), ("BE", "LE")):
        if pairs and zeros[order] >= pairs / 4 and zeros[other] <= zeros[order] / 8:
            endian = "little" if order == "LE" else "big"
            return (f"{name}: UTF-16 ({endian}-endian, without a byte-order mark: a NUL byte in every other place), "
                    f"not UTF-8: save it as UTF-8 (iconv -f UTF-16{order} -t UTF-8 {name})")
    return ""


def read_lines(path: Path, copy: Path | None = None, skipping=None, field: str = "text"):
    """embed.py's texts of one input, in order: each line of a .txt (empty lines too), the `field` of each line of a
    .jsonl, either maybe gzipped, or of each row of a .parquet (a null: an empty text, so that row i stays row i);
    "-" (standard input) and a pipe are read from their spooled `copy`. A byte-order mark that opens the input is not
    text. One line for what cannot be read: not UTF-8, UTF-16 (utf16), a NUL byte (rows would not be lines).
    skipping(), asked before each row: where it says True the row is None, neither decoded (.txt) nor parsed
    (.jsonl), as a process passes over the blocks that others embed."""
    src, name = copy or path, "stdin" if str(path) == "-" else str(path)
    jsonl = ".jsonl" in Path(src).name  # a copy's name says what its input's name or first line said
    if name.endswith(".parquet"):
        for text in parquet_texts(Path(src), field):
            yield None if skipping and skipping() else "" if text is None else text
        return
    try:
        with open_bytes(Path(src)) as f:
            if problem := utf16(name, f.peek(8192)[:8192]):
                raise UserError(problem)
            for n, raw in enumerate(f, 1):
                if skipping and not jsonl and skipping():
                    yield None
                    continue
                if b"\0" in raw:  # valid UTF-8, but no text has it: a binary file, or one in another encoding
                    raise UserError(f"{name}:{n}: a NUL byte at byte {raw.index(0)} of the line: not a text file")
                try:
                    line = raw.decode("utf-8-sig" if n == 1 else "utf-8").removesuffix("\n").removesuffix("\r")
                except UnicodeDecodeError as e:
                    raise UserError(f"{name}:{n}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
                if not jsonl:
                    yield line
                elif line.strip():
                    if skipping and skipping():
                        yield None
                    elif (text := json_text(line, field)) is None:
                        raise UserError(f"{name}:{n}: not a JSON object with a string field '{field}'")
                    else:
                        yield text
    except (OSError, EOFError) as e:  # EOFError: a .gz cut short
        raise UserError(f"{name}: cannot read ({getattr(e, 'strerror', None) or e})") from None


def read_documents(files, stats, clean: bool = True, field: str = "text"):
    """Yield each document's text (cleaned unless clean=False); count in `stats` what is skipped (empty or null,
    binary, malformed) and what was repaired (undecodable bytes)."""
    for f in files:
        if f.name.endswith(".parquet"):  # an empty file is one empty document, as an empty .txt is
            texts = (t or "" for t in parquet_texts(f, field)) if f.stat().st_size else [""]
        else:
            texts = _file_texts(f, stats, field)
        for text in texts:
            if text is None:
                stats["malformed"] += 1
            elif not text.strip():
                stats["empty"] += 1
            else:
                yield clean_text(text) if clean else text.replace("\r\n", "\n").replace("\r", "\n")


def _file_texts(f: Path, stats, field: str):
    """One file's texts: the whole of a .txt, each line's "text" of a .jsonl (None where a line has none), streamed
    (a .jsonl may be larger than memory); nothing of a binary file. A byte that is not UTF-8 becomes U+FFFD, counted.
    A UTF-16 file, whose NUL bytes would count it as binary and drop it unsaid, stops the run with how to convert it."""
    replaced, jsonl = 0, ".jsonl" in f.name
    try:
        with open_bytes(f) as raw:
            head = raw.peek(8192)[:8192]
            if problem := utf16(str(f), head):
                raise UserError(problem)
            if b"\x00" in head:  # binary, as git and grep decide it
                stats["binary"] += 1
                return
            # newline=None turns CRLF and CR into LF; a byte that is not UTF-8 comes in as a stand-in (below)
            # utf-8-sig: a byte-order mark that opens the file (Windows editors write one) is not text
            lines = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline=None)
            for text in (line for line in lines if line.strip()) if jsonl else [lines.read()]:
                text, n = UNDECODABLE.subn("\ufffd", text)
                replaced += n
                yield json_text(text, field) if jsonl else text
    except (OSError, EOFError) as e:
        raise UserError(f"{f}: cannot read ({e})") from None
    stats["files_repaired"] += replaced > 0
    stats["bytes_replaced"] += replaced


# surrogateescape's stand-ins for the bytes that are not UTF-8, one per byte: each becomes U+FFFD
UNDECODABLE = re.compile("[\udc80-\udcff]")


def parquet_file(f: Path, field: str):
    """A Parquet file (a Hugging Face dataset's) opened, its column `field` checked: only its footer is read; None for
    an empty file (0 bytes), which holds no rows, as an empty .txt holds no text. pyarrow is imported only here;
    without it, or for a file that is not Parquet or a column missing or not strings, one line."""
    try:
        import pyarrow.parquet as pq
        import pyarrow.types as pa_types
    except ImportError:
        raise UserError(f"{f}: reading Parquet needs pyarrow: pip install pyarrow") from None
    if f.is_file() and f.stat().st_size == 0:
        return None
    try:
        # Read a column chunk at a time (buffer_size), no row group ahead of time (pre_buffer): by default pyarrow
        # keeps every row group it has read, and a file larger than memory would not fit
        source = pq.ParquetFile(f, buffer_size=1 << 20, pre_buffer=False)
    except Exception as e:  # pyarrow's ArrowInvalid for a file without Parquet's magic bytes, OSError
        raise UserError(f"{f}: not a readable Parquet file ({first_line(e)})") from None
    schema = source.schema_arrow
    if field not in schema.names:
        raise UserError(f"{f}: no column '{field}' (it has {', '.join(schema.names[:8])}); --text-field names the "
                        f"column with the text")
    kind = schema.field(field).type
    if pa_types.is_dictionary(kind):  # strings stored once each, the rows pointing at them (a pandas categorical)
        kind = kind.value_type
    if not (pa_types.is_string(kind) or pa_types.is_large_string(kind) or str(kind) == "string_view"):
        raise UserError(f"{f}: column '{field}' holds {kind}, not strings")
    return source


def column_bytes(source, field: str) -> int:
    """The bytes of a Parquet file's column `field`, uncompressed, from its footer: about its texts' characters."""
    meta = source.metadata
    chunks = (meta.row_group(g).column(c) for g in range(meta.num_row_groups) for c in range(meta.num_columns))
    return sum(chunk.total_uncompressed_size for chunk in chunks if chunk.path_in_schema == field)


def parquet_texts(f: Path, field: str, rows: int = 4096, chars: int = 1 << 23):
    """The column `field` of a Parquet file, each row's string or None for a null, read `rows` at a time, or as many
    as hold about `chars` characters where its rows are long (books: 4,096 of them would be gigabytes at once):
    memory stays bounded on a file larger than it."""
    source = parquet_file(f, field)
    if source is None:  # an empty file: no rows
        return
    rows = max(1, min(rows, chars * source.metadata.num_rows // max(column_bytes(source, field), 1)))
    try:
        for batch in source.iter_batches(batch_size=rows, columns=[field]):
            yield from batch.column(0).to_pylist()  # a dictionary's rows as its strings
    except OSError as e:
        raise UserError(f"{f}: cannot read ({first_line(e)})") from None


def document_texts(paths, max_chars: int = 64 << 20, clean: bool = True, field: str = "text"):
    """The documents' texts, up to `max_chars` characters in all: what the BPE tokenizer of a model trained from
    scratch learns from (64M characters are plenty for its vocabulary), cleaned as the corpus is. The first is read
    at once: data without a single document is one line here, as the sampler says it of a corpus."""
    stats, files = collections.Counter(), list_files(paths)
    texts = read_documents(files, stats, clean, field)
    first = next(texts, None)
    if first is None:  # every file empty, binary or malformed
        raise UserError(f"no documents in the data: {len(files):,} files, 0 documents; skipped {stats['empty']} empty, "
                        f"{stats['binary']} binary, {stats['malformed']} malformed")
    return _up_to(itertools.chain([first], texts), max_chars)


def _up_to(texts, max_chars: int):
    for text in texts:
        yield text[:max_chars]
        max_chars -= len(text)
        if max_chars <= 0:
            return


# -----------------------------------------------------------------------------------------------
# The corpus: read every document once, tokenise, keep the ids on disk


class Corpus:
    """Token ids of every document, flat on disk: document i is tokens[offsets[i]:offsets[i + 1]]."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.meta = json.loads((directory / "meta.json").read_text())
        self.offsets = np.load(directory / "offsets.npy")
        self.lengths = np.diff(self.offsets)
        self._tokens = None

    @property
    def tokens(self):  # opened lazily, so each DataLoader worker maps the file itself
        if self._tokens is None:
            self._tokens = np.memmap(self.dir / "tokens.bin", dtype=self.meta["dtype"], mode="r") \
                if self.meta["tokens"] else np.zeros(0, dtype=self.meta["dtype"])
        return self._tokens

    def __getstate__(self):
        return {**self.__dict__, "_tokens": None}

    def __len__(self):
        return len(self.lengths)


def prepare_corpus(paths, tok, cache: str = "", clean: bool = True, field: str = "text") -> Corpus:
    """Tokenise the documents under `paths` once (batched over every core, whitespace cleaned unless clean=False)
    into a cached memmap; `field`: the text's in .jsonl and .parquet files."""
    files = data_files(paths, field)  # a bad Parquet file is one line before any work starts
    # The cache key: the tokenizer, the cleaning, the text's field where it is not "text", each file's path, size, time
    key = hashlib.sha256(tok.to_str().encode() + (b"clean" if clean else b"raw")
                         + (b"" if field == "text" else f"\0field={field}".encode()))
    for path, size, mtime in map(file_stamp, files):
        key.update(f"{path}\0{size}\0{mtime}\n".encode())
    root = writable_cache(cache)
    remove_stale_temporaries(root)  # what a preparation that was killed left
    out = root / f"corpus-{key.hexdigest()[:20]}"
    if (out / "meta.json").exists():
        corpus = Corpus(out)
        say(f"corpus: reusing {out}: {corpus.meta['summary']}", file=sys.stderr)
        return corpus
    progress = Progress("corpus", f"tokenising {len(files):,} files once, into {out}")
    # The cache folder appears whole or not at all; if another process (another machine's) finished it first, its
    # folder is kept
    write_atomic(out, lambda tmp: _tokenise(files, tok, tmp, progress, clean, field), keep_existing=True)
    corpus = Corpus(out)
    progress.note(f"{corpus.meta['summary']} ({time.time() - progress.t0:.1f}s)")
    return corpus


def _tokenise(files, tok, folder: Path, progress: Progress, clean: bool, field: str):
    """tokens.bin (every document's ids, one after another), offsets.npy and meta.json, written into `folder`."""
    folder.mkdir()
    dtype = np.uint16 if tok.get_vocab_size() <= 1 << 16 else np.uint32
    stats = dict(files=len(files), documents=0, empty=0, binary=0, malformed=0, files_repaired=0, bytes_replaced=0)
    offsets = array.array("q", [0])  # 8 bytes a document
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no character offsets: we only need ids
    with open(folder / "tokens.bin", "wb") as f:
        for texts in _batches(read_documents(files, stats, clean, field), 1 << 24):
            for e in encode(texts, add_special_tokens=False):
                ids = np.asarray(e.ids, dtype=dtype)
                f.write(ids.tobytes())
                offsets.append(offsets[-1] + len(ids))
            progress(f"{len(offsets) - 1:,} documents, {offsets[-1]:,} tokens, "
                     f"{offsets[-1] / (time.time() - progress.t0):,.0f} tokens/s")
    stats["documents"], stats["tokens"] = len(offsets) - 1, offsets[-1]
    np.save(folder / "offsets.npy", np.frombuffer(offsets, dtype=np.int64))
    summary = (f"{stats['files']:,} files, {stats['documents']:,} documents, {stats['tokens']:,} tokens; skipped "
               f"{stats['empty']} empty, {stats['binary']} binary, {stats['malformed']} malformed; "
               f"{stats['bytes_replaced']} undecodable bytes replaced in {stats['files_repaired']} files")
    # Each file's content digest, read again while the page cache holds it: a file whose time alone changed (touch,
    # a copy) is the same documents to a --resume (what_changed)
    meta = dict(stats, dtype=np.dtype(dtype).name, summary=summary, sources=[str(f) for f in files],
                digests=[file_digest(f) for f in files])
    (folder / "meta.json").write_text(json.dumps(meta))


def _batches(texts, max_chars: int):
    """Lists of texts of about `max_chars` characters (16M): memory stays bounded, every core stays busy."""
    batch, chars = [], 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# -----------------------------------------------------------------------------------------------
# Documents kept out of training, for held-out span retrieval (train.py --holdout-docs, --eval-docs)

# Not --seed: runs of every seed hold out the same documents, so their figures compare (70: the issue that brought
# held-out retrieval; any fixed number would do)
HOLDOUT_SEED = 70


def held_out(corpus: Corpus, share: float, by_place: bool = False, below: float | None = None):
    """--holdout-docs: (the indices of the documents held out, the point they lie below), the same on every rank, on
    resume and for every --seed. A document is held out by its content: each has a point in [0, 1), a hash of its
    tokens, and the round(share x documents) lowest are held out (at least one), a count the run says against the
    share. The run records the point between the last held out and the next (`below`), and a resume holds out what
    lies below it: a file added to --data or taken from it then moves no other document into or out of the run's
    held-out set. by_place: as runs begun before issue 78 chose them, that share of the documents by their place in
    the sorted file list (a file added moves others)."""
    count = min(len(corpus), max(1, round(share * len(corpus))))
    if by_place:
        return np.sort(np.random.default_rng(HOLDOUT_SEED).permutation(len(corpus))[:count]), None
    where = np.array([content_point(corpus, i) for i in range(len(corpus))])
    if below is None:
        ranked = np.sort(where)
        below = 1.0 if count == len(where) else float((ranked[count - 1] + ranked[count]) / 2)
    return np.flatnonzero(where < below), below


def content_point(corpus: Corpus, i: int) -> float:
    """Document i's place in [0, 1) by its content alone: a keyed hash of its tokens (HOLDOUT_SEED the key)."""
    tokens = corpus.tokens[corpus.offsets[i]:corpus.offsets[i + 1]]
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=8, key=str(HOLDOUT_SEED).encode()).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def describe_files(paths, corpus: Corpus | None = None) -> list[list]:
    """The files behind --data as a run records them in its checkpoints: [path, size, time] each (what the tokenised
    corpus's cache key is made of), and with `corpus` (theirs) each one's content digest after them, to tell on
    --resume whether they are still what the run trained on."""
    stamps = [file_stamp(f) for f in list_files(paths)]
    if corpus is None:
        return stamps
    kept, sources = corpus.meta.get("digests"), corpus.meta["sources"]  # a cache made before digests: read again
    by_path = {str(Path(f).resolve()): d for f, d in zip(sources, kept, strict=True)} if kept else {}
    return [[*stamp, by_path.get(stamp[0]) or file_digest(Path(stamp[0]))] for stamp in stamps]


def file_digest(f: Path) -> str:
    """SHA-1 of a file's bytes (1.1 GB/s here, twice BLAKE2's): whether a file changed, not a defence against
    anyone."""
    digest = hashlib.sha1(usedforsecurity=False)
    with open(f, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_stamp(f: Path) -> list:
    """[path, size, time] of one file: what tells that it changed, to the corpus's cache key and to --resume."""
    st = f.stat()
    return [str(f.resolve()), st.st_size, st.st_mtime_ns]


def what_changed(before: list[list], now: list[list]) -> str:
    """describe_files' two answers compared, in words: the files added, removed and changed (size or time; a time
    alone is no change where `before` holds the file's digest and its bytes still have it), with the first of each;
    "" where nothing changed."""
    old, new = {p: rest for p, *rest in before}, {p: rest for p, *rest in now}

    def changed(p: str) -> bool:
        (size, time, *digest), (size_now, time_now, *_) = old[p], new[p]
        if (size, time) == (size_now, time_now):
            return False
        return size != size_now or not digest or digest[0] != file_digest(Path(p))

    kinds = {"added": sorted(set(new) - set(old)), "removed": sorted(set(old) - set(new)),
             "changed": sorted(p for p in set(old) & set(new) if changed(p))}
    return "; ".join(f"{len(files)} {kind} ({Path(files[0]).name}{', ...' if len(files) > 1 else ''})"
                     for kind, files in kinds.items() if files)


def also_in(corpus: Corpus, other: Corpus) -> np.ndarray:
    """The indices of the corpus's documents whose tokens are also one of `other`'s documents (tokenised alike)."""
    def digest(c: Corpus, i: int) -> bytes:
        return hashlib.blake2b(c.tokens[c.offsets[i]:c.offsets[i + 1]].tobytes(), digest_size=16).digest()

    lengths = np.unique(corpus.lengths)
    theirs = {digest(other, j) for j in np.flatnonzero(np.isin(other.lengths, lengths))}  # only same-length ones
    return np.asarray([i for i in range(len(corpus)) if digest(corpus, i) in theirs], dtype=np.int64)


def texts_of(corpus: Corpus, docs, clean: bool = True, field: str = "text") -> dict[int, str]:
    """{document index: its text, cleaned as it was tokenised} for the corpus documents `docs`: read again from its
    files, which the corpus keeps only as token ids (held-out span retrieval cuts its spans' text from them)."""
    wanted, out = set(map(int, docs)), {}
    files = [Path(f) for f in corpus.meta["sources"]]
    for i, text in enumerate(read_documents(files, collections.Counter(), clean, field)):
        if i in wanted:
            out[i] = text
            if len(out) == len(wanted):
                break
    return out


def check_usable(batches, shortest: int, max_tokens: int, paper_max_span: int):
    """sampler.SpanBatches' documents: one line for what it cannot use (none, none long enough, too few for a step),
    or for what it uses; a --max-span lowered to fit the model's positions is said, unless it is the paper's 512
    (which counts the span inside <s> ... </s>)."""
    cfg, corpus, usable = batches.cfg, batches.corpus, len(batches.docs)
    if batches.max_span < cfg.max_span != paper_max_span:
        say(f"sampler: max_span {cfg.max_span} + 2 special tokens exceeds the model's {max_tokens} positions; "
            f"using {batches.max_span}", file=sys.stderr)
    if len(corpus) == 0:  # every file empty, binary or malformed: nothing to sample from, whatever the spans
        raise UserError(f"no documents in the data: {corpus.meta['summary']}")
    if usable == 0:
        raise UserError(f"no document has the {shortest:,} tokens that {cfg.num_anchors} anchors need (2·A·l_max); "
                        f"the longest has {int(corpus.lengths.max(initial=0)):,}. Lower --max-span or pass "
                        f"--scale-short-docs")
    if batches.per_rank == 0 or batches.steps_per_epoch == 0:
        raise UserError(f"{usable} usable documents cannot fill one step of {cfg.docs_per_step} documents over "
                        f"{batches.world} ranks")
    held = getattr(batches, "n_held_out", 0)
    kept = (f", {held:,} held out for evaluation (--holdout-docs {cfg.holdout_docs}: {held:,} of {len(corpus):,} "
            f"documents, {held / len(corpus):.1%})") if held else ""
    say(f"sampler: {usable:,} documents qualify, {len(corpus) - usable - held:,} skipped as shorter than {shortest:,} "
        f"tokens{kept}; {batches.steps_per_epoch:,} steps per epoch", file=sys.stderr)


def show_batch(b: dict, tok, A: int, P: int, documents: int):
    """`python sampler.py`: a batch of sampler.SpanBatches in numbers, then the spans of its first `documents`
    documents as text, each anchor followed by its P positives."""
    a_len, p_len = b["anchor_lengths"], b["positive_lengths"]
    print(f"step 0: {len(b['anchors'])} anchors of {a_len.min()}-{a_len.max()} tokens, "
          f"{len(b['positives'])} positives of {p_len.min()}-{p_len.max()}, "
          f"{int((b['mlm_labels'] != -100).sum())} MLM targets")

    def clip(ids, n):  # a span's text without <s> and </s>, on one line
        return tok.decode(ids[1:n - 1].tolist())[:160].replace("\n", " ")

    for k in range(min(documents, len(b["anchors"]) // A) * A):
        print(f"\ndocument {int(b['anchor_doc'][k])}, anchor {k % A}: {clip(b['anchors'][k], a_len[k])}")
        for j in range(k * P, (k + 1) * P):
            print(f"  positive: {clip(b['positives'][j], p_len[j])}")
