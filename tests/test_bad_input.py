"""Bad input to every script: the exit code, one line on stderr naming the flag or the file and the problem, and
the user's files as they were. Flags out of range stop a run before any work (exit 2); files that cannot be read
or written stop it with exit 1; nothing of an earlier run is deleted until everything has been checked."""
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import embed as E
import evaluate_sts as V
import model as M
import train as T
from conftest import ROOT, from_scratch
from support import runs
from support.cli import UserError
from support.files import write_atomic


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def earlier_run(tmp_path):
    """An out folder holding a run the user wants to keep."""
    out = tmp_path / "earlier"
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    (out / "checkpoints" / "step-00000002" / "model.safetensors").write_bytes(b"weights")
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    return out


def fails(main, argv, capsys):
    """(exit code, the one error line) of main(argv); fails the test on a traceback or several lines."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return e.value.code, lines[0]


# --- train.py: every flag checked at parse time, before the corpus is read ------------------------------------

TRAIN_FLAGS = [
    (["--num-anchors", "0"], "--num-anchors 0: must be at least 1"),
    (["--num-positives", "0"], "--num-positives 0: must be at least 1"),
    (["--min-span", "0"], "--min-span 0: must be at least 1"),
    (["--min-span", "64", "--max-span", "32"], "--min-span 64: must be at most --max-span 32"),
    (["--temperature", "0"], "--temperature 0.0: must be between 0 and 10, both excluded"),
    (["--lr", "-0.001"], "--lr -0.001: must be between 0 and 1, both excluded"),
    (["--mlm-probability", "0"], "--mlm-probability 0.0: must be between 0 and 1, both excluded"),
    # numbers a float flag parses that cannot train: nan and inf everywhere, and values past any sensible range
    (["--mlm-probability", "nan"], "--mlm-probability nan: must be between 0 and 1, both excluded"),
    (["--temperature", "nan"], "--temperature nan: must be between 0 and 10, both excluded"),
    (["--temperature", "inf"], "--temperature inf: must be between 0 and 10, both excluded"),
    (["--temperature", "1e30"], "--temperature 1e+30: must be between 0 and 10, both excluded"),
    (["--lr", "nan"], "--lr nan: must be between 0 and 1, both excluded"),
    (["--lr", "inf"], "--lr inf: must be between 0 and 1, both excluded"),
    (["--warmup-frac", "nan"], "--warmup-frac nan: must be between 0 and 1"),
    (["--weight-decay", "nan"], "--weight-decay nan: must be between 0 and 1"),
    (["--weight-decay", "inf"], "--weight-decay inf: must be between 0 and 1"),
    (["--weight-decay", "1e30"], "--weight-decay 1e+30: must be between 0 and 1"),
    (["--lr-ratio", "nan"], "--lr-ratio nan: must be between 1 and 1e+06"),
    (["--lr-ratio", "inf"], "--lr-ratio inf: must be between 1 and 1e+06"),
    (["--max-grad-norm", "nan"], "--max-grad-norm nan: must be between 0 and 1e+06, both excluded"),
    (["--ddp-timeout", "0"], "--ddp-timeout 0: must be between 1 and 604800"),
    (["--seed", "-1"], "--seed -1: must be between 0 and 4294967295"),
    (["--steps", "1000000000000000000000000000000"],
     "--steps 1000000000000000000000000000000: must be between 0 and 10000000"),
    (["--mlm-probability", "1"], "--mlm-probability 1.0: must be between 0 and 1, both excluded"),
    (["--steps", "-1"], "--steps -1: must be between 0 and 10000000"),
    (["--epochs", "0"], "--epochs 0: must be between 1 and 1000000"),
    (["--docs-per-step", "0"], "--docs-per-step 0: must be at least 1"),
    (["--ckpt-every", "0"], "--ckpt-every 0: must be at least 1"),
    (["--log-every", "0"], "--log-every 0: must be at least 1"),
    (["--eval-every", "-1"], "--eval-every -1: must be at least 0"),
    (["--keep-ckpts", "0"], "--keep-ckpts 0: must be at least 1"),
    (["--keep-ckpts", "-1"], "--keep-ckpts -1: must be at least 1"),
    (["--warmup-frac", "1.5"], "--warmup-frac 1.5: must be between 0 and 1"),
    (["--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    (["--docs-per-step", "1", "--num-anchors", "1"], "needs at least 2 anchors a step, or it has no negative"),
    (["--no-mlm", "--no-contrastive"], "--no-mlm and --no-contrastive together leave nothing to train"),
    (["--resume"], "--resume and --overwrite"),
    (["--model", "scratch:huge"], "--model scratch:huge: unknown shape"),
    (["--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["--ste", "5"], "unrecognized arguments: --ste 5"),  # no guessing of abbreviated flags
]


@pytest.mark.parametrize("flags, expect", TRAIN_FLAGS, ids=[" ".join(f) for f, _ in TRAIN_FLAGS])
def test_train_flags(tmp_path, docs, earlier_run, capsys, flags, expect):
    before = snapshot(earlier_run)
    argv = ["--model", "scratch:tiny", "--data", str(docs), "--out", str(earlier_run), "--overwrite",
            "--cache-dir", str(tmp_path / "cache"), "--workers", "0", *flags]
    code, line = fails(T.main, argv, capsys)
    assert code == 2 and expect in line, line
    assert snapshot(earlier_run) == before and not (tmp_path / "cache").exists()  # nothing read, nothing lost


def test_train_paths_checked_before_the_earlier_run_is_replaced(tmp_path, docs, earlier_run, capsys, monkeypatch):
    """Today a typo in --data or --model with --overwrite empties the earlier run and trains nothing."""
    monkeypatch.chdir(tmp_path)
    before = snapshot(earlier_run)
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("too short")
    (tmp_path / "a-file").write_text("mine")
    cases = [(["--data", str(tmp_path / "nope")], 1, "nope: no such file or directory"),
             (["--model", "./tiny-modl"], 1, "./tiny-modl: no such folder"),
             (["--model", "runs/x/model"], 1, "runs/x/model: no such folder"),
             (["--eval-data", str(tmp_path / "no-sts")], 1, "no-sts: no sts-dev.csv"),
             (["--out", str(tmp_path / "a-file")], 2, "is a file, not a folder"),
             (["--data", str(tmp_path / "short")], 1, "no document has the 128 tokens")]
    for flags, want_code, expect in cases:
        data = [] if "--data" in flags else ["--data", str(docs)]  # --data a --data b would read both
        argv = ["--model", "scratch:tiny", *data, "--out", str(earlier_run), "--overwrite", "--docs-per-step", "4",
                "--min-span", "8", "--max-span", "32", "--cache-dir", str(tmp_path / "cache"), "--workers", "0", *flags]
        code, line = fails(T.main, argv, capsys)
        assert code == want_code and expect in line, line
        assert snapshot(earlier_run) == before
        assert str(tmp_path / "short") in flags or not (tmp_path / "cache").exists()  # stopped before the corpus
    assert (tmp_path / "a-file").read_text() == "mine"


# --- full disks and read-only folders ---------------------------------------------------------------------------


def limited(max_bytes):
    """A child process that may write files of at most max_bytes: a disk that fills up (EFBIG, as ENOSPC would)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))


