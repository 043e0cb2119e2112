"""A chi-square goodness-of-fit check shared by the distribution tests."""
from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.stats import chisquare


def fit_pvalue(samples: list, expected_probs: dict) -> float:
    """p-value that samples were drawn from expected_probs.

    Rare outcomes (expected < 5) are pooled with the mass the table leaves unlisted; an outcome the
    table gives probability 0 is impossible, and seeing it fails outright.
    """
    n = len(samples)
    counts = Counter(samples)
    if any(counts[outcome] for outcome, prob in expected_probs.items() if prob == 0.0):
        return 0.0
    observed, expected = [], []
    pooled_obs, pooled_exp = 0, 0.0
    for outcome, prob in expected_probs.items():
        if prob * n >= 5:
            observed.append(counts.pop(outcome, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.pop(outcome, 0)
            pooled_exp += prob * n
    pooled_obs += sum(counts.values())  # outcomes the table does not list
    pooled_exp += max(0.0, 1.0 - sum(expected_probs.values())) * n  # and the mass it leaves to them
    if pooled_exp > 0 or pooled_obs > 0:
        observed.append(pooled_obs)
        expected.append(max(pooled_exp, 1e-9))
    expected = np.array(expected) * (n / sum(expected))  # renormalize rounding
    return float(chisquare(observed, expected).pvalue)
