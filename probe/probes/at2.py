"""AT2: source attribution with per-head weights learned from ablations.

After Cohen-Wang et al. 2025, "Learning to Attribute with Attention" (AT2). One forward+backward pass
(:func:`probe.probes.attribution.answer_attribution`) gives, for every head (l, h) and token t, two features
of the answer rows: the attention mass ``mean_r A[l, h, r, t]`` and the saliency
``Σ_r |A ⊙ ∂L/∂A|[l, h, r, t]``. A token's score is a weighted sum of its features over heads,
``Σ_{f,l,h} θ[f, l, h] · F[f, l, h, t]``, and a source's score the sum over its tokens.

The weights θ are fit to this toolkit's own ablations: over random source masks of training samples
(each source kept with probability 1/2, :func:`probe.faithfulness.random_masks`), the surrogate
``lp(mask) ≈ c_sample + Σ_{kept s} score_s`` of the gold answer's log-probability is linear in θ, so θ
is a ridge regression on per-sample centred rows; the penalty is chosen by the LDS of held-out samples
(grouped cross-validation). AT2 optimizes a correlation loss by gradient descent over many more
samples; the features, the surrogate and the ablation target are the same idea.
:func:`analyses.learn_head_weights` fits, validates on held-out tasks, seeds and lengths, and saves
the weights per model as a :class:`HeadWeights` result; the two bundled models' weights ship in
``probe/data/head_weights/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probe.checks import hf_model
from probe.errors import InvalidTypeError, InvalidValueError
from probe.probes.attribution import AnswerAttribution
from probe.results import read_json, reading, write_json
from probe.tasks import Sample

FEATURES = ("attention", "saliency")
BUNDLED = Path(__file__).parents[1] / "data" / "head_weights"
ALPHAS = tuple(10.0**e for e in range(-2, 5))


def token_features(attribution: AnswerAttribution) -> torch.Tensor:
    """Tensor[features, layers, heads, seq]: the answer rows' attention mass and |A ⊙ ∂L/∂A| per token."""
    pattern, grad = attribution.pattern.float(), attribution.pattern_grad.float()
    return torch.stack([pattern.mean(dim=2), (pattern * grad).abs().sum(dim=2)]).cpu()


def source_features(features: torch.Tensor, sample: Sample) -> torch.Tensor:
    """Tensor[sources, features, layers, heads]: ``features`` [features, layers, heads, seq] summed
    over each source's tokens."""
    return torch.stack([features[..., s.start : s.end].sum(-1) for s in sample.sources])


def fingerprint(model) -> dict[str, Any]:
    """What weights must match: architecture, layers, heads, width and vocabulary of ``model``."""
    config = hf_model(model).config.get_text_config()
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
    }


@dataclass
class HeadWeights:
    """Learned AT2 weights: ``weights`` Tensor[features, layers, heads] (see the module docstring).

    ``settings``: the model's :func:`fingerprint` (``model``), how they were fit (tasks, lengths,
    seeds, masks, ``alpha``) and how they validated (``validation``: held-out LDS per set).
    """

    weights: torch.Tensor
    settings: dict[str, Any]

    def token_scores(self, features: torch.Tensor) -> torch.Tensor:
        """Tensor[seq] from :func:`token_features` [features, layers, heads, seq]."""
        return torch.einsum("flht,flh->t", features.float(), self.weights.float())

    def check(self, model) -> None:
        """Refuse weights learned for another architecture than ``model``'s."""
        expected, found = self.settings["model"], fingerprint(model)
        if expected != found:
            raise InvalidValueError(
                f"these head weights were learned for {expected}, the model is {found}; fit weights for "
                "this model with python -m analyses.learn_head_weights --model ..."
            )

    def to_frame(self) -> pd.DataFrame:
        """One row per (feature, layer, head): its weight."""
        f, layers, heads = self.weights.shape
        index = pd.MultiIndex.from_product([FEATURES[:f], range(layers), range(heads)])
        return (
            pd.DataFrame({"weight": self.weights.reshape(-1).numpy()}, index=index)
            .rename_axis(["feature", "layer", "head"])
            .reset_index()
        )

    def save(self, path: str | Path) -> Path:
        """Write weights and settings as JSON, atomically."""
        return write_json(path, {"weights": self.weights.tolist(), "settings": self.settings})

    @classmethod
    def load(cls, path: str | Path) -> HeadWeights:
        """The head weights :meth:`save` wrote."""
        record = read_json(path, "HeadWeights", ("weights", "settings"))
        with reading(path, "HeadWeights"):
            return cls(torch.tensor(record["weights"]), record["settings"])

    @classmethod
    def bundled(cls, model) -> HeadWeights | None:
        """The weights shipped with longprobe for ``model``'s architecture (:func:`fingerprint`), if any."""
        bundled = [cls.load(path) for path in sorted(BUNDLED.glob("*.json"))]
        return next((found for found in bundled if found.settings["model"] == fingerprint(model)), None)

    @classmethod
    def for_model(cls, model, weights: HeadWeights | str | Path | None = None) -> HeadWeights:
        """``weights`` (an object or a file), else :meth:`bundled`; checked against ``model``."""
        if weights is not None and not isinstance(weights, (HeadWeights, str, Path)):
            raise InvalidTypeError(f"weights must be HeadWeights, a file's path or None, got {weights!r}")
        found = cls.bundled(model) if weights is None else weights
        if found is None:
            raise InvalidValueError(
                f"no bundled AT2 head weights fit {fingerprint(model)}; learn them with "
                "python -m analyses.learn_head_weights --model ... and pass weights=PATH"
            )
        found = found if isinstance(found, HeadWeights) else cls.load(found)
        found.check(model)
        return found


