"""Scoring a detector's output against a sample's exact ground-truth spans.

Only context tokens count (everything before the teacher-forced answer). Categories follow
CDT (Context Denoising Training, Fig. 7): ``supporting`` and ``interference`` facts, ``noise`` (book text),
``low_frequency`` (emoji); everything else in the prompt (template, instruction, question)
is ``other``.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import precision_score, recall_score, roc_auc_score

from probe.checks import check_int
from probe.detectors import Detection, check_detection_of, top_k_mask
from probe.errors import InvalidTypeError, InvalidValueError
from probe.tasks import Sample, check_sample

SHARE_CATEGORIES = ("supporting", "interference", "noise", "low_frequency", "other")


def plausibility(detection: Detection, sample: Sample, top_k: int = 30) -> dict[str, float]:
    """Plausibility metrics of one detection on one sample (against its exact spans), as one flat record.

    - ``share_{set}_{category}``: fraction of the flagged set / the top-``top_k`` set in each category;
    - ``precision_{target}`` / ``recall_{target}`` of the flagged set, target ``supporting`` or
      ``critical`` (supporting + interference);
    - ``auroc``: scores ranking supporting tokens above all other context tokens (NaN if one class is empty);
    - ``fact_hit_rate``: fraction of supporting facts with at least one token in the top-``top_k``;
    - ``n_flagged``: size of the flagged set.
    """
    check_int(top_k, "top_k", minimum=1)
    check_detection_of(detection, sample)
    context = sample.prompt_length
    labels = sample.categories[:context]
    labels = np.where(np.isin(labels, SHARE_CATEGORIES), labels, "other")
    scores = detection.scores[:context].numpy()
    sets = {
        "flagged": detection.flagged[:context].numpy(),
        "top_k": top_k_mask(detection.scores, top_k, context)[:context].numpy(),
    }

    record: dict[str, float] = {"n_flagged": int(sets["flagged"].sum())}
    for set_name, chosen in sets.items():
        for category in SHARE_CATEGORIES:
            record[f"share_{set_name}_{category}"] = (
                float((labels[chosen] == category).mean()) if chosen.any() else 0.0
            )
    targets = {
        "supporting": labels == "supporting",
        "critical": np.isin(labels, ("supporting", "interference")),
    }
    for target, truth in targets.items():
        record[f"precision_{target}"] = float(precision_score(truth, sets["flagged"], zero_division=0))
        record[f"recall_{target}"] = float(recall_score(truth, sets["flagged"], zero_division=0))
    truth = targets["supporting"]
    record["auroc"] = float(roc_auc_score(truth, scores)) if 0 < truth.sum() < len(truth) else float("nan")
    facts = sample.spans["supporting"]
    record["fact_hit_rate"] = (
        float(np.mean([sets["top_k"][start:end].any() for start, end in facts])) if facts else float("nan")
    )
    return record


def source_plausibility(scores, sample: Sample, ks: tuple[int, ...] = (2, 4)) -> dict[str, float]:
    """Plausibility at the level of sources (sentences, facts) against the sample's supporting ones, the
    comparison of a detector with gold supporting sentences (HotpotQA's, Yang et al. 2018):

    - ``source_auroc``: source scores ranking supporting sources above the others (NaN if one class is empty);
    - ``recall_top{k}_sources``: share of the supporting sources among the ``k`` highest-scored ones (ties:
      the earlier source first), for each k of ``ks`` (NaN without supporting sources).

    ``scores``: one score per source, in ``sample.sources`` order (:meth:`Detection.source_scores`).
    """
    check_sample(sample)
    sources = sample.sources
    try:
        values = torch.as_tensor(scores, dtype=torch.float64).cpu().numpy().reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        raise InvalidTypeError(f"scores must be numbers, one per source, got {scores!r:.60}") from None
    if len(values) != len(sources):
        raise InvalidValueError(f"scores has {len(values)} entries for the sample's {len(sources)} sources")
    truth = np.array([source.category == "supporting" for source in sources])
    record = {"source_auroc": float(roc_auc_score(truth, values)) if 0 < truth.sum() < len(truth) else np.nan}
    order = np.argsort(-values, kind="stable")
    for k in ks:
        check_int(k, "k", minimum=1)
        record[f"recall_top{k}_sources"] = (
            float(truth[order[:k]].sum() / truth.sum()) if truth.any() else np.nan
        )
    return record
