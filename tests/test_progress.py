"""No silent minute: the long phases report progress when stderr is not a terminal (a log, a pipe), the embedding
counter counts texts and windows apart, and saved model files share the mode `open` would give them."""
import json
import os
import stat

import numpy as np

import embed as E
import model as M
from conftest import from_scratch, run_here


def test_chunk_counter_counts_texts_and_windows_apart():
    """Long texts split into several windows: texts are counted once each, when their last window is done."""
    model, tok = from_scratch("tiny", ["one two three four five six"] * 30, max_position_embeddings=22)
    texts = [" ".join(["one two three four five six"] * k) for k in (1, 6, 3, 9, 1, 12)]
    windows = sum(len(E._segments(e.ids, model.config.max_tokens, "chunk")) for e in tok.encode_batch(texts))
    seen = []
    E.encode(texts, model.eval(), tok, batch_tokens=40, long="chunk", progress=lambda t, w: seen.append((t, w)))
    done = np.cumsum(seen, axis=0)
    assert len(seen) > 3 and windows > len(texts)
    assert done[-1].tolist() == [len(texts), windows]  # today: 43 "texts" of 3
    assert (done[:, 0] <= len(texts)).all() and (done[:, 0] <= done[:, 1]).all()


def test_long_phases_report_progress_to_a_log(tmp_path, monkeypatch):
    """Each script's stderr as a log receives it (conftest.run_here: the scripts' main() in this process, stderr not a
    terminal), a report at every chance."""
    import evaluate_sts
    import sampler

    monkeypatch.setenv("DECLUTR_PROGRESS_EVERY", "0")
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"{i}.txt").write_text("the cat sat on the mat while a dog barked at the moon. " * 300)
    r = run_here(M.main, "scratch", "--corpus", tmp_path / "docs", "--out", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("tokenizer: training a byte-level BPE of 4,096 tokens")
    # between the first and the last line, where the trainer is ("reading the documents", "read 0.1M characters")
    assert len(lines) >= 3 and all(line.startswith("tokenizer: read") and line.endswith("s)") for line in lines[1:-1])
    assert lines[-1].startswith("tokenizer: ") and " tokens (" in lines[-1]
    (tmp_path / "t.txt").write_text("\n".join(["the cat sat on the mat " * 200] * 20) + "\n")
    r = run_here(E.main, "--model", tmp_path / "m", tmp_path / "t.txt", "--output", tmp_path / "e.npy", "--long",
                 "chunk", "--batch-tokens", "1024")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("embedding: 20 texts with") and lines[-1].startswith("embedding: wrote")
    counts = [line.split()[1] for line in lines[1:-1]]  # "embedding: 7/20 texts (40 windows), ..."
    assert len(counts) >= 2 and counts[-1] == "20/20" and all("windows" in line for line in lines[1:-1])
    r = run_here(sampler.main, "--model", tmp_path / "m", "--data", tmp_path / "docs", "--min-span", "8", "--max-span",
                 "32", "--docs-per-step", "3", "--cache-dir", tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "corpus: tokenising 3 files once" in r.stderr and "corpus: 3 documents" in r.stderr
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{i}\t{i}.0\tthe cat sat\tthe dog sat {i}\n"
                                                          for i in range(5)))
    r = run_here(evaluate_sts.main, "--model", tmp_path / "m", "--data", tmp_path / "sts", "--split", "dev", "--json",
                 tmp_path / "r.json")
    assert r.returncode == 0, r.stderr
    assert f"evaluate: {tmp_path / 'm'} on STSB" in r.stderr and "evaluate: STSB, 5 pairs" in r.stderr
    assert "5*" in r.stdout and "fewer than 100 pairs" in r.stdout  # a task of 5 pairs is marked, and why
    assert json.loads((tmp_path / "r.json").read_text())["STSB"]["few_pairs"] is True


def test_saved_model_files_share_one_mode(tmp_path):
    old = os.umask(0o027)
    try:
        M.save_pretrained(*from_scratch("tiny", ["a b c d e f g"] * 20), tmp_path / "m")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "m").rglob("*") if p.is_file()}
    assert set(modes.values()) == {0o640}, modes  # safetensors alone wrote 0600
