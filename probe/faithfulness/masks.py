"""The masks of the faithfulness measures and the scores read off them: the top-k masks of a ranking,
random masks for LDS, the additive ceiling's masks and fit, and LDS itself (ContextCite, Cohen-Wang et
al. 2024). Pure tensor functions: :mod:`probe.faithfulness` runs the passes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from scipy.stats import spearmanr

from probe.checks import check_int, check_number

KS = (1, 2, 4, 8)
MAX_MASKS = 2**20  # a million forward passes: beyond any study, and the masks alone would fill memory
CEILING_SEED = 7919  # the additive ceiling's masks: seed + this, apart from the LDS masks' seed


def top_k_masks(scores: torch.Tensor, ks: Sequence[int] = KS) -> torch.Tensor:
    """BoolTensor[len(ks), sources]: the k highest-scoring sources for each k (ties by position)."""
    order = torch.argsort(-scores.float(), stable=True)
    masks = torch.zeros(len(ks), len(scores), dtype=torch.bool)
    for row, k in enumerate(ks):
        masks[row, order[: min(k, len(scores))]] = True
    return masks


def random_masks(n_sources: int, n_masks: int, keep: float = 0.5, seed: int = 0) -> torch.Tensor:
    """BoolTensor[n_masks, n_sources] of *kept* sources, each kept with probability ``keep`` (seeded).
    At most :data:`MAX_MASKS` masks (each is a forward pass)."""
    check_int(n_masks, "n_masks", 1, MAX_MASKS)
    check_number(keep, "keep", 0, 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n_masks, n_sources, generator=generator) < keep


def additive_ceiling_masks(
    kept_lds: torch.Tensor, count: int, keep: float = 0.5, seed: int = 0
) -> torch.Tensor:
    """BoolTensor[≤ count, sources] of kept sources the additive ceiling is fit on: ``count`` random
    masks seeded apart from the LDS masks (``seed`` + :data:`CEILING_SEED`), less any that is one of
    ``kept_lds`` (BoolTensor[masks, sources], the LDS masks), so the ceiling is never scored on a mask
    it was fit on. ``count`` 0: none (a study run without the ceiling)."""
    if count == 0:
        return kept_lds[:0]
    fit = random_masks(kept_lds.shape[1], count, keep, seed + CEILING_SEED)
    return fit[~(fit[:, None] == kept_lds[None]).all(-1).any(-1)]


def lds(scores: torch.Tensor, kept: torch.Tensor, actual: torch.Tensor) -> float:
    """Linear datamodeling score: Spearman ρ between Σ_{kept} scores and the actual values over masks.

    ``scores`` Tensor[sources], ``kept`` BoolTensor[masks, sources], ``actual`` Tensor[masks].
    NaN when either side is constant.
    """
    predicted = kept.double() @ scores.double()
    if predicted.unique().numel() < 2 or actual.unique().numel() < 2:
        return float("nan")
    return float(spearmanr(predicted.numpy(), actual.double().numpy()).statistic)


def additive_ceiling(kept: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Tensor[sources]: the weights of the best additive surrogate of the ablations, ``actual``
    Tensor[masks] ≈ ``kept`` BoolTensor[masks, sources] @ w + b, by ridge regression with the penalty
    chosen by leave-one-out cross-validation (scikit-learn's ``RidgeCV``). Scored on other masks, its
    LDS is what no additive attribution can clearly beat on the sample (ContextCite's surrogate,
    Cohen-Wang et al. 2024, fit on many masks instead of a few)."""
    from sklearn.linear_model import RidgeCV

    fit = RidgeCV(alphas=np.logspace(-4, 2, 13)).fit(kept.double().numpy(), actual.double().numpy())
    return torch.from_numpy(fit.coef_).float()
