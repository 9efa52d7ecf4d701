"""bench/ablation.py --pretrain-steps: how stage 2's books become documents, against the paragraphs written."""
import json
import types

import numpy as np

from conftest import bench_script


def test_stage1_is_scored_as_often_as_said_and_reported_over_windows_it_names(tmp_path):
    """Stage 1's STS-B dev at most 8 times (train.py scores every --eval-every steps, and at the end), 8 at 8,000
    steps; its loss windows say how many steps they cover; a failed run's reason is its error line."""
    ablation = bench_script("ablation")
    for steps in (1, 5, 9, 10, 17, 8000):
        every = ablation.stage1_eval_every(steps)
        scored = {s for s in range(1, steps + 1) if s % every == 0} | {steps}  # the steps train.py scores
        assert len(scored) <= 8 and (steps != 8000 or len(scored) == 8), (steps, every, len(scored))
    ten = [{"mlm": float(i)} for i in range(10)]
    assert ablation.stage1_summary(ten) == "MLM loss 4.50 over its first 10 steps, 4.50 over its last 10"
    many = [{"mlm": 1.0}] * 50 + [{"mlm": 3.0}] * 950
    assert ablation.stage1_summary(many) == "MLM loss 1.00 over its first 50 steps, 3.00 over its last 500"
    (tmp_path / "run.log").write_text("tokenizer: ...\nerror: no documents in the data: 2 files\n")
    assert ablation.failure(tmp_path / "run.log") == "no documents in the data: 2 files"


def test_stage2_documents_keep_every_paragraph_once(tmp_path):
    """Books written as CRLF paragraphs come back as documents of at least doc_chars characters, made of whole
    paragraphs in their order, none lost or repeated; each share's file is the first p% of the 100% one."""
    rng = np.random.default_rng(0)
    books, written = [], []
    for b in range(3):
        paragraphs = [f"book {b} paragraph {i}" + " word" * int(rng.integers(1, 60)) for i in range(80)]
        written.append(paragraphs)
        (tmp_path / f"book{b}.txt").write_bytes("\r\n\r\n".join(paragraphs).encode())
        books.append(tmp_path / f"book{b}.txt")
    a = types.SimpleNamespace(fractions=[25, 50, 100], doc_chars=500)
    files = bench_script("ablation").stage2_documents(a, tmp_path, books)
    shares = {p: [json.loads(line)["text"] for line in f.read_text().splitlines()] for p, f in files.items()}
    docs = shares[100]
    assert all(len(d) >= 500 for d in docs)
    got = [d.split("\n\n") for d in docs]
    for b, paragraphs in enumerate(written):
        # the book's documents, in the order of their first paragraph, laid end to end: the book itself
        mine = sorted((d for d in got if d[0].startswith(f"book {b} ")), key=lambda d: int(d[0].split()[3]))
        assert [p for d in mine for p in d] == paragraphs
    assert sum(map(len, got)) == sum(map(len, written))
    for p in (25, 50):
        assert shares[p] == docs[:round(len(docs) * p / 100)]
    assert [d.split()[1] for d in docs[:6]] != sorted(d.split()[1] for d in docs[:6])  # shuffled across books


def test_stage1_plot_fits_a_short_run():
    """The plot's running mean over 50 steps, or a quarter of a shorter run (--pretrain-steps 10 raised ValueError):
    each point the mean of the window that ends there, by a naive loop."""
    ablation = bench_script("ablation")
    for n in (1, 3, 10, 49, 50, 400):
        xs = np.random.default_rng(n).random(n)
        steps, means, window = ablation.running_mean(xs)
        assert window == min(50, max(1, n // 4)) and len(steps) == len(means) == n - window + 1
        np.testing.assert_allclose(means, [xs[s - window:s].mean() for s in steps])


def test_a_runs_steps_leave_out_the_starting_score_train_py_writes_first(tmp_path):
    """train.py --eval-data writes {"step": 0, "stsb_dev_spearman": ...} before step 1: the loss summaries and the
    curves read the steps only (the start's line has no loss; it once raised KeyError: 'mlm')."""
    ablation = bench_script("ablation")
    (tmp_path / "run").mkdir()
    lines = [{"step": 0, "stsb_dev_spearman": 55.0}] + [{"step": s, "contrastive": 1.0, "mlm": 2.0 + s} for s in
                                                        (1, 2, 3)]
    lines[-1]["stsb_dev_spearman"] = 57.5
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["step"] for r in ablation.metrics(tmp_path, "run")] == [1, 2, 3]
    assert ablation.curve(tmp_path, "run") == [(3, 57.5)]
    assert ablation.stage1_summary(ablation.metrics(tmp_path, "run")) == \
        "MLM loss 4.00 over its first 3 steps, 4.00 over its last 3"


def test_span_table_tracks_sts_b_as_a_naive_rank_correlation(tmp_path):
    """--holdout-docs: each run's Spearman of span MRR with STS-B dev over its evaluations (the start's included),
    against a hand-worked value: MRR rising with STS-B is 100, one swapped pair of 4 points is 80 (1 - 6·2/60)."""
    ablation = bench_script("ablation")
    start = {"step": 0, "stsb_dev_spearman": 50.0, "spans_mrr": 10.0, "spans_n": 40, "spans_recall_at_1": 5.0,
             "spans_recall_at_10": 20.0, "tfidf_spans_mrr": 12.0, "tfidf_spans_recall_at_1": 6.0,
             "tfidf_spans_recall_at_10": 22.0, "bm25_spans_mrr": 14.0, "bm25_spans_recall_at_1": 7.0,
             "bm25_spans_recall_at_10": 25.0, "spans_alignment": 1.0, "spans_uniformity": -2.0}
    mrrs = {0: [11, 12, 13], 1: [12, 11, 13]}  # seed 1 swaps the first two evaluations
    for seed, values in mrrs.items():
        (tmp_path / f"both-seed{seed}").mkdir()
        recs = [start] + [dict(start, step=s, stsb_dev_spearman=50.0 + s, spans_mrr=float(v), contrastive=1.0)
                          for s, v in zip((1, 2, 3), values, strict=True)]
        (tmp_path / f"both-seed{seed}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert ablation.tracking(ablation.metrics_with_start(tmp_path, "both-seed0")) == 100
    assert abs(ablation.tracking(ablation.metrics_with_start(tmp_path, "both-seed1")) - 80) < 1e-9
    a = types.SimpleNamespace(pretrain_steps=0, fractions=[100], arms=["both"], seeds=[0, 1], holdout_docs=0.05)
    table = ablation.span_tables(a, tmp_path)
    assert "| – | both (DeCLUTR: all views, A = P = 2) | 13.00 ± 0.00 | **+3.00 ± 0.00** | – | 13.00 / 13.00 |" in table
    assert "90.00 ± 14.14" in table and "word overlap (TF-IDF): MRR 12.00" in table
    assert "word overlap (BM25): MRR 14.00, R@1 7.00, R@10 25.00" in table
