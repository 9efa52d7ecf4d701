"""evaluate_sts.py: Spearman against hand-worked cases with ties, and the STS-B reader."""
import http.server
import io
import json
import math
import shutil
import tarfile
import threading

import numpy as np
import pytest

import evaluate_sts as E
import model as M
from conftest import SHARED, from_scratch, minilm, need, stsb_dev
from support.cli import UserError
from support.sts_files import download_stsb, find_tasks, load_stsb_dev


def test_rankdata_averages_ties():
    assert E.rankdata(np.array([10.0, 20.0, 20.0, 5.0])).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert E.rankdata(np.array([1.0, 1.0, 1.0])).tolist() == [2.0, 2.0, 2.0]


def test_spearman_hand_worked_with_ties():
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): covariance 4.5, variances 4.5 and 5
    # -> 4.5 / sqrt(22.5) = 3 / sqrt(10)
    assert abs(E.spearman([1, 2, 2, 3], [1, 2, 3, 4]) - 3 / math.sqrt(10)) < 1e-12
    assert E.spearman([1, 2, 3], [30, 20, 10]) == -1.0
    assert abs(E.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) - 0.8207826816681233) < 1e-12  # scipy.stats.spearmanr


def test_stsb_reader_keeps_quotes_and_ignores_extra_columns():
    a, b, gold = load_stsb_dev(stsb_dev().parent)
    assert len(a) == len(b) == len(gold) == 1500
    assert gold.min() == 0.0 and gold.max() == 5.0
    assert any('"' in s for s in a + b)


# --- layouts ------------------------------------------------------------------------------------------------

SAMPLES = SHARED / "data" / "sts" / "format-samples"


def test_each_semeval_layout_from_the_samples():
    tasks = find_tasks(need(SAMPLES), "test")
    assert sorted(tasks) == ["STS12", "STS13", "STS14", "STS15", "STS16"]
    for year, subset in [("STS12", "MSRvid"), ("STS13", "headlines"), ("STS14", "images"), ("STS15", "answers-forums"),
                         ("STS16", "plagiarism")]:
        assert list(tasks[year]) == [subset]
    golds = {y: [g for g in (SAMPLES / y).glob("*.gs.*")][0].read_text().splitlines() for y in tasks}
    for year, subsets in tasks.items():
        a, b, gold = next(iter(subsets.values()))
        assert len(a) == len(b) == len(gold) == sum(1 for g in golds[year] if g.strip())  # empty gold: left out
    a, b, gold = tasks["STS16"]["plagiarism"]
    assert gold.tolist() == [1.0] and not any("\t" in s or "Corpus of Plagiarised" in s for s in a + b)
    a, b, gold = tasks["STS15"]["answers-forums"]
    assert gold.tolist() == [3.0, 0.6, 1.0]


def test_traps_in_a_senteval_tree(tmp_path):
    root = tmp_path / "downstream" / "STS"
    for year in (12, 16):
        src = next(need(SAMPLES).glob(f"STS{year}"))
        dst = root / f"STS{year}-en-test"  # SentEval's folder names
        shutil.copytree(need(src), dst)
    d = root / "STS12-en-test"
    (d / "readme.txt").write_text("Read me.\n")
    (d / "STS.output.MSRvid.txt").write_text("1\n2\n3\n4\n5\n")  # a system's output, not gold
    (d / "STS.gs.OnWN.txt").write_text("1\n2\n")  # gold whose input is missing
    (d / "STS.input.SMTnews.txt").write_text("a\tb\n")  # input whose gold is missing
    tasks = find_tasks(tmp_path, "test")
    assert sorted(tasks) == ["STS12", "STS16"] and list(tasks["STS12"]) == ["MSRvid"]
    (d / "STS.gs.SMTnews.txt").write_text("1\n2\n")
    with pytest.raises(UserError, match="2 scores for the 1 pairs"):
        find_tasks(tmp_path, "test")


