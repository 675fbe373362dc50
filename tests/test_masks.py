"""The masks of the faithfulness measures and what is read off them (:mod:`probe.faithfulness.masks`): LDS on
a planted
additive model, top-k masks' ties, the additive ceiling's fit and its own masks."""

import math

import pytest
import torch

from probe.faithfulness import masks


def test_lds_is_one_for_a_planted_additive_model_and_near_zero_for_noise():
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(40, generator=generator)
    kept = masks.random_masks(40, 2000, seed=1)
    actual = kept.double() @ weights.double() + 3.0
    assert masks.lds(weights, kept, actual) == pytest.approx(1.0)
    assert abs(masks.lds(torch.randn(40, generator=generator), kept, actual)) < 0.1
    assert math.isnan(masks.lds(torch.zeros(40), kept, actual))  # a constant prediction


def test_top_k_masks_break_ties_by_position():
    top = masks.top_k_masks(torch.tensor([0.0, 2.0, 1.0, 2.0]), ks=(1, 2, 8))
    assert top.tolist() == [
        [False, True, False, False],
        [False, True, False, True],
        [True, True, True, True],
    ]


def test_the_additive_ceiling_recovers_an_additive_model_exactly():
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(12, generator=generator)
    kept = masks.random_masks(12, 256, seed=3)
    recovered = masks.additive_ceiling(kept, kept.float() @ weights - 2.0)
    assert torch.allclose(recovered, weights, atol=1e-3)


def test_the_ceilings_masks_are_its_own_draw_less_every_lds_mask():
    """With 3 sources the 8 possible masks repeat, so the draw meets the LDS masks and drops them."""
    lds_masks = masks.random_masks(3, 4, seed=2)
    draw = masks.random_masks(3, 40, seed=2 + masks.CEILING_SEED)
    lds_rows = {tuple(mask.tolist()) for mask in lds_masks}
    expected = [mask.tolist() for mask in draw if tuple(mask.tolist()) not in lds_rows]
    fit = masks.additive_ceiling_masks(lds_masks, 40, seed=2)
    assert 0 < len(fit) < 40 and fit.tolist() == expected
    assert masks.additive_ceiling_masks(lds_masks, 0, seed=2).shape == (0, 3)  # no ceiling: none
