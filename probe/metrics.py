"""Scoring a detector's output against a sample's exact ground-truth spans.

Only context tokens count (everything before the teacher-forced answer). Categories follow
CDT (Context Denoising Training, Fig. 7): ``supporting`` and ``interference`` facts, ``noise`` (book text),
``low_frequency`` (emoji); everything else in the prompt (template, instruction, question)
is ``other``.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import precision_score, recall_score, roc_auc_score

from probe.checks import check_int
from probe.detectors import Detection, check_detection_of, top_k_mask
from probe.tasks import Sample

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
