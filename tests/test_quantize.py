"""int8 and binary out (support/quantize.py): embed.py's bytes against sentence-transformers' quantize_embeddings on
the same float32 rows, with the job's own ranges and with --ranges; on two processes and after a resume; what
evaluate_sts.py scores at each dtype against the same computed from sentence-transformers; each refusal one line."""
import os
import subprocess
import sys

import numpy as np
import pytest
from test_embed_job import args, disk_full_at, small  # noqa: F401 (small: a fixture)

import embed as E
from conftest import ROOT, minilm, oracle, run_here, stsb_dev
from support import embed_job, quantize

st = oracle("sentence_transformers")


@pytest.mark.slow
@pytest.mark.parametrize("precision, theirs", [("int8", "int8"), ("binary", "ubinary")])
def test_bytes_are_sentence_transformers_on_the_same_float_rows(tmp_path, tiny, small, precision, theirs):  # noqa: F811
    out = tmp_path / "q.npy"
    E.main(args(tiny, small, out, "--output-dtype", precision))
    floats = np.load(small / "one.npy")  # the same job at float32
    want = st.quantize_embeddings(floats, precision=theirs)
    got = np.load(out)
    assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    assert out.stat().st_size < (0.26 if precision == "int8" else 0.04) * (small / "one.npy").stat().st_size
    ranges = quantize.ranges_path(out)
    if precision == "int8":  # the ranges beside it are the rows' own, as sentence-transformers computes them
        assert np.array_equal(np.load(ranges), np.vstack((floats.min(0), floats.max(0))))
    else:
        assert not ranges.exists()


def test_queries_embedded_later_reuse_the_ranges(tmp_path, tiny, small):  # noqa: F811
    """--ranges: the corpus's ranges quantise the queries (their own would put them on another scale)."""
    E.main(args(tiny, small, tmp_path / "corpus.npy", "--output-dtype", "int8"))
    (tmp_path / "q.txt").write_text("the quick fox\na lazy dog judges\nseven wizards\n")
    E.main(["--model", str(tiny), str(tmp_path / "q.txt"), "--output", str(tmp_path / "q.npy"), "--output-dtype",
            "int8", "--ranges", str(tmp_path / "corpus.ranges.npy"), "--threads", "1"])
    E.main(["--model", str(tiny), str(tmp_path / "q.txt"), "--output", str(tmp_path / "qf.npy"), "--threads", "1"])
    ranges = np.load(tmp_path / "corpus.ranges.npy")
    want = st.quantize_embeddings(np.load(tmp_path / "qf.npy"), precision="int8", ranges=ranges)
    assert np.load(tmp_path / "q.npy").tobytes() == want.tobytes()
    assert not (tmp_path / "q.ranges.npy").exists()  # the ranges were given, not computed


@pytest.mark.slow
def test_two_processes_and_a_resume_give_one_process_bytes(tmp_path, tiny, small, monkeypatch, capsys):  # noqa: F811
    E.main(args(tiny, small, tmp_path / "one.npy", "--output-dtype", "int8"))
    one = (tmp_path / "one.npy").read_bytes()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", "29643",
           str(ROOT / "embed.py"), *args(tiny, small, tmp_path / "two.npy", "--output-dtype", "int8")]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert (tmp_path / "two.npy").read_bytes() == one
    assert (tmp_path / "two.ranges.npy").read_bytes() == (tmp_path / "one.ranges.npy").read_bytes()
    # a disk that fills half way: the blocks before it are kept (as float32), --resume ends with the same bytes
    real = disk_full_at(5, monkeypatch)
    with pytest.raises(SystemExit):
        E.main(args(tiny, small, tmp_path / "r.npy", "--output-dtype", "int8"))
    assert not (tmp_path / "r.npy").exists() and not (tmp_path / "r.ranges.npy").exists()
    monkeypatch.setattr(embed_job.os, "pwrite", real)
    E.main(args(tiny, small, tmp_path / "r.npy", "--output-dtype", "int8", "--resume"))
    assert (tmp_path / "r.npy").read_bytes() == one


