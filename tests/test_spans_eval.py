"""Held-out span retrieval (issue 70): support.retrieval.heldout_pair(s) draws pairs that never share text,
evaluate_sts.py ranks them as a naive loop does, TF-IDF and Wang & Isola's figures as worked by hand, a model that
cannot tell the spans apart scores chance, and train.py evaluates it on documents it never trains on, the same under
torchrun and on resume."""
import collections
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import evaluate_sts as E
import model as M
import sampler as S
import support.retrieval as R
import train as T
from conftest import WORDS, minilm, oracle, run_here
from embed import encode
from support.corpus import prepare_corpus
from test_train import free_port, reap, run_args, torchrun  # noqa: F401 (reap: a fixture)

ROOT = Path(__file__).resolve().parents[1]


# --- the pairs ----------------------------------------------------------------------------------------------

def test_a_pair_never_shares_text_and_its_lengths_are_the_paper_s():
    """Every pair: both spans inside the stretch, at least `gap` apart, lengths in [min, max]; the query's lengths
    skew long (Beta(4, 2): mean 2/3 of the way from min to max), the target's short (Beta(2, 4): 1/3); the target
    falls on both sides of the query; a stretch too short for a pair is refused."""
    rng, lo, hi, gap = np.random.default_rng(0), 16, 64, 8
    q_frac, t_frac, sides = [], [], collections.Counter()
    for n in [2 * 16 + 8, 50, 100, 136, 500] * 400:
        (q0, q1), (t0, t1) = R.heldout_pair(rng, n, lo, hi, gap)
        top = min(hi, (n - gap) // 2)
        assert 0 <= q0 < q1 <= n and 0 <= t0 < t1 <= n
        assert lo <= q1 - q0 <= top and lo <= t1 - t0 <= top
        assert t1 + gap <= q0 or q1 + gap <= t0, (n, q0, q1, t0, t1)
        sides[t0 > q0] += 1
        if n == 500:
            q_frac.append((q1 - q0 - lo) / (hi - lo))
            t_frac.append((t1 - t0 - lo) / (hi - lo))
    # floor() lowers each length by half a token on average: 1/96 of the range here; 400 draws, sd about 0.009
    assert abs(np.mean(q_frac) - (2 / 3 - 1 / 96)) < 0.04 and abs(np.mean(t_frac) - (1 / 3 - 1 / 96)) < 0.04
    assert min(sides.values()) > 600
    with pytest.raises(ValueError, match="need 40"):
        R.heldout_pair(rng, 39, lo, hi, gap)


def test_pairs_come_from_windows_that_share_no_text():
    """heldout_pairs: no token in two pairs; at most `count`; a document shorter than a window gives one pair if it
    holds one, none if not; the same pairs every time (a fixed seed)."""
    lengths = np.array([1000, 39, 40, 300, 10_000, 0])
    pairs = R.heldout_pairs(lengths, 10_000, 16, 64, 8)
    window = 2 * 64 + 8
    expected = [1000 // window, 0, 1, 300 // window, 10_000 // window, 0]
    assert np.bincount([p.doc for p in pairs], minlength=len(lengths)).tolist() == expected
    for d in range(len(lengths)):
        used = np.zeros(lengths[d], dtype=int)
        for _, (q0, q1), (t0, t1) in (p for p in pairs if p.doc == d):
            used[q0:q1] += 1
            used[t0:t1] += 1
        assert used.max(initial=0) <= 1
    few = R.heldout_pairs(lengths, 7, 16, 64, 8)
    assert len(few) == 7 and few == R.heldout_pairs(lengths, 7, 16, 64, 8)


def written_docs(folder: Path, n_docs: int = 6, n_words: int = 900, seed=0) -> list[str]:
    """Documents as a user writes them: capitals, accents, Chinese, punctuation, line breaks; their texts as the
    corpus cleans them (every run of whitespace one space), in the corpus's order (file names sorted)."""
    rng = np.random.default_rng(seed)
    vocab = ["Élodie", "naïve", "CAFÉ", "Zürich", "東京", "北京市", "don't", "O'Hara", "well,", "yes.", "—", "the",
             "River", "said", "¿qué?", "ﬁne", "Ω"]
    folder.mkdir()
    for i in range(n_docs):
        picks = rng.integers(0, len(vocab), n_words)
        text = " ".join(vocab[j] + ("\n\n" if rng.random() < 0.05 else "") for j in picks)
        (folder / f"{i}.txt").write_text(text, encoding="utf-8")
    return [" ".join((folder / f"{i}.txt").read_text(encoding="utf-8").split()) for i in range(n_docs)]


def test_span_texts_are_the_documents_own_text(tmp_path, tiny):
    """Each query and target is its document's own text between two token boundaries, not its tokens decoded: case,
    accents and spacing as written (all-MiniLM-L6-v2's tokenizer lowercases and strips accents; its decoded tokens
    did too), and whole characters where a byte-level BPE token splits one (decoded, such a span begins or ends with
    U+FFFD: shown on the same draw)."""
    texts = written_docs(tmp_path / "d")
    for name in (tiny, minilm()):
        _, tok = M.load_config_and_tokenizer(str(name))
        corpus = prepare_corpus([tmp_path / "d"], tok, str(tmp_path / "cache"))
        queries, targets = R.span_texts(corpus, np.arange(len(corpus)), tok, 300, (8, 40))
        assert len(queries) == len(targets) > 100
        for span in queries + targets:
            assert "\ufffd" not in span and any(span in text for text in texts), span
        assert any(c.isupper() for c in "".join(queries)) and "é" in "".join(queries + targets)
        pairs = R.heldout_pairs(corpus.lengths, 300, 8, 40, R.SPAN_GAP)
        start = corpus.offsets[[p.doc for p in pairs]]
        decoded = tok.decode_batch([corpus.tokens[s + p.query.start:s + p.query.end].tolist()
                                    for s, p in zip(start, pairs, strict=True)])
        if name == tiny:  # the old way, on the same draw: broken characters
            assert sum("\ufffd" in d for d in decoded) > 10
        else:  # lowercased, accents gone
            assert not any(c.isupper() for c in "".join(decoded)) and "é" not in "".join(decoded)


def test_spans_are_no_longer_than_every_model_reads(tmp_path, tiny, capsys):
    """--docs with a model that reads 40 tokens (max_seq_length 40, as sentence-transformers' config says): every span
    at most 38 tokens in the first model's, in either order; a second model with another tokenizer is told how many
    spans it reads only the start of, and the JSON says so."""
    short = tmp_path / "short-model"
    shutil.copytree(tiny, short)
    (short / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    written_docs(tmp_path / "d")
    for models in ([tiny, short], [short, tiny]):
        E.main([*sum((["--model", str(m)] for m in models), []), "--docs", str(tmp_path / "d"), "--span-pairs", "60",
                "--cache-dir", str(tmp_path / "cache")])
        err = capsys.readouterr().err
        assert "up to 38 (what every --model reads whole)" in err and "queries 8-38 tokens" not in err
        lengths = [int(x) for x in re.search(r"queries (\d+)-(\d+) tokens", err).groups()]
        assert 8 <= lengths[0] <= lengths[1] <= 38, err
    real = minilm()
    E.main(["--model", str(real), "--model", str(short), "--docs", str(tmp_path / "d"), "--span-pairs", "60",
            "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "o.json")])
    out, got = capsys.readouterr().out, json.loads((tmp_path / "o.json").read_text())
    cut = got[str(short)]["SPANS"]["cut"]
    assert got[str(real)]["SPANS"]["cut"] == 0 and cut > 0
    assert f"{short} read only the start of {cut:,} of the spans" in out
    assert "the bar to beat is" in out and "BM25 (words)" in out.splitlines()[0]


def test_the_pairs_lengths_are_the_samplers_draw():
    """support/retrieval.py writes sampler.span_length's draw again (support/ imports no method file): from the
    same generator state the two give the same lengths, for anchors' Beta(4, 2) and positives' Beta(2, 4)."""
    for alpha, beta in ((4, 2), (2, 4)):
        ours, theirs = np.random.default_rng(7), np.random.default_rng(7)
        drawn = [(R.span_length(ours, alpha, beta, 32, 254), S.span_length(theirs, alpha, beta, 32, 254))
                 for _ in range(500)]
        assert all(a == b for a, b in drawn) and len({a for a, _ in drawn}) > 50


def test_a_document_changed_since_it_was_tokenised_is_one_line(tmp_path, tiny, monkeypatch):
    """The spans' text is read again from the files: where it no longer gives the corpus's tokens, one line."""
    written_docs(tmp_path / "d")
    _, tok = M.load_config_and_tokenizer(str(tiny))
    corpus = prepare_corpus([tmp_path / "d"], tok, str(tmp_path / "cache"))
    real = R.texts_of

    def edited(*args, **kwargs):  # a word changed in every document
        return {d: t.replace("River", "Lake") for d, t in real(*args, **kwargs).items()}

    monkeypatch.setattr(R, "texts_of", edited)
    with pytest.raises(R.UserError, match="is not the text it was tokenised from"):
        R.span_texts(corpus, np.arange(len(corpus)), tok, 50, (8, 40))


# --- the figures --------------------------------------------------------------------------------------------

def naive_ranks(sims):
    """A loop: each query's target's place when every target is sorted by similarity, ties placed before it."""
    ranks = []
    for i, row in enumerate(sims):
        ranks.append(1 + sum(1 for j, s in enumerate(row) if j != i and s >= row[i]))
    return np.array(ranks)


def test_ranks_recall_and_mrr_equal_a_naive_loop():
    rng = np.random.default_rng(1)
    q, t = rng.normal(size=(300, 16)), rng.normal(size=(300, 16))
    t[:100] = q[:100] + 0.5 * rng.normal(size=(100, 16))  # a third of the pairs findable
    q, t = q / np.linalg.norm(q, axis=1, keepdims=True), t / np.linalg.norm(t, axis=1, keepdims=True)
    sims = q @ t.T
    sims[5, 9] = sims[5, 5]  # a tie counts against
    ranks = R.target_ranks(sims[i:i + 64] for i in range(0, 300, 64))
    assert np.array_equal(ranks, naive_ranks(sims))
    got = R.retrieval(ranks)
    naive = naive_ranks(sims)
    assert got["recall_at_1"] == pytest.approx(100 * np.mean(naive == 1))
    assert got["recall_at_10"] == pytest.approx(100 * np.mean(naive <= 10))
    assert got["mrr"] == pytest.approx(100 * np.mean([1 / r for r in naive]))
    assert 30 < got["recall_at_10"] and R.retrieval(np.full(5, 5))["mrr"] == pytest.approx(20)
    assert R.retrieval(R.target_ranks([np.ones((4, 4))]))["mrr"] == pytest.approx(25)  # all alike: every one last


def test_alignment_and_uniformity_as_worked_by_hand():
    """Two pairs on the unit circle: query (1, 0) with target (0, 1), query (0, 1) with target (0, 1). Alignment:
    squared distances 2 and 0, mean 1. Uniformity over the 6 pairs of the 4 rows: squared distances 2, 2, 0, 2, 2,
    0 (rows (1,0), (0,1), (0,1), (0,1)): 3 of 0 and 3 of 2, log((3 + 3e^-4) / 6)."""
    q, t = np.array([[1.0, 0], [0, 1]]), np.array([[0.0, 1], [0, 1]])
    got = R.alignment_uniformity(q, t, chunk=3)
    assert got["alignment"] == pytest.approx(1.0)
    assert got["uniformity"] == pytest.approx(math.log((3 + 3 * math.exp(-4)) / 6))


def naive_tfidf(texts):
    words = [R.WORD.findall(t.lower()) for t in texts]
    df = collections.Counter(w for ws in words for w in set(ws))
    rows = []
    for ws in words:
        v = {w: c * (math.log((1 + len(texts)) / (1 + df[w])) + 1) for w, c in collections.Counter(ws).items()}
        norm = math.sqrt(sum(x * x for x in v.values()))
        rows.append({w: x / norm for w, x in v.items()})
    return rows


def test_tfidf_equals_a_naive_dictionary_loop():
    texts = ["The cat sat on the mat.", "A dog; the DOG barked!", "cat and dog and cat", "moon", "", "the the the"]
    dense = R.tfidf_rows(texts).to_dense().numpy()
    naive = naive_tfidf(texts)
    for i in range(len(texts)):
        for j in range(len(texts)):
            expected = sum(x * naive[j].get(w, 0.0) for w, x in naive[i].items())
            assert (dense[i] @ dense[j]) == pytest.approx(expected)
    got = R.word_overlap(["the cat sat", "a dog barked", "moon rises"], ["cat sat down", "dog barked loud", "x"])
    for figures in (got["tfidf"], got["bm25"]):  # the third target shares no word: last
        assert (figures["recall_at_1"], figures["n"]) == (pytest.approx(200 / 3), 3)
    assert got["words"] == pytest.approx(15 / 6)


def test_bm25_equals_bm25s_on_the_same_words():
    """Okapi BM25 (k1 1.2, b 0.75, Lucene's idf) equals bm25s' "lucene" scores, computed independently, on random
    Zipf-distributed words: queries that repeat words, targets of every length (empty ones too), words in no target;
    bm25s in float32, so to 1e-5 of the largest score."""
    bm25s = oracle("bm25s")
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(80)]
    targets = [[vocab[j % 80] for j in rng.zipf(1.3, size=rng.integers(0, 40))] for _ in range(300)]
    queries = [[vocab[j % 80] for j in rng.zipf(1.3, size=rng.integers(1, 25))] + ["nowhere"] for _ in range(60)]
    index = bm25s.BM25(method="lucene", k1=1.2, b=0.75)
    index.index(targets, show_progress=False)
    expected = np.array([index.get_scores([w for w in q if w in index.vocab_dict]) for q in queries])
    got = R.bm25_scores(queries, targets)
    assert got.shape == (60, 300) and np.abs(got - expected).max() < 1e-5 * np.abs(expected).max()


def test_bm25_as_worked_by_hand():
    """Three targets, "a b" (2 words), "b c c" (3), "d" (1): mean length 2. Query "c b". idf of b (in 2 of 3):
    log(1 + 1.5 / 2.5) = log 1.6; of c (in 1): log(1 + 2.5 / 1.5) = log(8 / 3). Target "b c c": b once, c twice, its
    length term k1 (1 - b + b 3 / 2) = 1.2 x 1.375 = 1.65: log 1.6 x 1 / 2.65 + log(8/3) x 2 / 3.65. Target "a b":
    length term 1.2: log 1.6 x 1 / 2.2. Target "d": nothing shared, 0."""
    got = R.bm25_scores([["c", "b"]], [["a", "b"], ["b", "c", "c"], ["d"]])
    expected = [math.log(1.6) / 2.2, math.log(1.6) / 2.65 + math.log(8 / 3) * 2 / 3.65, 0.0]
    assert got[0] == pytest.approx(expected)


def test_words_cut_unspaced_scripts_into_pairs_and_say_when_a_span_is_one_word():
    """Chinese and Japanese runs as their overlapping character pairs (as Lucene's CJK analyzer); other words as
    runs of letters and digits, lowercased; text with no spaces that is not Chinese or Japanese (here DNA) is one
    word a span, and the word baselines say so; text of emoji alone is no word a span, said as that."""
    assert R.words("The CAT's 東京に行く 2020年, x") == ["the", "cat", "s", "東京", "京に", "に行", "行く", "2020",
                                                       "年", "x"]
    rng = np.random.default_rng(0)
    dna = ["".join(rng.choice(list("ACGT"), 200)) for _ in range(4)]
    got = R.word_overlap(dna[:2], dna[2:])
    assert got["words"] == pytest.approx(1.0) and "near chance" in R.few_words(got["words"])
    assert "text without spaces between its words" in R.few_words(got["words"])
    emoji = R.word_overlap(["🙂🎉🚀 ✨🔥", "🌧️ ☔"], ["🎈🎂", "⚽ 🏀🎾"])  # no letters at all: no words, not "no spaces"
    assert emoji["words"] == 0 and "hardly a letter or digit (symbols, emoji)" in R.few_words(emoji["words"])
    assert "without spaces" not in R.few_words(emoji["words"])
    assert R.few_words(R.word_overlap(["the cat sat"], ["on the mat"])["words"]) == ""
    chinese = R.word_overlap(["我们今天去公园散步"], ["他们明天去学校上课"])
    assert chinese["words"] == pytest.approx(8) and R.few_words(chinese["words"]) == ""


def random_word_docs(folder: Path, n_docs: int, n_words: int, topics: bool, seed=0):
    """Documents of random words: from the whole list (no span can tell where it came from), or each document from
    ten words of its own (a span tells which document it came from, not where in it)."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    vocab = [f"{w}{k}" for w in WORDS for k in range(20)]  # 300 words
    for i in range(n_docs):
        words = vocab[(10 * i) % 300:(10 * i) % 300 + 10] if topics else vocab
        (folder / f"{i}.txt").write_text(" ".join(words[j] for j in rng.integers(0, len(words), n_words)))
    return folder


def test_a_model_that_cannot_tell_spans_apart_scores_chance(tmp_path, tiny):
    """400 pairs from documents of random words: nothing in a span says which target lay near it, so a random-init
    encoder and TF-IDF find a target no better than chance (recall@1 1/400, MRR about 1.7%; the bounds are over ten
    standard deviations away); documents with words of their own show the measure can tell (about 13 targets in
    each document: MRR near 1/4)."""
    model, tok = M.load_pretrained(str(tiny), quiet=True)
    figures = {}
    for topics in (False, True):
        folder = random_word_docs(tmp_path / f"t{topics}", 30, 2000, topics)
        corpus = prepare_corpus([folder], tok, str(tmp_path / "cache"))
        spans = R.span_texts(corpus, np.arange(len(corpus)), tok, 400, (8, 32))
        assert len(spans[0]) == 400 and not set(spans[0]) & set(spans[1])
        words = R.word_overlap(*spans)
        figures[topics] = R.span_retrieval(encode, model, tok, *spans), words["tfidf"], words["bm25"]
    for found in figures[False]:
        assert found["recall_at_1"] < 3 and found["mrr"] < 5, found
    for found in figures[True]:
        assert found["mrr"] > 12, found


# --- evaluate_sts.py and train.py ------------------------------------------------------------------------------

def test_evaluate_sts_scores_spans_beside_tfidf(tmp_path, tiny, capsys):
    """--docs: a SPANS row (MRR, R@1, R@10) for each model side by side, and TF-IDF's column; the JSON holds every
    figure; no documents, or none long enough, is one line."""
    docs = random_word_docs(tmp_path / "d", 6, 4000, True)
    E.main(["--model", str(tiny), "--model", str(tiny), "--docs", str(docs), "--json", str(tmp_path / "o.json"),
            "--span-pairs", "50", "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert [line.split()[:2] for line in out.splitlines()[2:5]] == [["SPANS", "MRR"], ["SPANS", "R@1"],
                                                                   ["SPANS", "R@10"]]
    assert "TF-IDF (words)" in out.splitlines()[0] and "Spearman" not in out
    # 50 pairs, marked: the note under the table speaks of what the rows hold (it spoke of "a correlation")
    assert "* fewer than 100 pairs: over so few pairs one pair more or less moves an MRR or a recall by" in out
    assert "correlation" not in out
    got = json.loads((tmp_path / "o.json").read_text())
    assert got[str(tiny)]["SPANS"]["n"] == 50 and set(got["TF-IDF (words)"]["SPANS"]) >= {"mrr", "recall_at_1"}
    assert {"alignment", "uniformity"} <= set(got[str(tiny)]["SPANS"])
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("the cat sat on the mat")
    (tmp_path / "empty").mkdir()
    for bad, says in ((tmp_path / "short", f"--docs {tmp_path / 'short'}: none of its 1 documents holds two spans"),
                      (tmp_path / "none", f"{tmp_path / 'none'}: no such file or directory"),
                      (tmp_path / "empty", f"{tmp_path / 'empty'}")):
        r = run_here(E.main, "--model", tiny, "--docs", bad, "--cache-dir", tmp_path / "cache")  # in this process
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode != 0 and last.startswith("error: ") and says in last, r.stderr
        assert "Traceback" not in r.stderr


def span_run(docs, out, *extra):
    return run_args(docs, out, "--steps", "4", "--eval-every", "2", "--ckpt-every", "2", "--span-pairs", "40",
                    *extra)


def test_holdout_docs_are_never_trained_on_and_pick_best(tmp_path, docs, monkeypatch, capsys):
    """--holdout-docs: its documents are in no batch of any step; the start is scored beside TF-IDF; out/best is the
    best by span MRR (no --eval-data) and its card says so; a resume from the step-2 checkpoint evaluates the same
    pairs (step 4's figures as the run never stopped)."""
    T.main(span_run(docs, tmp_path / "a", "--holdout-docs", "0.25"))
    recs = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert {"spans_mrr", "tfidf_spans_mrr", "bm25_spans_mrr", "spans_uniformity"} <= set(recs[0])
    assert recs[0]["step"] == 0
    evaluated = {r["step"]: r["spans_mrr"] for r in recs if "spans_mrr" in r}
    assert sorted(evaluated) == [0, 2, 4]
    best = max((s for s in evaluated if s > 0), key=lambda s: (evaluated[s], -s))
    card = (tmp_path / "a" / "best" / "README.md").read_text()
    assert f"best model by held-out span retrieval's MRR ({evaluated[best]:.2f}), kept at step {best}" in card
    start = recs[0]
    assert f"word overlap, Okapi BM25 of the spans' words: {start['bm25_spans_mrr']:.2f}" in card
    assert f"word overlap, TF-IDF cosine of the spans' words: {start['tfidf_spans_mrr']:.2f}" in card
    bar = max(("bm25", "tfidf"), key=lambda w: start[f"{w}_spans_mrr"])
    assert start["spans_bar"] == bar and f"the bar to beat: {R.NAMES[bar]}" in card
    # no batch of the run's steps holds a held-out document
    from support.corpus import Corpus, held_out

    tok = M.load_pretrained(str(tmp_path / "a" / "model"), quiet=True)[1]
    corpus = prepare_corpus([docs], tok, str(tmp_path / "cache"))
    kept = held_out(Corpus(corpus.dir), 0.25)[0]
    cfg = T.TrainConfig(docs_per_step=4, min_span=8, max_span=32)
    batches = S.SpanBatches(corpus, tok, cfg, 512, held_out=kept)
    assert 1 <= len(kept) < 8 and not set(kept) & {int(d) for s in range(4) for d in batches[s]["anchor_doc"]}
    assert (f"{len(kept)} held out for evaluation (--holdout-docs 0.25: {len(kept)} of 8 documents, "
            f"{len(kept) / 8:.1%})") in capsys.readouterr().err
    # resumed from step 2: step 4 evaluates the same pairs
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000004")
    T.main(["--out", str(tmp_path / "b"), "--resume", "--workers", "0"])
    again = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    def spans_at_4(records):
        return [{k: v for k, v in r.items() if k.startswith("spans_")} for r in records if r["step"] == 4]

    assert spans_at_4(again) == spans_at_4(recs) and len(spans_at_4(recs)[0]) == 6


def test_eval_docs_that_are_training_documents_are_left_out(tmp_path, docs, capsys):
    """--eval-docs holding two of the training documents and six of its own: said, counted, left out."""
    ev = random_word_docs(tmp_path / "ev", 6, 600, False, seed=5)
    for name in ("0.txt", "1.txt"):
        shutil.copy(docs / name, ev / f"copy-{name}")
    T.main(span_run(docs, tmp_path / "a", "--eval-docs", str(ev)))
    assert "--eval-docs: 2 of its 8 documents are also training documents; left out of the evaluation" in \
        capsys.readouterr().err
    rec = json.loads((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()[0])
    # the paper's span lengths, whatever the run's (--max-span 32): each of the 6 documents left is shorter than a
    # window of 2 x 510 + 8 tokens and holds one pair
    assert rec["spans_n"] == 6 and rec["step"] == 0


def test_span_flags_that_cannot_work_are_one_line(tmp_path, docs, capsys):
    """Each a line that names the flag or the file, before any model loads where the flags alone tell."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("the cat sat on the mat")
    for extra, says in ((["--eval-docs", str(tmp_path / "empty")], f"{tmp_path / 'empty'}"),
                        (["--eval-docs", str(tmp_path / "short")],
                         f"--eval-docs {tmp_path / 'short'}: none of its 1 documents holds two spans of 32 tokens"),
                        (["--eval-docs", str(docs), "--holdout-docs", "0.1"], "from one or the other"),
                        (["--best-by", "stsb"], "--best-by stsb needs --eval-data"),
                        (["--best-by", "spans"], "--best-by spans needs --eval-docs or --holdout-docs"),
                        (["--eval-docs", str(tmp_path / "nowhere")], "nowhere"),
                        (["--eval-docs", str(docs)], f"--eval-docs {docs}: every one of its 8 documents is also a "
                                                      "training document (--data)")):
        with pytest.raises(SystemExit) as e:
            T.main(span_run(docs, tmp_path / "a", *extra))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code != 0 and says in err[-1] and err[-1].startswith("error: "), err
        # the flags alone: before any model or corpus; the documents: once tokenised
        assert len(err) == 1 or "short" in says or "every one" in says, err


@pytest.mark.slow
def test_two_ranks_share_the_spans_and_score_as_one_process(tmp_path, docs, reap):  # noqa: F811
    """torchrun, 2 ranks: each embeds half the spans; the start's figures (the same model, the same pairs) equal one
    plain process's."""
    T.main(span_run(docs, tmp_path / "one", "--holdout-docs", "0.25", "--steps", "2"))
    p = reap(torchrun("--nproc_per_node=2", "--master_port", str(free_port()), str(ROOT / "train.py"),
                      *span_run(docs, tmp_path / "two", "--holdout-docs", "0.25", "--steps", "2")),
             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = p.communicate(timeout=150)[0]
    assert p.returncode == 0, out[-3000:]
    one, two = (json.loads((tmp_path / d / "metrics.jsonl").read_text().splitlines()[0]) for d in ("one", "two"))
    # each held-out document, shorter than a window of the paper's spans (2 x 510 + 8), holds one pair
    from support.corpus import held_out

    tok = M.load_pretrained(str(tmp_path / "one" / "model"), quiet=True)[1]
    held = held_out(prepare_corpus([docs], tok, str(tmp_path / "cache")), 0.25)[0]
    assert one.keys() == two.keys() and one["spans_n"] == len(held)
    for k in one:
        assert two[k] == pytest.approx(one[k], abs=1e-5), k


def test_each_rank_embeds_its_share_and_gathers_the_whole(tiny, monkeypatch):
    """span_retrieval under torchrun, played in one process: each of 2 ranks embeds half the texts; with every rank's
    rows gathered, the figures are one process's."""
    model, tok = M.load_pretrained(str(tiny), quiet=True)
    rng = np.random.default_rng(3)
    queries = [" ".join(rng.choice(WORDS, 12)) for _ in range(30)]
    targets = [q.split()[0] + " " + " ".join(rng.choice(WORDS, 6)) for q in queries]
    whole = R.span_retrieval(encode, model, tok, queries, targets)
    seen, parts = [], {}

    def counted(texts, *a, **k):
        seen.append(len(texts))
        return encode(texts, *a, **k)

    def gather(rows, rank):
        parts[rank] = rows
        return np.concatenate([parts.get(0, rows), parts.get(1, rows)])  # rank 1 goes first: its figures are not used

    R.span_retrieval(counted, model, tok, queries, targets, share=(1, 2, lambda rows: gather(rows, 1)))
    shared = R.span_retrieval(counted, model, tok, queries, targets, share=(0, 2, lambda rows: gather(rows, 0)))
    assert seen == [30, 30]
    for k in whole:
        assert shared[k] == pytest.approx(whole[k], abs=1e-5), k


def test_held_out_documents_are_chosen_by_content_not_place(tmp_path, tiny):
    """--holdout-docs: the share asked, exactly (issue 81: 0.1 of 40 books held out 1, a threshold on a hash giving a
    binomial's count), chosen by a hash of each document's own tokens: round(share x n) of them, whatever their
    order or names. A run resumed after a file was added to --data (sorting first, shifting every place) or one
    taken away holds out what lies below its recorded point: no other document moves into or out of its set."""
    from support.corpus import held_out

    _, tok = M.load_config_and_tokenizer(str(tiny))
    rng = np.random.default_rng(0)
    texts = {f"{i:03d}.txt": " ".join(rng.choice(WORDS, 40)) for i in range(400)}

    def corpus_of(names, folder):
        folder.mkdir()
        for name in names:
            (folder / name).write_text(texts.get(name, "a file added first, whose words are its own"))
        return sorted(names), prepare_corpus([folder], tok, str(tmp_path / "cache"))

    names, corpus = corpus_of(list(texts), tmp_path / "a")
    docs, below = held_out(corpus, 0.25)
    before = {names[i] for i in docs}
    assert len(before) == 100 and 0 < below < 1
    for share, count in ((0.1, 40), (0.001, 1), (0.999, 400), (1.0, 400)):
        assert len(held_out(corpus, share)[0]) == count
    _, small = corpus_of(list(texts)[:40], tmp_path / "forty")
    assert len(held_out(small, 0.1)[0]) == 4
    # by content: the 40 documents' own points, ranked, are the ones held out of them
    from support.corpus import content_point

    points = [content_point(small, i) for i in range(40)]
    assert set(held_out(small, 0.1)[0]) == set(np.argsort(points)[:4])
    for changed, folder in ((["000-added.txt", *texts], "b"), ([n for n in texts if n != "200.txt"], "c")):
        names, corpus = corpus_of(changed, tmp_path / folder)
        resumed = {names[i] for i in held_out(corpus, 0.25, below=below)[0]}
        assert resumed - {"000-added.txt"} == before - {"200.txt"}


def test_a_file_whose_time_alone_changed_is_the_same_documents(tmp_path):
    """what_changed: a file touched (same bytes, a new time) is no change where the run recorded its digest (issue 81:
    `touch` alone refused a resume); the same size with other bytes is, as any other size; a record from before
    digests were kept still counts a new time as a change. The digest is hashlib's SHA-1 of the file."""
    import hashlib

    from support.corpus import describe_files, file_digest, what_changed

    data = tmp_path / "data"
    data.mkdir()
    for name in "abc":
        (data / f"{name}.txt").write_text(f"the text of {name} " * 50)
    assert file_digest(data / "a.txt") == hashlib.sha1((data / "a.txt").read_bytes()).hexdigest()

    class Cached:  # a corpus's meta as _tokenise writes it
        meta = {"sources": [str(data / f"{n}.txt") for n in "abc"],
                "digests": [file_digest(data / f"{n}.txt") for n in "abc"]}

    before, older = describe_files([data], Cached()), describe_files([data])
    assert [len(r) for r in before] == [4] * 3 and [r[:3] for r in before] == older
    for name in "ab":
        os.utime(data / f"{name}.txt", ns=(0, (data / f"{name}.txt").stat().st_mtime_ns + 10**9))
    assert what_changed(before, describe_files([data])) == ""
    assert what_changed(older, describe_files([data])) == "2 changed (a.txt, ...)"
    (data / "b.txt").write_text("the text of B " * 50)  # the same size, one letter other
    assert what_changed(before, describe_files([data])) == "1 changed (b.txt)"


@pytest.mark.slow
def test_resume_after_the_documents_changed_is_refused_or_said(tmp_path, docs, capsys):
    """A run's checkpoints record the files behind --data: a resume after one was added and one removed (still 8) is
    refused, naming both (not a third whose time alone changed), and nothing of the run changes; --changed-data goes
    on, saying what changed."""
    data = tmp_path / "data"
    shutil.copytree(docs, data)
    T.main(span_run(data, tmp_path / "r", "--holdout-docs", "0.25"))
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "step-00000004")
    os.utime(data / "1.txt", ns=(0, (data / "1.txt").stat().st_mtime_ns + 10**9))  # touch
    (data / "0.txt").unlink()
    (data / "new.txt").write_text((docs / "0.txt").read_text()[::-1])
    kept = (tmp_path / "r" / "metrics.jsonl").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        T.main(["--out", str(tmp_path / "r"), "--resume", "--steps", "6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "the files behind --data changed since the run's checkpoint " \
        "(1 added (new.txt); 1 removed (0.txt))" in err[0] and "--changed-data" in err[0], err
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == kept
    T.main(["--out", str(tmp_path / "r"), "--resume", "--steps", "6", "--changed-data"])
    assert "(1 added (new.txt); 1 removed (0.txt)); going on with them (--changed-data)" in capsys.readouterr().err
