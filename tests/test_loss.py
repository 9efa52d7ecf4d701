"""loss.py against a naive per-pair loop, a hand-worked case, and gradcheck."""
import math

import torch

from loss import nt_xent


def naive(anchors, positives, tau):
    """Term by term, as the paper writes it: every other embedding in the denominator, both directions."""
    pos = positives.mean(1) if positives.dim() == 3 else positives
    z = torch.cat([anchors, pos])
    m = len(anchors)

    def cos(u, v):
        return float(u @ v / (u.norm() * v.norm()))

    total = 0.0
    for i in range(2 * m):
        j = i + m if i < m else i - m
        num = math.exp(cos(z[i], z[j]) / tau)
        den = sum(math.exp(cos(z[i], z[k]) / tau) for k in range(2 * m) if k != i)
        total += -math.log(num / den)
    return total / (2 * m)


def test_matches_naive_loop():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 5, generator=g, dtype=torch.float64)
    p = torch.randn(6, 3, 5, generator=g, dtype=torch.float64)
    for tau in (0.05, 0.5, 1.0):
        assert abs(float(nt_xent(a, p, tau)) - naive(a, p, tau)) <= 1e-6


def test_hand_worked_two_documents():
    # Two documents, one anchor each. Document 1: anchor (1, 0), positives (1, 1) and (1, -1), whose mean is
    # (1, 0); document 2: anchor (0, 1), positives (-1, 1) and (1, 1), mean (0, 1). Every embedding has cosine 1
    # with its partner and 0 with the other two, so each of the 4 terms is
    # -log(e^(1/tau) / (e^(1/tau) + 2)) = log(1 + 2 e^(-1/tau)).
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    p = torch.tensor([[[1.0, 1.0], [1.0, -1.0]], [[-1.0, 1.0], [1.0, 1.0]]])
    assert abs(float(nt_xent(a, p, 1.0)) - math.log(1 + 2 / math.e)) <= 1e-6  # 0.551444...
    assert abs(float(nt_xent(a, p, 0.5)) - math.log(1 + 2 * math.exp(-2))) <= 1e-6


def test_single_positive_layouts_agree_and_scale_does_not_matter():
    g = torch.Generator().manual_seed(1)
    a, p = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    assert torch.allclose(nt_xent(a, p), nt_xent(a, p[:, None]))
    assert torch.allclose(nt_xent(a, p), nt_xent(3 * a, 0.5 * p), atol=1e-5)  # cosine: lengths do not count


def test_gradcheck():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: nt_xent(x, y, 0.1), (a, p))
