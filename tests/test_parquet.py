"""Parquet in: a Hugging Face dataset's file gives train.py the same corpus (token ids) and embed.py the same rows as
the same texts in .jsonl; --text-field for both formats; read a row group at a time; each bad file one line."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import embed as E
import train as T
from conftest import ROOT, WORDS, oracle, run_here
from support import corpus
from support.cli import UserError
from support.corpus import prepare_corpus

oracle("pyarrow")  # a test requirement (requirements-dev.txt), not a runtime one: only .parquet readers need it


def texts(n=300, seed=0):
    """n documents of 50-400 words, some empty and some null (None), as a dataset's column can have them."""
    rng = np.random.default_rng(seed)
    out = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), rng.integers(50, 400))) for _ in range(n)]
    out[7], out[19], out[n // 2 + 3] = "", None, "   "
    return out


def write_parquet(path, column, name="text", row_group_size=64, **more):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({name: pa.array(column, type=pa.string()), **more}), path, row_group_size=row_group_size)
    return path


def write_jsonl(path, column, name="text"):
    path.write_text("".join(json.dumps({name: t if t is not None else ""}) + "\n" for t in column))
    return path


def test_parquet_gives_the_jsonl_corpus_token_for_token(tmp_path, tiny):
    from support.hub import load_tokenizer

    tok = load_tokenizer(tiny)
    docs = texts()
    a = prepare_corpus([write_parquet(tmp_path / "train-00000-of-00001.parquet", docs)], tok, str(tmp_path / "c"))
    b = prepare_corpus([write_jsonl(tmp_path / "docs.jsonl", docs)], tok, str(tmp_path / "c"))
    assert a.dir != b.dir  # two files, two cache entries
    assert np.array_equal(a.offsets, b.offsets) and np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert a.meta["documents"] == 297 and a.meta["empty"] == 3 == b.meta["empty"]  # null and blank rows counted
    # and against the tokenizer itself, document by document
    kept = [" ".join(t.split()) for t in docs if t and t.strip()]
    assert [len(e.ids) for e in tok.encode_batch(kept, add_special_tokens=False)] == list(a.lengths)


def test_text_field_names_the_column_and_the_json_field(tmp_path, tiny):
    from support.hub import load_tokenizer

    tok = load_tokenizer(tiny)
    docs = texts(40)
    other = ["not this"] * 40
    pq_file = write_parquet(tmp_path / "d.parquet", docs, name="body", other=other)
    js_file = write_jsonl(tmp_path / "d.jsonl", docs, name="body")
    a = prepare_corpus([pq_file], tok, str(tmp_path / "c"), field="body")
    b = prepare_corpus([js_file], tok, str(tmp_path / "c"), field="body")
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)) and a.meta["documents"] == 37
    with pytest.raises(UserError, match="no column 'text' .*--text-field"):
        prepare_corpus([pq_file], tok, str(tmp_path / "c2"))


def test_a_folder_of_parquet_files_trains(tmp_path, tiny):
    """train.py --data FOLDER of .parquet shards (as the hub's datasets are), two steps end to end."""
    import train

    (tmp_path / "data").mkdir()
    docs = [t for t in texts(64) if t and t.strip()]
    write_parquet(tmp_path / "data" / "train-00000-of-00002.parquet", docs[:30])
    write_parquet(tmp_path / "data" / "train-00001-of-00002.parquet", docs[30:])
    train.main(["--model", str(tiny), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run"), "--steps", "2",
                "--docs-per-step", "4", "--min-span", "8", "--max-span", "32", "--workers", "0",
                "--cache-dir", str(tmp_path / "cache")])
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_embed_reads_parquet_as_the_same_jsonl(tmp_path, tiny, monkeypatch):
    """The same rows, byte for byte, on one process and on two (each reads its own blocks of the row groups);
    a null row is an empty text, so that row i of the output is row i of the file."""
    docs = [t[:200] if t else t for t in texts(120)]
    pq_file = write_parquet(tmp_path / "t.parquet", docs, row_group_size=16)
    js_file = write_jsonl(tmp_path / "t.jsonl", docs)
    for src in (pq_file, js_file):
        E.main(["--model", str(tiny), str(src), "--output", str(tmp_path / f"{src.suffix[1:]}.npy"), "--block", "25",
                "--dtype", "fp32"])
    a, b = np.load(tmp_path / "parquet.npy"), np.load(tmp_path / "jsonl.npy")
    assert a.shape[0] == 120 and a.tobytes() == b.tobytes()
    decoded, real = [], corpus.parquet_texts  # the count comes from the footer: every string is decoded once
    monkeypatch.setattr(corpus, "parquet_texts", lambda *args: decoded.append(args) or real(*args))
    E.main(["--model", str(tiny), str(pq_file), "--output", str(tmp_path / "again.npy"), "--block", "25",
            "--dtype", "fp32"])
    assert len(decoded) == 1 and np.load(tmp_path / "again.npy").tobytes() == a.tobytes()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", "29641",
           str(ROOT / "embed.py"), "--model", str(tiny), str(pq_file), "--output", str(tmp_path / "two.npy"),
           "--block", "25", "--dtype", "fp32", "--threads", "1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    assert np.load(tmp_path / "two.npy").tobytes() == a.tobytes()