@pytest.mark.parametrize("where, max_bytes, expect", [("corpus", 4_000, "cache/corpus-"),
                                                      ("weights", 60_000, "checkpoints/step-00000002"),
                                                      ("train state", 1_000_000, "checkpoints/step-00000002")])
@pytest.mark.slow
def test_train_on_a_full_disk_is_one_line(tmp_path, docs, where, max_bytes, expect):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", "scratch:tiny", "--data", str(docs),
                        "--out", str(tmp_path / "run"), "--min-span", "8", "--max-span", "32", "--docs-per-step", "4",
                        "--steps", "2", "--ckpt-every", "2", "--cache-dir", str(tmp_path / "cache"), "--workers", "0"],
                       capture_output=True, text=True, timeout=300, preexec_fn=limited(max_bytes))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expect in last and "cannot write (File too large)" in last
    assert not list(tmp_path.rglob("*.tmp"))  # no half-written corpus or checkpoint left behind


def test_unwritable_cache_says_what_to_do(tmp_path, docs, capsys, monkeypatch):
    """A --cache-dir the user gave that cannot be written: choose another. The default one: pass --cache-dir."""
    (tmp_path / "a-file").write_text("")
    common = ["--model", "scratch:tiny", "--data", str(docs), "--out", str(tmp_path / "run"), "--min-span", "8",
              "--max-span", "32"]
    code, line = fails(T.main, [*common, "--cache-dir", str(tmp_path / "a-file" / "c")], capsys)
    assert code == 1 and "a-file/c: cannot write there" in line
    assert line.endswith("; choose a --cache-dir you can write")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file" / "xdg"))
    code, line = fails(T.main, common, capsys)
    assert code == 1 and "cannot write there" in line
    assert line.endswith("; pass --cache-dir with a folder you can write")


