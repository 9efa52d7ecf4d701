"""bench/domain.py (issue 76): the books split as said, the table's figures against hand-worked values, the groups
of pairs the analysis reports on as worked by hand, and a whole small run of it, resumed where it stopped."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import WORDS, bench_script

ROOT = Path(__file__).resolve().parents[1]


def test_every_tenth_book_by_name_is_held_out():
    domain = bench_script("domain")
    books = [Path(f"book{i:03d}.txt") for i in range(200)]
    trained, held = domain.split_books(books, 10)
    assert held == books[5::10] and len(held) == 20 and len(trained) == 180
    assert sorted(trained + held) == books and not set(trained) & set(held)


def test_groups_of_pairs_as_worked_by_hand():
    """Pair 0 shares "zebra", in its own target alone (rare); pair 1 the name "Harriet" (capitalised, never lowercase,
    not after a full stop; in one target, so rare too); pair 2 only "the", in every target; pair 3 "The", which
    starts a sentence in its query, so no name, and is "the" of every target: neither. Queries of 10, 20, 30 and 40
    characters: the 1/3 and 2/3 quantiles are 20 and 30."""
    domain = bench_script("domain")
    queries = ["a zebra!!", "Harriet rode a mare", "the " + "x" * 26, "It was late. The " + "y" * 22]
    targets = ["the zebra ran", "the pony saw Harriet", "the sky was blue", "The sun set on the hill."]
    queries = [q.ljust(n) for q, n in zip(queries, (10, 20, 30, 40), strict=True)]
    got = domain.groups(queries, targets)
    assert got["shares a rare word"].tolist() == [True, True, False, False]
    assert got["shares a name"].tolist() == [False, True, False, False]
    assert got["shares neither"].tolist() == [False, False, True, True]
    assert got["query in the shortest third"].tolist() == [True, True, False, False]
    assert got["query in the longest third"].tolist() == [False, False, True, True]


def write_run(folder: Path, records: list[dict]):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "model").mkdir()


def test_the_table_against_hand_worked_figures(tmp_path):
    """Two arms, two seeds, evaluated at steps 0, 2 and 4. The start 10 (STS-B 80), BM25 12, TF-IDF 11. Arm "adjacent"
    ends at 15 and 17: mean 16 ± 1.41, +6 over the start (its spread 1.41: bold), +4 over BM25 (bold); its MRR along
    the evaluations (10, 12, 16); its STS-B 79 and 81, level with the start on average (+0.00 ± 1.41)."""
    domain = bench_script("domain")
    start = {"step": 0, "spans_mrr": 10.0, "spans_recall_at_1": 5.0, "spans_recall_at_10": 30.0, "spans_n": 2000,
             "stsb_dev_spearman": 80.0, "bm25_spans_mrr": 12.0, "bm25_spans_recall_at_1": 6.0,
             "bm25_spans_recall_at_10": 33.0, "tfidf_spans_mrr": 11.0, "tfidf_spans_recall_at_1": 5.5,
             "tfidf_spans_recall_at_10": 31.0}
    ends = {("contrastive", 0): 10.5, ("contrastive", 1): 9.5, ("adjacent", 0): 15.0, ("adjacent", 1): 17.0}
    for (arm, seed), end in ends.items():
        steps = [dict(start, step=2, spans_mrr=12.0), dict(start, step=4, spans_mrr=end,
                                                                stsb_dev_spearman=79.0 + 2 * seed)]
        write_run(tmp_path / f"{arm}-seed{seed}", [start, {"step": 1, "contrastive": 1.0}, *steps])
    (tmp_path / "seconds.json").write_text(json.dumps({f"{a}-seed{s}": 600 for a, s in ends}))
    for name, n in (("train", 3), ("held", 1)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"{i}.txt").write_text("a book")
    a = type("Args", (), dict(arms=["contrastive", "adjacent"], seeds=[0, 1], model="models/m",
                              data=[str(tmp_path / "train")], eval_docs=[str(tmp_path / "held")], steps=4,
                              docs_per_step=16, min_span=32, max_span=128, lr=5e-5, flags=[]))
    table = domain.report(a, tmp_path)
    assert table.startswith("m continued on 3 files, held-out span retrieval on 1 others (2,000 pairs")
    assert "| the start | 10.00 | – | – | – | 5.00 | 30.00 | 80.00 |" in table
    assert "| BM25 (words) | 12.00 | – | – | – | 6.00 | 33.00 | – |" in table
    row = next(line for line in table.splitlines() if line.startswith(f"| {domain.ARMS['adjacent'][1]} |"))
    assert row.split(" | ")[1:6] == ["16.00 ± 1.41", "**+6.00 ± 1.41**", "**+4.00 ± 1.41**", "15.00 / 17.00",
                                     "5.00 ± 0.00"]
    assert "| 80.00 ± 1.41 | +0.00 ± 1.41 | 10.00 → 12.00 → 16.00 | 10 |" in row
    contrastive = next(line for line in table.splitlines() if line.startswith(f"| {domain.ARMS['contrastive'][1]}"))
    assert "| 10.00 ± 0.71 | +0.00 ± 0.71 | **-2.00 ± 0.71** |" in contrastive  # -2 against a spread of 0.71


@pytest.mark.slow
def test_a_small_domain_run_reports_and_resumes(tmp_path, tiny):
    """One arm, one seed, 4 steps of a tiny model on documents of random words, held-out span retrieval on others,
    STS-B dev on a few made-up pairs: the table and the analysis are written; run again, nothing is trained again."""
    rng = np.random.default_rng(0)
    for name, n in (("train", 8), ("held", 4)):
        (tmp_path / name).mkdir()
        for i in range(n):
            (tmp_path / name / f"{i}.txt").write_text(" ".join(rng.choice(WORDS, 900)))
    (tmp_path / "sts-dev.csv").write_text("".join(f"g\tf\t2012\t{k}\t{k % 5}\t{' '.join(WORDS[k % 5:])}\t"
                                                  f"{' '.join(WORDS[:k % 7 + 2])}\n" for k in range(12)))
    cmd = [sys.executable, str(ROOT / "bench" / "domain.py"), "--model", str(tiny), "--data", str(tmp_path / "train"),
           "--eval-docs", str(tmp_path / "held"), "--stsb", str(tmp_path / "sts-dev.csv"), "--out", str(tmp_path / "o"),
           "--arms", "contrastive", "--seeds", "0", "--steps", "4", "--eval-every", "2", "--docs-per-step", "4",
           "--min-span", "8", "--max-span", "32", "--span-pairs", "40", "--jobs", "1", "--analyse",
           "--flags", "--workers", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    table = (tmp_path / "o" / "domain.md").read_text()
    assert "| BM25 (words) |" in table and "| contrastive only (--no-mlm) |" in table
    # one seed measures no spread: said, never "± 0.00", no difference in bold
    assert "one seed here: no spread is measured" in table and "(1 seed: no spread)" in table
    rows = [line for line in table.split("**Where each finds")[0].splitlines() if line.startswith("|")]
    assert "± 0.00" not in table and rows and not any("**" in row for row in rows)
    assert "**Where each finds the target**" in table and "| shares a name |" in table
    n = json.loads((tmp_path / "o" / "contrastive-seed0" / "metrics.jsonl").read_text().splitlines()[0])["spans_n"]
    assert f"({n:,} pairs; the arms' seed 0)" in table  # the pairs the runs scored
    first = (tmp_path / "o" / "contrastive-seed0" / "metrics.jsonl").stat().st_mtime_ns
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "contrastive-seed0:" not in again.stdout  # nothing trained again
    assert (tmp_path / "o" / "contrastive-seed0" / "metrics.jsonl").stat().st_mtime_ns == first


def test_runs_go_at_most_jobs_at_a_time_and_a_failed_one_ends_with_its_last_line(tmp_path):
    """bench/_jobs.py, what domain.py and peers.py run their runs with: each run starts once, in order, never more
    than `jobs` at a time (each writes its start and end times: the overlaps counted by hand), each finished one
    reported once; a run that fails raises its log's last line."""
    sys.path.insert(0, str(ROOT / "bench"))
    import _jobs

    from support.cli import UserError

    def start(name, code=0):
        log = tmp_path / f"{name}.log"
        script = (f"import time; print(time.time(), flush=True); time.sleep(0.3); print(time.time()); "
                  f"print('the last line of {name}'); raise SystemExit({code})")
        return log, subprocess.Popen([sys.executable, "-c", script], stdout=open(log, "w"))

    done = []
    _jobs.run_all(["a", "b", "c", "d", "e"], start, lambda name, s: done.append((name, s)), jobs=2)
    assert sorted(n for n, _ in done) == ["a", "b", "c", "d", "e"] and all(s > 0.3 for _, s in done)
    spans = [tuple(map(float, (tmp_path / f"{n}.log").read_text().split()[:2])) for n in "abcde"]
    most = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
    assert most == 2, spans
    with pytest.raises(UserError, match=r"^b failed: the last line of b \(the whole log: .*b\.log\)$"):
        _jobs.run_all(["a", "b"], lambda n: start(n, code=int(n == "b")), lambda *_: None, jobs=1)


def test_every_arm_is_train_pys_flags_and_the_short_one_trains_on_the_same_documents():
    """Each arm's flags parse as train.py's; adjacent-short (issue 83: CT's and SimCSE's short texts and more
    negatives) halves the spans and doubles the anchors, so that a document qualifies exactly where it does for
    adjacent (2·A·max-span tokens: 2·2·128 = 2·4·64 = 512) and a step's embeddings double (2·A·N: 64 -> 128)."""
    import train

    domain = bench_script("domain")
    base = ["--max-span", "128"]  # bench/domain.py's own, before the arm's flags
    cfgs = {arm: train.parse_config(train.TrainConfig, base + flags) for arm, (flags, _) in domain.ARMS.items()}
    short, adjacent = cfgs["adjacent-short"], cfgs["adjacent"]
    assert (short.max_span, short.num_anchors, adjacent.max_span, adjacent.num_anchors) == (64, 4, 128, 2)
    assert 2 * short.num_anchors * short.max_span == 2 * adjacent.num_anchors * adjacent.max_span == 512
    assert short.positive_view == adjacent.positive_view == "adjacent" and not short.mlm