def test_a_dictionary_column_and_an_empty_file_read_as_strings_and_as_an_empty_txt(tmp_path, tiny):
    """A dictionary-encoded string column (a pandas categorical, as exported datasets often store text) is its
    strings: the corpus and the rows of the plain column's file. A 0-byte .parquet in a folder is skipped and
    counted as an empty document, as a 0-byte .txt beside it is; given to embed.py, it holds no rows, as a 0-byte .txt
    holds none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from support.hub import load_tokenizer

    tok, docs = load_tokenizer(tiny), texts(60)
    plain = write_parquet(tmp_path / "plain.parquet", docs)
    coded = tmp_path / "coded.parquet"
    pq.write_table(pa.table({"text": pa.array(docs, type=pa.string()).dictionary_encode()}), coded)
    assert pa.types.is_dictionary(pq.ParquetFile(coded).schema_arrow.field("text").type)
    a, b = (prepare_corpus([f], tok, str(tmp_path / "c")) for f in (plain, coded))
    assert np.array_equal(np.asarray(a.tokens), np.asarray(b.tokens)) and a.meta["documents"] == 57
    for f in (plain, coded):
        E.main(["--model", str(tiny), str(f), "--output", str(tmp_path / f"{f.stem}.npy"), "--dtype", "fp32"])
    assert np.load(tmp_path / "coded.npy").tobytes() == np.load(tmp_path / "plain.npy").tobytes()
    for name in ("empty.parquet", "empty.txt"):
        folder = tmp_path / name.replace(".", "-")
        folder.mkdir()
        write_parquet(folder / "docs.parquet", docs)
        (folder / name).write_bytes(b"")
        c = prepare_corpus([folder], tok, str(tmp_path / "c"))
        assert (c.meta["files"], c.meta["documents"], c.meta["empty"]) == (2, 57, 4), name
        E.main(["--model", str(tiny), str(folder / name), str(plain), "--output", str(folder / "e.npy"),
                "--dtype", "fp32"])
        assert np.load(folder / "e.npy").tobytes() == np.load(tmp_path / "plain.npy").tobytes()


@pytest.mark.parametrize("what, says", [
    ("not-parquet", "not a readable Parquet file"),
    ("no-column", "no column 'text' (it has body)"),
    ("not-strings", "column 'text' holds int64, not strings"),
    ("no-pyarrow", "reading Parquet needs pyarrow: pip install pyarrow"),
])
@pytest.mark.parametrize("script", ["train.py", "embed.py"])
def test_a_bad_parquet_file_is_one_line(tmp_path, tiny, what, says, script, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    if what == "not-parquet":
        f.write_text("the quick brown fox\n" * 50)
    elif what == "not-strings":
        pq.write_table(pa.table({"text": list(range(50))}), f)
    else:
        pq.write_table(pa.table({"body" if what == "no-column" else "text": ["a text"] * 50}), f)
    if what == "no-pyarrow":
        for name in ("pyarrow", "pyarrow.parquet", "pyarrow.types"):
            monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    monkeypatch.chdir(tmp_path)
    args = (["--data", str(f), "--out", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "c"), "--steps", "1"]
            if script == "train.py" else [str(f), "--output", str(tmp_path / "e.npy")])
    done = run_here(T.main if script == "train.py" else E.main, "--model", tiny, *args)  # the scripts in this process
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"error: {f}: ") and says in done.stderr, done.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "e.npy").exists()


def test_train_says_what_the_documents_need_before_it_loads_a_model(tmp_path, tiny, monkeypatch):
    """Without pyarrow, train.py on Parquet documents says so before it loads the model (a hub model may be gigabytes
    to download): the model is never asked for."""
    import train

    write_parquet(tmp_path / "d.parquet", texts(20))
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.types"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: importing it fails
    loaded = []
    monkeypatch.setattr(train, "load_pretrained", lambda *a, **k: loaded.append(a))
    with pytest.raises(UserError, match="reading Parquet needs pyarrow: pip install pyarrow"):
        train.setup(train.TrainConfig(model=str(tiny), data=[str(tmp_path / "d.parquet")], out=str(tmp_path / "run"),
                                      cache_dir=str(tmp_path / "c")), {"model", "data", "out"},
                    train.Process(0, 0, 1, torch.device("cpu")))
    assert loaded == [] and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_a_file_is_read_a_row_group_at_a_time(tmp_path):
    """Memory stays bounded on a file larger than it: what pyarrow holds while the rows stream by never comes near
    the file's size (40 row groups of ~1 MB: at most a few at a time)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from support.corpus import parquet_texts

    rng = np.random.default_rng(0)
    with pq.ParquetWriter(tmp_path / "big.parquet", pa.schema([("text", pa.string())]), compression="none") as w:
        for _ in range(40):
            w.write_table(pa.table({"text": [" ".join(rng.choice(WORDS, 100)) for _ in range(1500)]}))
    size, held, rows = (tmp_path / "big.parquet").stat().st_size, 0, 0
    for _ in parquet_texts(tmp_path / "big.parquet", "text"):
        rows += 1
        held = max(held, pa.total_allocated_bytes()) if rows % 500 == 0 else held
    assert rows == 60_000 and held < size / 8, (held, size)


@pytest.mark.slow
def test_long_rows_are_read_a_few_at_a_time(tmp_path):
    """A file of long rows (books), in row groups of 8: the rows come in batches of about 8M characters, not of 4,096
    rows, which here would be the whole file at once (pyarrow reads a row group's column whole, so no less than
    that)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from support.corpus import parquet_texts

    rng = np.random.default_rng(1)
    words = rng.choice(WORDS, 200_000)
    books = [" ".join(np.roll(words, k)) for k in range(48)]  # ~1 MB a row, each its own
    pq.write_table(pa.table({"text": books}), tmp_path / "books.parquet", compression="none", use_dictionary=False,
                   row_group_size=8)
    size, held, rows = (tmp_path / "books.parquet").stat().st_size, 0, 0
    for _ in parquet_texts(tmp_path / "books.parquet", "text"):
        rows += 1
        held = max(held, pa.total_allocated_bytes())
    assert rows == 48 and held < size / 2, (held, size)
