"""sampler.py against the method's own laws (closed-form Beta CDFs), naive checks, and bad input."""
import collections
import gzip
import json

import numpy as np
import pytest
import torch

import sampler as S
from conftest import SHARED, WORDS, minilm, need, run_here
from support import hub as H
from support.cli import UserError
from support.corpus import prepare_corpus
from support.workers import prefetched_batches

GUTENBERG = SHARED / "data" / "corpus" / "gutenberg"


def beta42_cdf(x):  # Beta(4, 2): pdf 20 x^3 (1 - x), integrated by hand
    return 5 * x**4 - 4 * x**5


def beta24_cdf(x):  # Beta(2, 4) is Beta(4, 2) mirrored
    return 1 - beta42_cdf(1 - x)


def ks_discrete(lengths, cdf, lo=32, hi=512):
    """Kolmogorov-Smirnov distance between floor(p*(hi-lo)+lo) samples and their exact law."""
    ks = np.arange(lo, hi + 1)
    emp = np.searchsorted(np.sort(lengths), ks, side="right") / len(lengths)
    exact = cdf(np.clip((ks + 1 - lo) / (hi - lo), 0, 1))  # P(L <= k) = P(p < (k + 1 - lo) / (hi - lo))
    return np.abs(emp - exact).max()


def test_span_statistics_follow_the_paper():
    rng = np.random.default_rng(0)
    n, A, P, lo, hi = 4096, 2, 2, 32, 512
    a_len, p_len, views = [], [], set()
    for _ in range(10_000):
        spans = S.sample_spans(rng, n, A, P, lo, hi)
        assert len(spans) == A
        blocks = []
        for (a0, a1), pos in spans:
            assert 0 <= a0 < a1 <= n and a0 // hi == (a1 - 1) // hi  # the anchor stays inside one l_max block
            blocks.append(a0 // hi)
            a_len.append(a1 - a0)
            assert len(pos) == P
            for p0, p1 in pos:
                lp = p1 - p0
                p_len.append(lp)
                assert max(0, a0 - lp) <= p0 <= min(a1, n - lp) and p1 <= n  # the window of §3.2
                if p1 == a0 or p0 == a1:
                    views.add("adjacent")
                elif a0 <= p0 and p1 <= a1:
                    views.add("subsumed")
                else:
                    views.add("overlapping")
        assert abs(blocks[0] - blocks[1]) >= 2  # distinct and not neighbours
    a_len, p_len = np.array(a_len), np.array(p_len)
    assert abs(a_len.mean() / (32 + 480 * 4 / 6) - 1) < 0.01
    assert abs(p_len.mean() / (32 + 480 * 2 / 6) - 1) < 0.01
    # KS critical value at alpha = 0.001 is 1.95 / sqrt(n) (conservative for a discrete law)
    assert ks_discrete(a_len, beta42_cdf) < 1.95 / np.sqrt(len(a_len))
    assert ks_discrete(p_len, beta24_cdf) < 1.95 / np.sqrt(len(p_len))
    assert ks_discrete(p_len, beta42_cdf) > 0.3  # and the test can tell the two laws apart
    assert views == {"adjacent", "subsumed", "overlapping"}


def test_documents_shorter_than_2_a_lmax_are_refused():
    """The original's rule, n >= 2·A·l_max, in the public function as in the batches."""
    rng = np.random.default_rng(3)
    for A, lmax in ((1, 10), (2, 10), (2, 512), (3, 64)):
        assert len(S.sample_spans(rng, 2 * A * lmax, A, 2, 2, lmax)) == A
        with pytest.raises(ValueError, match=f"need at least {2 * A * lmax}"):
            S.sample_spans(rng, 2 * A * lmax - 1, A, 2, 2, lmax)
    with pytest.raises(ValueError, match="min_span 11 is over max_span 10"):  # not a document too short
        S.sample_spans(rng, 1000, 2, 2, 11, 10)


@pytest.mark.parametrize("view", ["adjacent", "subsumed", "overlap"])
def test_each_positive_view_keeps_its_geometry(view):
    """Fig. 2's views on 10,000 draws: every positive adjoins, lies inside, or overlaps without lying inside its
    anchor; each stays inside the document; and the view changes where positives land (not all the same place)."""
    rng = np.random.default_rng(4)
    n, lo, hi = 2048, 32, 512
    starts = set()
    for _ in range(10_000 // 2):
        for (a0, a1), pos in S.sample_spans(rng, n, 2, 1, lo, hi, view):
            (p0, p1), = pos
            assert 0 <= p0 < p1 <= n and lo <= p1 - p0 <= hi
            inside = a0 <= p0 and p1 <= a1
            shares = p0 < a1 and p1 > a0
            if view == "adjacent":
                assert p1 == a0 or p0 == a1
            elif view == "subsumed":
                assert inside
            else:
                assert shares and not inside
            starts.add(p0 - a0)
    assert len(starts) > 100


def test_anchor_blocks_are_uniform_over_valid_placements():
    """5 blocks, 2 anchors: exactly the 6 non-neighbouring pairs occur, each about 1/6 of the time."""
    rng = np.random.default_rng(1)
    counts = {}
    for _ in range(6000):
        b = tuple(sorted(a0 // 10 for (a0, _), _ in S.sample_spans(rng, 50, 2, 1, 2, 10)))
        counts[b] = counts.get(b, 0) + 1
    assert set(counts) == {(0, 2), (0, 3), (0, 4), (1, 3), (1, 4), (2, 4)}
    assert all(abs(c / 6000 - 1 / 6) < 0.02 for c in counts.values())


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square value a uniform law exceeds with probability 1e-4 (z: the normal's 1 - 1e-4 quantile),
    by Wilson and Hilferty's cube-root approximation (good to a few percent from df = 3)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def uniform_over_every_value(offsets: dict[int, list[int]], min_expected: int = 30):
    """offsets[W]: draws that should be uniform over 0..W-1. Every value, both ends included, occurs, and a
    chi-square test does not reject uniformity (alpha 1e-4), for each W drawn often enough to test."""
    tested = 0
    for width, values in sorted(offsets.items()):
        if width < 2 or len(values) < min_expected * width:
            continue
        counts = np.bincount(values, minlength=width)
        assert len(counts) == width and (counts > 0).all(), (width, counts)  # 0 and width - 1 included
        expected = len(values) / width
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < chi2_critical(width - 1), (width, chi2, counts)
        tested += 1
    return tested


def test_every_start_in_the_windows_occurs_uniformly():
    """§3.2's support, not only its moments: an anchor starts anywhere in its l_max block that leaves it room (its
    last possible start too: it may end exactly at the block's end), and a positive anywhere in
    [max(0, s_a - l_p), min(s_a + l_a, n - l_p)], both ends included (it may end where its anchor starts, or start
    where it ends), each uniformly."""
    rng = np.random.default_rng(20)
    n, A, lo, hi = 96, 2, 4, 12  # 8 blocks of 12 tokens; spans of 4-12
    anchor_offsets, positive_offsets = collections.defaultdict(list), collections.defaultdict(list)
    ends_at_block_end = after = before = total = 0
    for _ in range(20_000):
        for (a0, a1), pos in S.sample_spans(rng, n, A, 2, lo, hi):
            block_start = a0 // hi * hi
            anchor_offsets[hi - (a1 - a0) + 1].append(a0 - block_start)
            ends_at_block_end += a1 == block_start + hi
            for p0, p1 in pos:
                first, last = max(0, a0 - (p1 - p0)), min(a1, n - (p1 - p0))
                positive_offsets[last - first + 1].append(p0 - first)
                after += p0 == a1
                before += p1 == a0
                total += 1
    assert uniform_over_every_value(anchor_offsets) >= 5 and uniform_over_every_value(positive_offsets) >= 10
    # both directions of adjacency, each about 1/W of the positives (W ~ l_a + l_p + 1, here 9 to 25): > 2% each
    assert after / total > 0.02 and before / total > 0.02, (after, before, total)
    assert ends_at_block_end / 40_000 > 0.05  # about E[1 / (l_max - l_a + 1)] of the anchors


def test_mlm_masking_rates():
    rng = np.random.default_rng(2)
    ids = rng.integers(10, 1000, size=(400, 300))
    lengths = rng.integers(5, 301, size=400)
    pad = np.arange(300)[None] >= lengths[:, None]
    ids[pad] = 1
    ids[:, 0] = 0
    ids[np.arange(400), lengths - 1] = 2
    eligible = ~np.isin(ids, [0, 1, 2])
    random_ids = np.arange(5, 1000)
    inputs, labels = S.mask_tokens(ids, eligible, rng, 4, random_ids)
    chosen = labels != -100
    assert not chosen[~eligible].any()
    assert (labels[chosen] == ids[chosen]).all()
    assert abs(chosen.sum() / eligible.sum() - 0.15) < 0.01
    masked = (inputs == 4) & chosen
    kept = (inputs == ids) & chosen
    swapped = chosen & ~masked & ~kept
    for part, p in ((masked, 0.8), (swapped, 0.1), (kept, 0.1)):
        assert abs(part.sum() / chosen.sum() - p) < 0.02
    assert (inputs[~chosen] == ids[~chosen]).all()
    assert np.isin(inputs[swapped], random_ids).all()


# --- corpus ------------------------------------------------------------------------------------------------



def text(n_words, seed):
    r = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in r.integers(0, len(WORDS), n_words))


@pytest.fixture(scope="module")
def tok():
    return H.train_tokenizer([text(2000, s) for s in range(5)], 300)


def small_cfg(**kw):
    return S.SamplerConfig(**{**dict(min_span=4, max_span=32, docs_per_step=2), **kw})


def test_corpus_reads_every_layout_and_counts_the_bad(tmp_path, tok):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(text(300, 1))
    (d / "crlf.txt").write_bytes(text(300, 2).replace(" ", "\r\n", 50).encode())
    (d / "lf.txt").write_bytes(text(300, 2).replace(" ", "\n", 50).encode())
    (d / "empty.txt").write_text("  \n")
    (d / "bin.txt").write_bytes(b"\x7fELF\x00\x00\x01" + bytes(range(256)))
    (d / "bad-utf8.txt").write_bytes(b"caf\xe9 and \xff\xfe more " + text(100, 3).encode())
    lines = [json.dumps({"text": text(200, 4)}), "{not json", json.dumps({"x": 1}), json.dumps({"text": ""}), "",
             json.dumps({"text": text(200, 5)})]
    (d / "sub" / "docs.jsonl").write_text("\n".join(lines))
    with gzip.open(d / "sub" / "z.txt.gz", "wt") as f:
        f.write(text(300, 6))
    (d / "notes.md").write_text("not a corpus file")
    c = prepare_corpus([d], tok, str(tmp_path / "cache"), clean=False)  # the text as it is
    m = c.meta
    assert (m["files"], m["documents"], m["empty"], m["binary"], m["malformed"]) == (8, 7, 2, 1, 2)
    assert (m["files_repaired"], m["bytes_replaced"]) == (1, 3)
    by_text = [c.tokens[c.offsets[i]:c.offsets[i + 1]].tolist() for i in range(len(c))]
    assert tok.encode(text(300, 2).replace(" ", "\n", 50), add_special_tokens=False).ids in by_text  # CRLF == LF
    assert sum(len(x) for x in by_text) == m["tokens"] == len(c.tokens)
    assert by_text[0] == tok.encode(text(300, 1), add_special_tokens=False).ids  # files in sorted order


def test_whitespace_is_cleaned_as_the_original_does(tmp_path, tok):
    """Every run of spaces, tabs and newlines becomes one space (the original's sanitize), unless clean=False."""
    raw = "The  quick\tbrown \t fox\n\njumps   over\r\nthe lazy\u00a0 dog.  \n"
    (tmp_path / "a.txt").write_text(raw)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": raw}) + "\n")
    cleaned = prepare_corpus([tmp_path], tok, str(tmp_path / "c1"))
    want = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False).ids
    assert [cleaned.tokens[cleaned.offsets[i]:cleaned.offsets[i + 1]].tolist() for i in range(2)] == [want, want]
    kept = prepare_corpus([tmp_path], tok, str(tmp_path / "c1"), clean=False)
    assert kept.dir != cleaned.dir and len(kept.tokens) > len(cleaned.tokens)  # its own cache, more tokens
    assert kept.tokens[:kept.offsets[1]].tolist() == tok.encode(raw.replace("\r\n", "\n"),
                                                                add_special_tokens=False).ids


def test_corpus_cache_reused_and_rebuilt(tmp_path, tok, capsys):
    (tmp_path / "a.txt").write_text(text(300, 1))
    c1 = prepare_corpus([tmp_path / "a.txt"], tok, str(tmp_path / "cache"))
    c2 = prepare_corpus([tmp_path / "a.txt"], tok, str(tmp_path / "cache"))
    assert c1.dir == c2.dir and "reusing" in capsys.readouterr().err
    (tmp_path / "a.txt").write_text(text(301, 1))
    c3 = prepare_corpus([tmp_path / "a.txt"], tok, str(tmp_path / "cache"))
    assert c3.dir != c1.dir and len(c3.tokens) > len(c1.tokens)
    other = H.train_tokenizer([text(2000, 9)], 280)
    assert prepare_corpus([tmp_path / "a.txt"], other, str(tmp_path / "cache")).dir != c3.dir
    assert not list((tmp_path / "cache").glob("*.tmp*"))


def make_batches(tmp_path, tok, n_docs=10, words=200, world=1, rank=0, **kw):
    d = tmp_path / "docs"
    d.mkdir(exist_ok=True)
    for i in range(n_docs):
        (d / f"{i:03d}.txt").write_text(text(words + 13 * i, i))
    c = prepare_corpus([d], tok, str(tmp_path / "cache"))
    return c, S.SpanBatches(c, tok, small_cfg(**kw), max_tokens=512, rank=rank, world_size=world)


def test_batches_hold_the_documents_spans(tmp_path, tok):
    c, sb = make_batches(tmp_path, tok)
    b = sb[3]
    A, P = 2, 2
    assert b["anchors"].shape[0] == 2 * A and b["positives"].shape[0] == 2 * A * P
    sp = H.special_ids(tok)
    for k in range(len(b["anchors"])):
        n = int(b["anchor_lengths"][k])
        row = b["anchors"][k].tolist()
        assert row[0] == sp["cls"] and row[n - 1] == sp["sep"] and set(row[n:]) <= {sp["pad"]}
        assert 4 + 2 <= n <= 32 + 2
        doc = c.tokens[c.offsets[b["anchor_doc"][k]]:c.offsets[b["anchor_doc"][k] + 1]].tolist()
        inner = row[1:n - 1]
        assert any(doc[s:s + len(inner)] == inner for s in range(len(doc)))  # a contiguous piece of its document
        for j in range(k * P, (k + 1) * P):  # its positives are pieces of the same document
            piece = b["positives"][j][1:int(b["positive_lengths"][j]) - 1].tolist()
            assert any(doc[s:s + len(piece)] == piece for s in range(len(doc)))
        chosen = b["mlm_labels"][k] != -100
        assert not chosen[[0, n - 1]].any() and not chosen[n:].any()
        assert (b["mlm_labels"][k][chosen] == b["anchors"][k][chosen]).all()


def test_no_special_token_is_ever_an_mlm_target_and_the_rates_hold_through_batches(tmp_path, tok):
    """Every step of ten epochs through SpanBatches, as training sees them: no <s>, </s> or padding position
    carries an MLM label; of the anchors' own tokens 15% are targets, of those 80% <mask>, 10% random, 10% kept
    (binomial bounds, 5 standard deviations)."""
    _, sb = make_batches(tmp_path, tok, n_docs=24, words=600, docs_per_step=4, min_span=16, max_span=64)
    special = H.special_ids(tok)
    chosen = eligible = masked = kept = 0
    for step in range(10 * sb.steps_per_epoch):
        b = sb[step]
        ids, labels, inputs = b["anchors"].numpy(), b["mlm_labels"].numpy(), b["mlm_inputs"].numpy()
        is_special = np.isin(ids, [special["cls"], special["sep"], special["pad"]])
        assert is_special.sum() >= 2 * len(ids) and (labels[is_special] == -100).all(), step
        assert (inputs[is_special] == ids[is_special]).all()  # and no special position is corrupted either
        picked = labels != -100
        chosen, eligible = chosen + picked.sum(), eligible + (~is_special).sum()
        masked += (picked & (inputs == special["mask"])).sum()
        kept += (picked & (inputs == ids)).sum()
    for got, n, p in ((chosen, eligible, 0.15), (masked, chosen, 0.8), (kept, chosen, 0.1)):
        assert abs(got / n - p) < 5 * np.sqrt(p * (1 - p) / n), (got, n, p)
    assert eligible > 20_000


def test_spans_fit_the_models_positions(tmp_path, tok, capsys):
    c, _ = make_batches(tmp_path, tok, n_docs=4, words=800)
    sb = S.SpanBatches(c, tok, small_cfg(max_span=100, min_span=8), max_tokens=66)
    assert "max_span 100 + 2 special tokens exceeds the model's 66 positions; using 64" in capsys.readouterr().err
    assert max(int(sb[s]["anchor_lengths"].max()) for s in range(sb.steps_per_epoch)) <= 66
    sb = S.SpanBatches(c, tok, small_cfg(max_span=512, min_span=8), max_tokens=66)  # the default: lowered quietly
    assert "using" not in capsys.readouterr().err and sb.max_span == 64
    # l_min above the lowered l_max would make every span l_max long: refused, not clamped without a word
    with pytest.raises(UserError, match="--min-span 65: the model's 66 positions hold spans of at most 64 tokens"):
        S.SpanBatches(c, tok, small_cfg(max_span=100, min_span=65), max_tokens=66)
    assert S.SpanBatches(c, tok, small_cfg(max_span=100, min_span=64), max_tokens=66).max_span == 64  # l_min = l_max


def test_shards_disjoint_covering_and_seeded(tmp_path, tok):
    ranks = [make_batches(tmp_path, tok, n_docs=11, world=3, rank=r, docs_per_step=6)[1] for r in range(3)]
    for epoch in (0, 1):
        shards = [set(r.shard(epoch).tolist()) for r in ranks]
        assert sum(map(len, shards)) == 11 and set().union(*shards) == set(range(11))
    assert ranks[0].shard(0).tolist() != ranks[0].shard(1).tolist()  # reshuffled each epoch
    seen = [set(ranks[r][s]["anchor_doc"].tolist()) for r in range(3) for s in range(ranks[r].steps_per_epoch)]
    assert all(a.isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1:])  # no document twice in an epoch
    _, again = make_batches(tmp_path, tok, n_docs=11, world=3, rank=1, docs_per_step=6)
    _, other_seed = make_batches(tmp_path, tok, n_docs=11, world=3, rank=1, docs_per_step=6, seed=1)
    for step in range(4):
        assert all(np.array_equal(again[step][k], ranks[1][step][k]) for k in ("anchors", "positives", "mlm_inputs"))
    assert not np.array_equal(other_seed[0]["anchors"], again[0]["anchors"])


def test_resuming_at_step_k_gives_the_uninterrupted_batches(tmp_path, tok):
    _, sb = make_batches(tmp_path, tok)
    full = list(prefetched_batches(sb, range(0, 12), 2))  # crosses two epoch boundaries (5 steps per epoch)
    resumed = list(prefetched_batches(sb, range(7, 12), 2))
    assert len(resumed) == 5 and not np.array_equal(resumed[0]["anchors"], full[6]["anchors"])  # steps 7 to 11
    for a, b in zip(full[7:], resumed, strict=True):
        for k in a:
            assert np.array_equal(a[k], b[k]), k


def test_workers_hand_batches_over_without_file_descriptors(tmp_path, tok):
    """A tensor from a DataLoader worker arrives in shared memory through a file descriptor that a thread of the
    worker serves; Ctrl-C to the training process alone, cut in the middle of that, made the worker print a
    traceback (about 1 run in 10 here). Batches come as copies: no tensor is shared, and each equals the
    dataset's own."""
    _, sb = make_batches(tmp_path, tok)
    batches = list(prefetched_batches(sb, range(0, 6), 2))
    assert all(isinstance(v, torch.Tensor) and not v.is_shared() for b in batches for v in b.values())
    for step, b in enumerate(batches):
        assert all(torch.equal(v, sb[step][k]) for k, v in b.items())


def test_short_documents_skipped_or_scaled(tmp_path, tok, capsys):
    for i in range(6):
        (tmp_path / f"{i}.txt").write_text(text(20 + i, i))  # ~20-25 tokens: below 2*A*l_max = 128
    c = prepare_corpus([tmp_path], tok, str(tmp_path / "cache"))
    assert c.lengths.max() < 128
    cfg = small_cfg(docs_per_step=1)
    with pytest.raises(UserError, match=r"no document has the 128 tokens .* the longest has \d+"):
        S.SpanBatches(c, tok, cfg, 512)
    scaled = S.SpanBatches(c, tok, small_cfg(docs_per_step=1, scale_short_docs=True, min_span=2), 512)
    assert "qualify" in capsys.readouterr().err
    b = scaled[0]
    n = int(c.lengths[b["anchor_doc"][0]])
    assert b["anchor_lengths"].max() - 2 <= n // 4


def test_cli_bad_input_is_one_line(tmp_path):
    model = minilm()
    (tmp_path / "short.txt").write_text("too short to sample from")
    (tmp_path / "empty.txt").write_text("")

    def run(*a):  # sampler.py, in this process
        return run_here(S.main, "--model", model, "--cache-dir", tmp_path / "c", *a)

    r = run("--data", str(tmp_path))
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("error: no document has the 2,040 tokens")
    assert "1 empty" in r.stderr and "Traceback" not in r.stderr
    r = run("--data", str(tmp_path / "missing"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "missing: no such file" in r.stderr


def test_cli_on_gutenberg_books(tmp_path):
    books = sorted(need(GUTENBERG).glob("*.txt"))[:3]
    r = run_here(S.main, "--model", minilm(), "--cache-dir", tmp_path, "--docs-per-step", "3", "--data", *books)
    assert r.returncode == 0, r.stderr
    assert "3 files, 3 documents" in r.stderr and "6 anchors" in r.stdout and "12 positives" in r.stdout
