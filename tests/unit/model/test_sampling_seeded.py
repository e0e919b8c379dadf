"""Sampling: greedy, temperature and top-p with per-request seeded generators."""
from __future__ import annotations

import torch

from shared.model.sampling import greedy, make_generator, sample_row


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 3.0]])
    assert greedy(logits) == [1, 0]
    assert sample_row(logits[0], 0.0, 1.0, make_generator(0)) == 1


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0))

    def draw(seed):
        g = make_generator(seed)
        return [sample_row(logits, 1.0, 1.0, g) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = make_generator(1)
    seen = {sample_row(logits, 1.0, 0.7, g) for _ in range(400)}
    assert seen == {0, 1}  # 0.5 + 0.3 >= 0.7: the tail is never drawn
    seen_all = {sample_row(logits, 1.0, 1.0, g) for _ in range(400)}
    assert seen_all == {0, 1, 2, 3}
    assert {sample_row(logits, 1.0, 0.01, g) for _ in range(50)} == {0}


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0, 0.0, 0.0])
    g = make_generator(2)
    cold = sum(sample_row(logits, 0.1, 1.0, g) == 0 for _ in range(300))
    hot = sum(sample_row(logits, 5.0, 1.0, g) == 0 for _ in range(300))
    assert cold > 290 and hot < 150
