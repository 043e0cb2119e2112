"""The rejection sampler: hand-written cases, and the emitted distribution against p (with a control that must fail)."""
from __future__ import annotations

import pytest
import torch

from draftwise.sampling import sample
from draftwise.types import Verdict
from draftwise.verify import verify_greedy, verify_rejection
from draftwise.verify.rejection import _residual
from stats_helpers import fit_pvalue

P = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.1, 0.1, 0.2, 0.2, 0.4]])  # [2, vocab 5]
Q = torch.tensor([[0.1, 0.2, 0.5, 0.1, 0.1]])  # [1, vocab 5]


def gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def onehot(token, vocab=5):
    row = torch.zeros(vocab)
    row[token] = 1.0
    return row


# --- hand-written tables -------------------------------------------------------------------

def test_greedy_keeps_the_matching_prefix_and_takes_the_targets_next_token():
    logits = torch.log(torch.stack([onehot(3), onehot(1), onehot(4), onehot(0)]) + 1e-3)  # argmax 3,1,4,0
    assert verify_greedy([3, 1, 4], logits) == Verdict(3, 0)  # all kept, bonus = argmax of the last row
    assert verify_greedy([3, 2, 4], logits) == Verdict(1, 1)  # rejected at 1: the target's own token there
    assert verify_greedy([0, 1, 4], logits) == Verdict(0, 3)
    assert verify_greedy([], logits[:1]) == Verdict(0, 3)  # no draft: plain greedy step


def test_certain_acceptance_when_p_covers_q():
    # p(x) >= q(x): accepted whatever the uniform draws; all kept, so the bonus comes from the last row.
    p = torch.stack([onehot(2), onehot(4)])
    q = torch.stack([onehot(2) * 0.5 + onehot(1) * 0.5])
    for seed in range(20):
        assert verify_rejection([2], q, p, gen(seed)) == Verdict(1, 4)


def test_certain_rejection_recovers_from_the_residual():
    # p(x) = 0: always rejected at position 0; residual norm(max(0, p - q)) is all on token 0.
    p = torch.stack([onehot(0) * 0.6 + onehot(1) * 0.4, onehot(3)])
    q = torch.stack([onehot(1) * 0.5 + onehot(2) * 0.5])
    for seed in range(20):
        assert verify_rejection([2], q, p, gen(seed)) == Verdict(0, 0)


def test_rejection_at_i_keeps_the_tokens_before_it():
    p = torch.stack([onehot(1), onehot(2), onehot(3), onehot(4)])
    q = torch.stack([onehot(1), onehot(2), onehot(0)])  # third guess has p = 0
    assert verify_rejection([1, 2, 0], q, p, gen()) == Verdict(2, 3)


def test_one_hot_guess_recovers_without_the_guessed_token():
    residual = _residual(torch.tensor([0.5, 0.3, 0.2]), None, 0, token=0)
    assert torch.allclose(residual, torch.tensor([0.0, 0.6, 0.4]))


def test_residual_is_normalized_positive_part():
    residual = _residual(P[0], Q, 0, token=2)
    expected = torch.tensor([0.4, 0.1, 0.0, 0.0, 0.0]) / 0.5
    assert torch.allclose(residual, expected)


# --- the emitted distribution ----------------------------------------------------------------

def biased_verify(draft_ids, q, p, generator):
    """A plausible bug: recover from p itself instead of the residual. The test below must catch it."""
    u = float(torch.rand(1, generator=generator))
    token = draft_ids[0]
    qx = 1.0 if q is None else float(q[0, token])
    if u * qx < float(p[0, token]):
        return Verdict(1, sample(p[1], generator))
    return Verdict(0, sample(p[0], generator))


def emitted_tokens(verifier, q, n=20000, seed=0):
    """Run one-token drafts through the verifier; return the first emitted token and, if any, the second."""
    g = gen(seed)
    first, second = [], []
    for _ in range(n):
        x = sample(Q[0], g) if q is not None else 2  # a one-hot guess always proposes token 2
        verdict = verifier([x], q, P, g)
        if verdict.num_accepted:
            first.append(x)
            second.append(verdict.next_token)
        else:
            first.append(verdict.next_token)
    return first, second


def as_table(probs):
    return {i: float(v) for i, v in enumerate(probs)}


@pytest.mark.parametrize("q", [Q, None], ids=["drawn-from-q", "one-hot"])
def test_emitted_tokens_follow_p(q):
    first, second = emitted_tokens(verify_rejection, q)
    assert fit_pvalue(first, as_table(P[0])) > 1e-3
    assert fit_pvalue(second, as_table(P[1])) > 1e-3  # the bonus token, after full acceptance


@pytest.mark.parametrize("q", [Q, None], ids=["drawn-from-q", "one-hot"])
def test_a_biased_sampler_fails_the_same_test(q):
    first, _ = emitted_tokens(biased_verify, q)
    assert fit_pvalue(first, as_table(P[0])) < 1e-6


# --- drafts of several tokens: each position's residual from its own row ---------------------------------

# A target whose distribution at each text position is its own row (whatever came before), and a draft whose rows
# differ from each other as much as from the target's: a residual taken from the wrong row shows.
P_AT = torch.tensor([[0.5, 0.3, 0.1, 0.1, 0.0], [0.1, 0.1, 0.2, 0.2, 0.4], [0.3, 0.3, 0.2, 0.1, 0.1],
                     [0.2, 0.2, 0.2, 0.2, 0.2], [0.2, 0.2, 0.2, 0.2, 0.2]])  # [position, vocab]
Q_AT = torch.tensor([[0.1, 0.2, 0.5, 0.1, 0.1], [0.6, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, 0.6],
                     [0.2, 0.2, 0.2, 0.2, 0.2]])


def emitted_at_positions(k=2, n=20000, positions=3, seed=0):
    """The tokens emitted at the first `positions` text positions, over n generations of k-token draft rounds."""
    g = gen(seed)
    texts = []
    for _ in range(n):
        text = []
        while len(text) < positions:
            at = len(text)
            q = Q_AT[at: at + k]  # [k, vocab]
            draft = [sample(row, g) for row in q]
            verdict = verify_rejection(draft, q, P_AT[at: at + k + 1], g)
            text += draft[: verdict.num_accepted] + [verdict.next_token]
        texts.append(text[:positions])
    return texts


def test_every_position_of_a_longer_draft_follows_p():
    texts = emitted_at_positions()
    for position in range(3):
        assert fit_pvalue([t[position] for t in texts], as_table(P_AT[position])) > 1e-3, position


def test_a_residual_from_the_wrong_row_fails_the_same_test(monkeypatch):
    import draftwise.verify.rejection as rejection

    right = rejection._residual
    monkeypatch.setattr(rejection, "_residual", lambda p_i, q, i, token: right(p_i, q, 0, token))  # always row 0
    texts = emitted_at_positions()
    assert fit_pvalue([t[1] for t in texts], as_table(P_AT[1])) < 1e-6