@pytest.mark.slow
def test_evaluate_scores_each_dtype_as_sentence_transformers_would(tmp_path):
    """STS-B dev's first 500 pairs for all-MiniLM-L6-v2 at float32, int8 and binary, against the same scores worked out
    from sentence-transformers' encode and quantize_embeddings (int8's ranges from the same sentences), fp32. (The
    whole of STS-B dev's 86.72 is tests/test_evaluate_sts.py's.)"""
    import json

    import evaluate_sts
    from support.sts_files import read_stsb

    (tmp_path / "sts").mkdir()
    first = stsb_dev().read_text(encoding="utf-8").splitlines(True)[:500]
    (tmp_path / "sts" / "sts-dev.csv").write_text("".join(first), encoding="utf-8")
    evaluate_sts.main(["--model", str(minilm()), "--data", str(tmp_path / "sts"), "--split", "dev", "--tasks",
                       "STSB", "--dtype", "fp32", "--output-dtype", "int8", "binary", "--json",
                       str(tmp_path / "r.json")])
    ours = json.loads((tmp_path / "r.json").read_text())
    a, b, gold = read_stsb(tmp_path / "sts" / "sts-dev.csv")
    assert len(gold) == 500
    uniq = list(dict.fromkeys(a + b))
    emb = st.SentenceTransformer(str(minilm()), device="cpu").encode(uniq, normalize_embeddings=True)
    ia, ib = [uniq.index(s) for s in a], [uniq.index(s) for s in b]
    i8 = st.quantize_embeddings(emb, precision="int8").astype(float)
    bits = st.quantize_embeddings(emb, precision="ubinary")
    theirs = {
        "float32": (emb[ia] * emb[ib]).sum(1),
        "int8": (i8[ia] * i8[ib]).sum(1) / np.linalg.norm(i8[ia], axis=1) / np.linalg.norm(i8[ib], axis=1),
        "binary": -np.unpackbits(bits[ia] ^ bits[ib], axis=1).sum(1).astype(int),  # fewer bits apart: more similar
    }
    name = str(minilm())
    for precision, sims in theirs.items():
        want = 100 * evaluate_sts.spearman(sims, gold)
        key = name if precision == "float32" else f"{name} {precision}"
        assert ours[key]["STSB"]["spearman"] == pytest.approx(want, abs=0.01 if precision == "float32" else 0.05)
    assert ours[f"{name} binary"]["STSB"]["spearman"] < ours[f"{name} int8"]["STSB"]["spearman"] < \
        ours[name]["STSB"]["spearman"]


@pytest.mark.parametrize("extra, says", [
    (["--output", "OUT/e.jsonl", "--output-dtype", "int8"], "--output-dtype int8: for .npy only"),
    (["--output-dtype", "binary", "--ranges", "OUT/r.npy"], "--ranges: for --output-dtype int8 only"),
    (["--output-dtype", "int8", "--ranges", "OUT/bad.npy"], "--ranges OUT/bad.npy: holds float64 (3, 5); a 64-dim"),
    (["--output-dtype", "int8", "--ranges", "OUT/obj.npy"], "--ranges OUT/obj.npy: holds Python objects, which are "
                                                            "never unpickled; --ranges takes the (2, 64) .ranges.npy"),
    (["--output-dtype", "int8", "--ranges", "OUT/none.npy"], "--ranges OUT/none.npy: cannot be read (No such file"),
    (["--output-dtype", "int8", "--ranges", "OUT/in.txt"], "--ranges OUT/in.txt: a text file, not an .npy file; "
                                                           "--ranges takes the (2, 64) .ranges.npy that embed.py"),
    (["--output-dtype", "int8"], "--output OUT/e.npy: its ranges OUT/e.ranges.npy exist; pass --overwrite"),
])
def test_a_quantised_output_it_cannot_write_is_one_line(tmp_path, tiny, extra, says):
    (tmp_path / "in.txt").write_text("a text\nanother\n")
    np.save(tmp_path / "bad.npy", np.zeros((3, 5)))
    np.save(tmp_path / "obj.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    (tmp_path / "e.ranges.npy").write_bytes(b"the user's own")
    argv = ["--output", str(tmp_path / "e.npy"), *[x.replace("OUT", str(tmp_path)) for x in extra]]
    done = run_here(E.main, "--model", tiny, tmp_path / "in.txt", *argv)  # embed.py, in this process
    err = done.stderr.replace(str(tmp_path), "OUT")
    assert done.returncode in (1, 2) and err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert "allow_pickle" not in err
    assert not (tmp_path / "e.npy").exists() and (tmp_path / "e.ranges.npy").read_bytes() == b"the user's own"