def surrogate_rows(features: torch.Tensor, kept: torch.Tensor, logprob: torch.Tensor):
    """One sample's regression rows: X [masks, F] = kept · features, centred over masks, and the centred
    log-probabilities y [masks] (the sample's intercept drops out). ``features`` [sources, ...]."""
    x = kept.double() @ features.reshape(len(features), -1).double()
    y = logprob.double()
    return (x - x.mean(0)).numpy(), (y - y.mean()).numpy()


def fit(
    features: Sequence[torch.Tensor],
    kept: Sequence[torch.Tensor],
    logprob: Sequence[torch.Tensor],
    alphas: Sequence[float] = ALPHAS,
    folds: int = 5,
) -> tuple[torch.Tensor, float, pd.DataFrame]:
    """Ridge weights θ Tensor[features, layers, heads] from training samples, the chosen penalty, and
    the cross-validated LDS of every penalty (one row per alpha).

    ``features[i]``: Tensor[sources_i, features, layers, heads] (:func:`source_features`),
    ``kept[i]``: BoolTensor[masks_i, sources_i], ``logprob[i]``: Tensor[masks_i]. Columns are scaled
    to unit variance before the fit; the penalty is the one whose held-out samples (``folds`` groups)
    have the highest mean LDS.
    """
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import GroupKFold

    from probe.faithfulness import lds

    if len(features) < 2:
        raise InvalidValueError("fitting head weights needs at least 2 training samples")
    rows = [surrogate_rows(f, k, y) for f, k, y in zip(features, kept, logprob, strict=True)]
    x, y = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
    groups = np.concatenate([np.full(len(r[1]), i) for i, r in enumerate(rows)])
    scale = x.std(0)
    scale[scale == 0] = 1.0
    shape = features[0].shape[1:]

    def weights_of(model: Ridge) -> torch.Tensor:
        return torch.tensor(model.coef_ / scale, dtype=torch.float32).reshape(shape)

    scores = []
    for alpha in alphas:
        held_out = []
        for train, test in GroupKFold(n_splits=min(folds, len(rows))).split(x, y, groups):
            theta = weights_of(Ridge(alpha=alpha, fit_intercept=False).fit(x[train] / scale, y[train]))
            for i in np.unique(groups[test]):
                held_out.append(lds(source_scores(features[i], theta), kept[i], logprob[i]))
        scores.append({"alpha": alpha, "cv_lds": float(np.nanmean(held_out))})
    table = pd.DataFrame(scores)
    alpha = float(table.alpha[table.cv_lds.idxmax()])
    return weights_of(Ridge(alpha=alpha, fit_intercept=False).fit(x / scale, y)), alpha, table


def source_scores(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Tensor[sources]: ``features`` [sources, features, layers, heads] weighted by ``weights``."""
    return torch.einsum("sflh,flh->s", features.float(), weights.float())
