"""bench/_senteval.py, SentEval's way of scoring, against hand-worked cases, closed-form laws and scikit-learn; and
bench/_probing_tasks.py's tasks against what each task says it is."""
import collections
import math

import numpy as np
import pytest

from conftest import SHARED, bench_script, need, oracle

senteval = bench_script("_senteval")
tasks = bench_script("_probing_tasks")


def gaussians(n_per_class: int, means: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """n points of each class around its mean, unit variance in every direction, in random order."""
    X = np.concatenate([m + rng.standard_normal((n_per_class, len(m))) for m in means])
    y = np.repeat(np.arange(len(means)), n_per_class)
    order = rng.permutation(len(y))
    return X[order].astype(np.float32), y[order]


def test_the_probe_reaches_the_bayes_accuracy_of_two_gaussians():
    """Worked by hand: two classes on a line, N(-1, 1) and N(+1, 1), equal priors. The best any classifier can do is
    the threshold at 0, right with probability Phi(1) = 84.13%; a logistic regression finds it, so on 20,000 test
    points its accuracy is within sampling error (about 0.26 points) and the threshold's own error of 84.13."""
    rng = np.random.default_rng(0)
    means = np.array([[-1.0], [1.0]])
    train, dev, test = (gaussians(n, means, rng) for n in (2000, 500, 10000))
    bayes = 100 * 0.5 * (1 + math.erf(1 / math.sqrt(2)))
    assert abs(bayes - 84.13) < 0.01
    dev_accuracy, test_accuracy = senteval.probe(train, dev, test, classes=2)
    assert abs(test_accuracy - bayes) < 1.0, (test_accuracy, bayes)
    assert 80 < dev_accuracy < 89


@pytest.mark.slow
def test_the_probe_matches_scikit_learns_logistic_regression():
    """Six overlapping classes in 16 dimensions: SentEval's PyTorch probe and scikit-learn's LogisticRegression
    (its C chosen on the same validation split, over SentEval's own grid for it) within a point of each other."""
    oracle("sklearn")
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(1)
    means = rng.standard_normal((6, 16)) * 0.9
    train, dev, test = (gaussians(n, means, rng) for n in (400, 100, 400))
    ours = senteval.probe(train, dev, test, classes=6)[1]
    fits = [LogisticRegression(C=2.0 ** t, max_iter=2000).fit(*train) for t in range(-2, 4)]
    best = max(fits, key=lambda clf: clf.score(*dev))
    theirs = 100 * best.score(*test)
    assert 40 < theirs < 95 and abs(ours - theirs) < 1.0, (ours, theirs)
    # Trained for a fixed number of passes without early stopping (bench/probing.py's check of SentEval's budget), the
    # same probe also lands within a point of it
    longer = senteval.probe_without_stopping(train, dev, test, classes=6, passes=200)
    assert abs(longer - theirs) < 1.0, (longer, theirs)


@pytest.mark.slow
def test_cross_validation_folds_are_stratified_and_score_a_separable_task_almost_perfectly():
    y = np.array([0] * 30 + [1] * 20 + [2] * 10)
    folds = senteval.stratified_folds(y, 5, seed=0)
    assert sorted(np.concatenate(folds).tolist()) == list(range(60))  # every row in exactly one fold
    for fold in folds:
        assert collections.Counter(y[fold].tolist()) == {0: 6, 1: 4, 2: 2}  # each class in its share
    rng = np.random.default_rng(0)
    X, labels = gaussians(600, np.array([[-8.0, 0.0], [8.0, 0.0]]), rng)  # 16 standard deviations apart
    dev, test = senteval.cross_validated(X, labels, classes=2, k=3)
    # the last fits stop on 5% of their data, as soon as those are all right: a few points may still be wrong
    assert dev == 100.0 and test >= 99.0, (dev, test)


def senteval_encode_labels(labels, nclass=5):
    """SentEval's sick.py encode_labels, as it is written there: the reference for tai_targets."""
    Y = np.zeros((len(labels), nclass)).astype("float32")
    for j, y in enumerate(labels):
        for i in range(nclass):
            if i + 1 == np.floor(y) + 1:
                Y[j, i] = y - np.floor(y)
            if i + 1 == np.floor(y):
                Y[j, i] = np.floor(y) - y + 1
    return Y


def test_scores_become_distributions_as_tai_et_al_encode_them():
    scores = [0.0, 0.4, 1.0, 2.5, 3.6, 4.2, 5.0]
    got = senteval.tai_targets(scores)
    assert np.array_equal(got, senteval_encode_labels(scores))
    np.testing.assert_allclose(got[4], [0, 0, 0.4, 0.6, 0], atol=1e-6)  # by hand: 3.6 lies 0.6 of the way to 4
    # from 1 to 5 the expected score under the encoding is the score itself; below 1 SentEval's classes fall short
    np.testing.assert_allclose(got[2:] @ np.arange(1, 6), scores[2:], atol=1e-6)
    assert got[1].sum() == pytest.approx(0.4) and got[0].sum() == 0


@pytest.mark.slow
def test_relatedness_learns_a_score_the_pair_features_carry_and_none_that_they_do_not():
    """Pairs whose distance grows as their score falls: the regressor's expected score ranks them well; with the
    scores shuffled, it ranks nothing."""
    rng = np.random.default_rng(0)

    def pairs(n, shuffled=False):
        gold = rng.uniform(0, 5, n)
        u = rng.standard_normal((n, 8)).astype(np.float32)
        v = (u + (5.5 - gold)[:, None] / 3 * rng.standard_normal((n, 8))).astype(np.float32)
        return u, v, rng.permutation(gold) if shuffled else gold

    result = senteval.relatedness(pairs(1500), pairs(300), pairs(1000))
    assert result["spearman"] > 75 and result["dev_pearson"] > 70, result
    noise = senteval.relatedness(pairs(1500, True), pairs(300, True), pairs(1000, True))
    assert abs(noise["spearman"]) < 10, noise


def test_the_gradients_written_out_are_autograds():
    """bench/_senteval.py's Softmax trains without autograd: its gradients of both losses, against torch's own."""
    import torch

    torch.manual_seed(0)
    X = torch.randn(7, 5)
    for loss, target in [("cross_entropy", torch.nn.functional.one_hot(torch.randint(0, 4, (7,)), 4).float()),
                         ("squared", torch.softmax(torch.randn(7, 4), dim=1))]:
        model = senteval.Softmax(5, 4, seed=3, loss=loss)
        W, b = (p.clone().requires_grad_() for p in (model.W, model.b))
        p = torch.softmax(X @ W + b, dim=1)
        value = -(target * torch.log(p)).sum() if loss == "cross_entropy" else ((p - target) ** 2).sum()
        value.backward()
        for ours, theirs in zip(model.gradients(X, target), (W.grad, b.grad), strict=True):
            torch.testing.assert_close(ours, theirs)


def test_pair_features_are_the_absolute_difference_then_the_product():
    u, v = np.array([[1.0, -2.0]]), np.array([[3.0, 4.0]])
    assert senteval.pair_features(u, v).tolist() == [[2.0, 6.0, 3.0, -8.0]]


# --- the tasks ---------------------------------------------------------------------------------------------------


def test_sentences_are_cut_after_their_ends_not_after_titles():
    para = 'Mr. Brown came in. "Where is she?" he asked. It was late! Dr. Lee and St. John left at noon.'
    assert tasks.split_sentences(para) == ["Mr. Brown came in.", '"Where is she?" he asked.', "It was late!",
                                           "Dr. Lee and St. John left at noon."]
    assert tasks.TOKEN.findall("Don't go, Mr. Brown's dog!") == ["Don't", "go", ",", "Mr", ".", "Brown's", "dog", "!"]


def test_each_task_is_what_it_says_balanced_and_each_sentence_once():
    """From 20 of the shared books: SentLen's label is its token count's bin, WC's sentence holds its word once and no
    other target, BShift's inverted sentences are an original with two adjacent words swapped; every class the same
    size in each split; no sentence twice in a task."""
    books = sorted(need(SHARED / "data" / "corpus" / "gutenberg").glob("*.txt"))[::10]
    sents = tasks.sentences(books)
    originals = {" ".join(t) for t in sents}
    rng = np.random.default_rng(0)
    length = tasks.sentence_length(sents, rng, sizes=(100, 20, 20))
    wc, targets = tasks.word_content(sents, rng, words=200, sizes=(4, 1, 1), from_rank=500)
    shift = tasks.bigram_shift(sents, rng, sizes=(200, 50, 50))
    for task, classes in ((length, 6), (wc, 200), (shift, 2)):
        texts = [t for split in task.values() for t in split[0]]
        assert len(texts) == len(set(texts))
        for split, (_, labels) in task.items():
            counts = collections.Counter(labels)
            assert len(counts) == classes and len(set(counts.values())) == 1, (split, counts)
    for text, label in zip(*length["train"], strict=True):
        lo, hi = tasks.BINS[label]
        assert lo <= len(text.split()) <= hi and text in originals
    chosen = set(targets)
    for text, word in zip(*wc["train"], strict=True):
        assert [t for t in text.lower().split() if t in chosen] == [word]
    for text, label in zip(*shift["test"], strict=True):
        if label == "O":
            assert text in originals
            continue
        words = text.split()
        swaps = [j for j in range(1, len(words) - 1)
                 if " ".join(words[:j] + [words[j + 1], words[j]] + words[j + 2:]) in originals]
        assert swaps and all(words[j].isalnum() and words[j + 1].isalnum() for j in swaps), text
        assert not {'"', "“", "”"} & set(words)