def test_sick_layouts(tmp_path):
    trial = need(SHARED / "data" / "sts" / "sick" / "SICK_trial.txt")
    a, b, gold = find_tasks(trial.parent, "dev")["SICKR"]["dev"]
    assert len(a) == 500 and 1 <= gold.min() and gold.max() <= 5
    head = "pair_ID\tsentence_A\tsentence_B\tentailment_label\trelatedness_score\tSemEval_set\n"
    (tmp_path / "SICK.txt").write_text(head + "1\tA x\tB x\tNEUTRAL\t3.5\tTRAIN\n2\tA y\tB y\tNEUTRAL\t4.5\tTEST\n"
                                       "3\tA z\tB z\tNEUTRAL\t1.5\tTRIAL\n4\tA w\tB w\tNEUTRAL\t2.0\tTEST\n")
    assert find_tasks(tmp_path, "test")["SICKR"]["test"][2].tolist() == [4.5, 2.0]
    assert find_tasks(tmp_path, "dev")["SICKR"]["dev"][0] == ["A z"]


@pytest.mark.slow
def test_minilm_on_stsb_dev(tmp_path, capsys):
    E.main(["--model", str(minilm()), "--data", str(stsb_dev().parent), "--split", "dev", "--dtype", "fp32",
            "--json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert abs(r["STSB"]["spearman"] - 86.72) <= 0.05 and r["STSB"]["n"] == 1500  # sentence-transformers' figure
    out = capsys.readouterr().out
    assert "STSB" in out and "86.72" in out


def test_minilm_on_sick_trial(tmp_path):
    trial = need(SHARED / "data" / "sts" / "sick" / "SICK_trial.txt")
    E.main(["--model", str(minilm()), "--data", str(trial.parent), "--split", "dev", "--dtype", "fp32",
            "--json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert abs(r["SICKR"]["spearman"] - 79.80) <= 0.05 and r["SICKR"]["n"] == 500  # sentence-transformers' figure


def test_two_models_side_by_side_and_aggregations(tmp_path, capsys):
    texts = ["a man is playing a guitar while a woman sings"] * 40
    for seed in (0, 1):
        M.save_pretrained(*from_scratch("tiny", texts, seed=seed), tmp_path / f"m{seed}")
    names = [str(tmp_path / "m0"), str(tmp_path / "m1")]
    E.main(["--model", names[0], "--model", names[1], "--data", str(need(SAMPLES)), "--json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert list(r) == names and r[names[0]] != r[names[1]]
    one = r[names[0]]
    s = one["STS15"]
    assert s["n"] == 3 and s["subsets"]["answers-forums"]["n"] == 3
    assert abs(s["mean"] - s["subsets"]["answers-forums"]["spearman"]) < 1e-9  # one subset: mean == that subset
    assert one["STS16"]["all"] is None or np.isnan(one["STS16"]["all"])  # one scored pair: no correlation
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-2:] == names
    assert any(line.startswith("STS12 all") for line in lines) and any(line.startswith("STS12 mean") for line in lines)


def test_nothing_recognisable_is_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("nothing here\n")
    with pytest.raises(SystemExit) as e:
        E.main(["--model", "whatever", "--data", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and "no test files" in err and "--split dev" in err


class Archive(http.server.BaseHTTPRequestHandler):
    body = b""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.body else 404)
        self.end_headers()
        self.wfile.write(self.body)


def test_download_from_a_local_server_then_offline(tmp_path, monkeypatch):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in [("stsbenchmark/sts-train.csv", "x"), ("stsbenchmark/sts-dev.csv", "x"),
                           ("stsbenchmark/sts-test.csv", "g\tf\t2012\t1\t4.0\tA cat.\tA cat sits.\n"),
                           ("../evil.csv", "escape")]:
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    Archive.body = buf.getvalue()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Archive)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("DECLUTR_STSB_URL", f"http://127.0.0.1:{srv.server_address[1]}/Stsbenchmark.tar.gz")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    d = download_stsb()
    assert sorted(p.name for p in d.iterdir()) == ["sts-dev.csv", "sts-test.csv", "sts-train.csv"]
    assert not (tmp_path / "evil.csv").exists() and not list(tmp_path.rglob("evil.csv"))
    assert find_tasks(d, "test")["STSB"]["test"][0] == ["A cat."]
    srv.shutdown()
    srv.server_close()  # the port refuses from now on
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert download_stsb() == d  # cached: no network needed
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="offline.*pass --data"):
        download_stsb()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(UserError, match="cannot download .*pass --data"):
        download_stsb()  # the server is gone
