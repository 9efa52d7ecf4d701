"""evaluate_sts.py: Spearman against hand-worked cases with ties, and the STS-B reader."""
import math

import numpy as np

import evaluate_sts as E
from conftest import STSB_DEV, need


def test_rankdata_averages_ties():
    assert E.rankdata(np.array([10.0, 20.0, 20.0, 5.0])).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert E.rankdata(np.array([1.0, 1.0, 1.0])).tolist() == [2.0, 2.0, 2.0]


def test_spearman_hand_worked_with_ties():
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4): covariance 4.5, variances 4.5 and 5 -> 4.5 / sqrt(22.5) = 3 / sqrt(10)
    assert abs(E.spearman([1, 2, 2, 3], [1, 2, 3, 4]) - 3 / math.sqrt(10)) < 1e-12
    assert E.spearman([1, 2, 3], [30, 20, 10]) == -1.0
    assert abs(E.spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) - 0.8207826816681233) < 1e-12  # scipy.stats.spearmanr


def test_stsb_reader_keeps_quotes_and_ignores_extra_columns():
    a, b, gold = E.load_stsb_dev(need(STSB_DEV).parent)
    assert len(a) == len(b) == len(gold) == 1500
    assert gold.min() == 0.0 and gold.max() == 5.0
    assert any('"' in s for s in a + b)