# --- embed.py -----------------------------------------------------------------------------------------------


def test_embed_never_overwrites_what_the_user_has(tmp_path, tiny, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("a cat\na dog\n")
    code, line = fails(E.main, ["--model", str(tiny), str(texts), "--output", str(texts), "--format", "npy"], capsys)
    assert code == 1 and "is also an input" in line and texts.read_text() == "a cat\na dog\n"
    (tmp_path / "old.npy").write_bytes(b"precious")
    code, line = fails(E.main, ["--model", str(tiny), str(texts), "--output", str(tmp_path / "old.npy")], capsys)
    assert code == 1 and "exists; pass --overwrite" in line and (tmp_path / "old.npy").read_bytes() == b"precious"
    E.main(["--model", str(tiny), str(texts), "--output", str(tmp_path / "old.npy"), "--overwrite"])
    assert np.load(tmp_path / "old.npy").shape == (2, 64)
    (tmp_path / "folder.npy").mkdir()
    code, line = fails(E.main, ["--model", str(tiny), str(texts), "--output", str(tmp_path / "folder.npy")], capsys)
    assert code == 1 and "is a folder" in line


def test_embed_format_follows_the_output_name(tmp_path, tiny, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("a cat\na dog\n")
    E.main(["--model", str(tiny), str(texts), "--output", str(tmp_path / "e.jsonl")])
    rows = [json.loads(line)["embedding"] for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and len(rows[0]) == 64
    code, line = fails(E.main, ["--model", str(tiny), str(texts), "--output", str(tmp_path / "e.txt")], capsys)
    assert code == 2 and "cannot tell the format" in line and not (tmp_path / "e.txt").exists()


@pytest.mark.parametrize("flags, expect", [(["--block", "0"], "--block 0: must be at least 1"),
                                           (["--batch-tokens", "-1"], "--batch-tokens -1: must be at least 0"),
                                           (["--dtype", "bogus"], "invalid choice: 'bogus'"),
                                           (["--long", "cut"], "invalid choice: 'cut'"),
                                           (["--format", "csv"], "invalid choice: 'csv'"),
                                           (["--model", "./tiny-modl"], "./tiny-modl: no such folder")])
def test_embed_flags(tmp_path, tiny, capsys, flags, expect):
    texts = tmp_path / "texts.txt"
    texts.write_text("a cat\n")
    code, line = fails(E.main, ["--model", str(tiny), str(texts), "--output", str(tmp_path / "e.npy"), *flags], capsys)
    assert code == (1 if "no such folder" in expect else 2) and expect in line, line
    assert not (tmp_path / "e.npy").exists()


def test_embed_on_a_full_disk_leaves_nothing(tmp_path, tiny):
    (tmp_path / "texts.txt").write_text("a cat sat on the mat\n" * 2000)  # 2,000 x 64 floats: 512 KB
    r = subprocess.run([sys.executable, str(ROOT / "embed.py"), "--model", str(tiny), str(tmp_path / "texts.txt"),
                        "--output", str(tmp_path / "e.npy")], capture_output=True, text=True, timeout=300,
                       preexec_fn=limited(100_000))
    # the whole output is laid out before the first row: a limit it would meet stops it at once, with one line
    assert r.returncode == 1 and r.stderr == f"error: {tmp_path / 'e.npy'}: cannot write (File too large)\n", r.stderr
    assert not (tmp_path / "e.npy").exists() and not list(tmp_path.glob(".e.npy*"))


def test_embed_into_a_disk_too_small_says_so_at_once(tmp_path, tiny, capsys, monkeypatch):
    (tmp_path / "texts.txt").write_text("a cat sat on the mat\n" * 2000)  # 2,000 x 64 floats: 512 KB
    monkeypatch.setattr("shutil.disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100_000, 100_000))
    code, line = fails(E.main, ["--model", str(tiny), str(tmp_path / "texts.txt"), "--output", str(tmp_path / "e.npy")],
                       capsys)
    assert code == 1 and line == f"error: --output {tmp_path / 'e.npy'}: needs 512.0 kB, and 100.0 kB are free there"
    assert not list(tmp_path.glob("*.npy*")) and not list(tmp_path.glob(".e.npy*"))


def test_truncated_tokenizer_json_is_one_line(tmp_path, tiny, capsys):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny.iterdir():
        if f.is_file():
            (d / f.name).write_bytes(f.read_bytes())
    (d / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes()[:500])
    (tmp_path / "t.txt").write_text("a cat\n")
    code, line = fails(E.main, ["--model", str(d), str(tmp_path / "t.txt"), "--output", str(tmp_path / "e.npy")],
                       capsys)
    assert code == 1 and "tokenizer.json: not a readable tokenizer file" in line


# --- evaluate_sts.py ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["text", "nan", "sick-short", "semeval-text"])
def test_gold_scores_that_are_not_numbers(tmp_path, capsys, case):
    d = tmp_path / "sts"
    d.mkdir()
    if case in ("text", "nan"):
        score = "abc" if case == "text" else "nan"
        (d / "sts-dev.csv").write_text(f"g\tf\t2012\t1\t4.0\tA cat.\tA cat sits.\ng\tf\t2012\t2\t{score}\tA\tB\n")
        expect = f"sts-dev.csv:2: gold score '{score}' is not a number"
    elif case == "sick-short":
        (d / "SICK_trial.txt").write_text("pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
                                          "1\tA cat.\tA cat sits.\t4.5\tNEUTRAL\n2\tA dog.\n")
        expect = "SICK_trial.txt:3: expected 5 tab-separated columns, found 2"
    else:
        (d / "STS12").mkdir()
        (d / "STS12" / "STS.input.MSRvid.txt").write_text("A cat.\tA cat sits.\nA dog.\tA dog runs.\n")
        (d / "STS12" / "STS.gs.MSRvid.txt").write_text("4.0\nfour\n")
        expect = "STS.gs.MSRvid.txt:2: gold score 'four' is not a number"
    split = "test" if case == "semeval-text" else "dev"
    code, line = fails(V.main, ["--model", "whatever", "--data", str(d), "--split", split], capsys)
    assert code == 1 and expect in line, line


def test_evaluate_checks_before_work(tmp_path, capsys):
    code, line = fails(V.main, ["--model", "no-such-model-anywhere", "--data", str(tmp_path),
                                "--json", str(tmp_path / "missing" / "r.json")], capsys)
    assert code == 1 and "--json" in line and "no folder" in line
    code, line = fails(V.main, ["--model", "m", "--tasks", "STS17"], capsys)
    assert code == 2 and "--tasks STS17: not a task" in line
    code, line = fails(V.main, ["--model", "m", "--split", "train"], capsys)
    assert code == 2 and "invalid choice: 'train'" in line


# --- model.py and sampler.py --------------------------------------------------------------------------------


def test_scratch_refuses_a_folder_that_holds_files(tmp_path, docs, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "notes.txt").write_text("mine")
    code, line = fails(M.main, ["scratch", "--corpus", str(docs), "--out", str(tmp_path / "m")], capsys)
    assert code == 1 and "holds files already; pass --overwrite" in line
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["notes.txt"]


def test_every_machine_says_why_it_stops(monkeypatch, capsys):
    """Under torchrun every rank raises the same error: the first process of each machine prints it, so that every
    machine's log says what stopped it (SIGTERM's line too), and no other; a rank's own error, by that rank."""
    from support.cli import cli

    @cli
    def main(argv=None):
        raise UserError("the reason", alone=argv == ["alone"])

    for rank, local, argv, printed in (("0", "0", [], True), ("2", "0", [], True), ("3", "1", [], False),
                                       ("3", "1", ["alone"], True)):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local)
        with pytest.raises(SystemExit):
            main(argv)
        assert capsys.readouterr().err == ("error: the reason\n" if printed else ""), (rank, local)


def test_scratch_refuses_data_without_text_and_an_out_that_is_a_file(tmp_path, docs, capsys):
    """model.py scratch as train.py: a corpus with no document (one empty file) is one line, and nothing is written;
    an --out that is a file is one line, exit 2, the file as it was."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "only.txt").write_text("")
    code, line = fails(M.main, ["scratch", "--corpus", str(tmp_path / "empty"), "--out", str(tmp_path / "m")], capsys)
    assert (code, line) == (1, "error: no documents in the data: 1 files, 0 documents; skipped 1 empty, 0 binary, "
                               "0 malformed") and not (tmp_path / "m").exists()
    (tmp_path / "a-file").write_text("mine")
    for extra in ([], ["--overwrite"]):
        code, line = fails(M.main, ["scratch", "--corpus", str(docs), "--out", str(tmp_path / "a-file"), *extra],
                           capsys)
        assert (code, line) == (2, f"error: --out {tmp_path / 'a-file'}: is a file, not a folder")
    assert (tmp_path / "a-file").read_text() == "mine"


def test_sampler_flags(tmp_path, docs, capsys):
    import sampler as S

    for flags, expect in ((["--num-anchors", "0"], "--num-anchors 0: must be at least 1"),
                          (["--min-span", "9", "--max-span", "8"], "--min-span 9: must be at most --max-span 8"),
                          (["--mlm-probability", "2"], "--mlm-probability 2.0: must be between 0 and 1"),
                          (["--mlm-probability", "nan"], "--mlm-probability nan: must be between 0 and 1"),
                          (["--seed", "-1"], "--seed -1: must be between 0 and 4294967295")):
        code, line = fails(S.main, ["--model", "m", "--data", str(docs), "--cache-dir", str(tmp_path / "c"), *flags],
                           capsys)
        assert code == 2 and expect in line, line
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("flags, expect", [
    (["--keep-ckpts", "-1"], "--keep-ckpts -1: must be at least 1"),
    (["--lr", "nan"], "--lr nan: must be between 0 and 1, both excluded"),  # these three were tracebacks
    (["--warmup-frac", "nan"], "--warmup-frac nan: must be between 0 and 1"),
    (["--seed", "-1"], "--seed -1: must be between 0 and 4294967295")])
@pytest.mark.slow
def test_no_traceback_from_a_real_process(tmp_path, docs, flags, expect):
    """The same through the command line, as a user meets it: one line, exit 2, nothing else on stderr."""
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--data", str(docs), *flags],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert r.returncode == 2 and r.stderr == f"error: {expect}\n" and r.stdout == ""
    assert not (tmp_path / "cache").exists()  # refused before anything was read


# --- messages that name the real problem -----------------------------------------------------------------------


@pytest.mark.parametrize("output, fmt, expect, code", [
    ("x.npy", "jsonl", "--format jsonl: --output {out} says npy; name the file .jsonl or leave --format out", 2),
    ("x.jsonl", "npy", "--format npy: --output {out} says jsonl; name the file .npy or leave --format out", 2),
    ("folder", "", "--output {out}: is a folder; name the file to write", 1)])
def test_embed_output_and_format_that_disagree(tmp_path, tiny, capsys, output, fmt, expect, code):
    (tmp_path / "texts.txt").write_text("a cat\n")
    (tmp_path / "folder").mkdir()
    out = tmp_path / output
    code_, line = fails(E.main, ["--model", str(tiny), str(tmp_path / "texts.txt"), "--output", str(out),
                                 *(["--format", fmt] if fmt else [])], capsys)
    assert code_ == code and line == "error: " + expect.format(out=out), line
    assert not (tmp_path / "x.npy").exists() and not (tmp_path / "x.jsonl").exists()


def test_convert_names_a_missing_folder_and_a_damaged_file(tmp_path, capsys):
    code, line = fails(M.main, ["convert", str(tmp_path / "missing" / "path")], capsys)
    assert code == 1 and line == f"error: {tmp_path / 'missing' / 'path'}: no such folder"  # not "cannot reach the hub"
    d = tmp_path / "m"
    M.save_pretrained(*from_scratch("tiny", ["a cat sat on a mat"] * 30), d)
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    data = (d / "pytorch_model.bin").read_bytes()
    (d / "pytorch_model.bin").write_bytes(data[:len(data) // 2])  # a download cut short
    code, line = fails(M.main, ["convert", str(d)], capsys)
    assert code == 1 and "pytorch_model.bin: not a readable PyTorch file, cut short or damaged" in line
    assert "weights_only" not in line


def test_data_without_a_single_document_says_so(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "empty.txt").write_text("  \n")
    (tmp_path / "docs" / "binary.txt").write_bytes(b"\x7fELF\x00\x00" + bytes(range(256)))
    code, line = fails(T.main, ["--model", "scratch:tiny", "--data", str(tmp_path / "docs"), "--out",
                                str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")], capsys)
    assert code == 1 and "no documents in the data: 2 files, 0 documents" in line and "1 empty, 1 binary" in line
    assert "--max-span" not in line and "--scale-short-docs" not in line


def test_resume_takes_a_flag_given_with_the_runs_own_value(tmp_path, docs, capsys):
    args = ["--model", "scratch:tiny", "--data", str(docs), "--out", str(tmp_path / "r"), "--docs-per-step", "4",
            "--min-span", "8", "--max-span", "32", "--workers", "0", "--cache-dir", str(tmp_path / "cache")]
    T.main([*args, "--steps", "2", "--lr", "1e-3"])
    T.main(["--out", str(tmp_path / "r"), "--resume", "--steps", "3", "--lr", "1e-3", "--seed", "0"])  # as it was
    assert "resuming at step 2" in capsys.readouterr().out
    code, line = fails(T.main, ["--out", str(tmp_path / "r"), "--resume", "--steps", "4", "--lr", "2e-3"], capsys)
    assert code == 2 and "--lr cannot change when resuming" in line and "(lr = 0.001)" in line


def test_a_run_that_failed_before_its_first_checkpoint_can_start_again(tmp_path, docs, capsys, monkeypatch):
    """Its --out holds only the log of the failed step: no --overwrite needed to try again. An --out with a
    checkpoint or a model still needs it."""
    args = ["--model", "scratch:tiny", "--data", str(docs), "--out", str(tmp_path / "r"), "--docs-per-step", "4",
            "--min-span", "8", "--max-span", "32", "--workers", "0", "--cache-dir", str(tmp_path / "cache"),
            "--steps", "2"]
    real = T.train_step
    monkeypatch.setattr(T, "train_step", lambda *a, **k: {**real(*a, **k), "mlm": float("nan")})
    code, line = fails(T.main, args, capsys)
    assert code == 1 and "loss is nan at step 1" in line
    assert {p.name for p in (tmp_path / "r").iterdir()} <= {"metrics.jsonl", runs.LOCK}  # the lock, given up
    monkeypatch.undo()
    T.main(args)  # no --overwrite
    assert (tmp_path / "r" / "model" / "model.safetensors").exists()
    code, line = fails(T.main, args, capsys)  # now it holds a run
    assert code == 1 and "holds an earlier run; pass --resume to continue it or --overwrite" in line


# --- what were tracebacks ------------------------------------------------------------------------------------------


def test_a_device_this_torch_has_not_is_one_line(tmp_path, tiny, capsys, monkeypatch):
    (tmp_path / "t.txt").write_text("a cat\n")
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text("g\tf\t2012\t0\t1.0\ta cat\ta dog\n")
    code, line = fails(E.main, ["--model", str(tiny), str(tmp_path / "t.txt"), "--device", "tpu"], capsys)
    assert code == 2 and line == "error: --device tpu: not a device this project runs on (auto, cpu, cuda, cuda:N)"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a CPU-only build of torch
    code, line = fails(V.main, ["--model", str(tiny), "--data", str(tmp_path / "sts"), "--split", "dev",
                                "--device", "cuda:1"], capsys)
    assert code == 2 and line == ("error: --device cuda:1: this torch sees no GPU (torch.cuda.is_available() is "
                                  "False)")


def test_a_clean_up_that_fails_does_not_hide_the_error_it_cleans_up_after(tmp_path, monkeypatch):
    """A read-only filesystem: the write fails, and so does removing what it left; the first is the one said."""
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(UserError, match=r"scores\.json: cannot write \(Read-only file system\)$"):
        write_atomic(tmp_path / "scores.json", read_only)


def test_model_py_into_a_folder_that_cannot_be_made_is_one_line(tmp_path, tiny, capsys):
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the cat sat on the mat. " * 200)
    import torch
    from safetensors.torch import load_file

    (tmp_path / "bin").mkdir()
    for f in ("config.json", "tokenizer.json"):
        (tmp_path / "bin" / f).write_bytes((tiny / f).read_bytes())
    torch.save(load_file(str(tiny / "model.safetensors")), tmp_path / "bin" / "pytorch_model.bin")
    for argv in (["scratch", "--corpus", str(tmp_path / "docs"), "--out", str(tmp_path / "a-file" / "m")],
                 ["convert", str(tmp_path / "bin"), "--out", str(tmp_path / "a-file" / "m")]):
        code, line = fails(M.main, argv, capsys)
        assert code == 1 and line.startswith(f"error: {tmp_path / 'a-file' / 'm'}: cannot write there"), line
    assert (tmp_path / "a-file").read_text() == "mine"


def test_convert_says_what_the_folder_already_holds(tmp_path, tiny, capsys):
    code, line = fails(M.main, ["convert", str(tiny), "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and line == (f"error: {tiny}: no pytorch_model.bin to convert (it holds model.safetensors "
                                  f"already, which loads as it is)")
    (tmp_path / "empty").mkdir()
    code, line = fails(M.main, ["convert", str(tmp_path / "empty")], capsys)
    assert code == 1 and line == f"error: {tmp_path / 'empty'}: no pytorch_model.bin to convert (it holds none)"


def test_embed_with_standard_input_closed_is_one_line(tmp_path, tiny):
    r = subprocess.run([sys.executable, str(ROOT / "embed.py"), "--model", str(tiny), "-", "--output",
                        str(tmp_path / "e.npy")], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))  # as `<&-` does
    assert r.returncode == 1 and r.stderr == "error: -: standard input is closed; pipe the texts in, or name a file\n"
    assert not (tmp_path / "e.npy").exists()


def test_evaluate_names_the_task_that_is_missing(tmp_path, tiny, capsys, monkeypatch):
    """--tasks names a task the folder lacks: the line names it and the file it needs (and what the folder has);
    offline without --data, the STS Benchmark's line asks for the split's own file only."""
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text("g\tf\t2012\t1\t4.0\tA cat.\tA cat sits.\n")
    code, line = fails(V.main, ["--model", str(tiny), "--data", str(tmp_path / "sts"), "--split", "dev", "--tasks",
                                "SICKR"], capsys)
    assert (code, line) == (1, f"error: {tmp_path / 'sts'}: no dev files of SICKR (SICK_trial.txt or SICK.txt); "
                               f"it has STSB")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for split in ("dev", "test"):
        code, line = fails(V.main, ["--model", str(tiny), "--split", split], capsys)
        assert code == 1 and line.endswith(f"pass --data with a folder holding sts-{split}.csv"), line


@pytest.mark.parametrize("content, expect", [
    ("", "sts-dev.csv: no sentence pairs with gold scores"),
    ("g\tf\t2012\t0\t7.5\ta cat\ta dog\n", "sts-dev.csv:1: gold score 7.5 is outside the task's scale of 0 to 5"),
    ("g\tf\t2012\t0\t-1\ta cat\ta dog\n", "sts-dev.csv:1: gold score -1 is outside the task's scale of 0 to 5")])
def test_evaluate_refuses_a_task_without_pairs_or_off_its_scale(tmp_path, tiny, capsys, content, expect):
    (tmp_path / "sts").mkdir()
    (tmp_path / "sts" / "sts-dev.csv").write_text(content)
    code, line = fails(V.main, ["--model", str(tiny), "--data", str(tmp_path / "sts"), "--split", "dev",
                                "--json", str(tmp_path / "r.json")], capsys)
    assert code == 1 and line.endswith(expect) and not (tmp_path / "r.json").exists(), line
