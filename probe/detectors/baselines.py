"""Baseline detectors that need no gradient: ``lsd`` (LongPPL's long-short difference), ``random``
(the chance level), ``recency`` and ``lexical_overlap``.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from probe.detectors.registry import Detection, register, top_k_mask
from probe.tasks import Sample


@register("lsd")
def lsd(
    model, tokenizer, sample: Sample, K: int = 256, d: int = 128, alpha: float = 2.0, beta: float = -2.0
) -> Detection:
    """Long-short difference LSD(x_i) = log P(x_i | all) − log P(x_i | last K tokens) (LongPPL eq. 2).

    Flags the key tokens of LongPPL eq. 4: LSD > α and LCL > β. The shared implementation is
    :func:`probe.probes.lsd.lsd_scores` (sliding windows of step ``d``). Tokens without a
    short-context score (the first K) get score 0 and are never flagged. The paper's K=4096
    needs samples well beyond 4K tokens; the default K=256 suits ~1K-token samples. ``details``:
    ``lcl``, and ``passes`` (the long pass and one per short-context window of up to K + d tokens).
    """
    from probe.probes.logprobs import short_context_blocks
    from probe.probes.lsd import key_token_mask, lsd_scores

    differences, lcl = lsd_scores(model, sample.input_ids, K=K, d=d)
    passes = 1 + len(short_context_blocks(len(sample.input_ids), K, d))  # the long pass and each window
    flagged = key_token_mask(differences, lcl, alpha, beta)
    flagged[sample.prompt_length :] = False
    return Detection(
        scores=differences.nan_to_num(0.0),
        flagged=flagged,
        settings={"K": K, "d": d, "alpha": alpha, "beta": beta},
        details={"lcl": lcl, "passes": passes},
    )


@register("random")
def random_scores(model, tokenizer, sample: Sample, seed: int = 0, top_k: int = 30) -> Detection:
    """Uniform random scores (seeded): the chance level of every metric."""
    scores = torch.rand(len(sample.input_ids), generator=torch.Generator().manual_seed(seed))
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"seed": seed, "top_k": top_k},
    )


@register("recency")
def recency(model, tokenizer, sample: Sample, top_k: int = 30) -> Detection:
    """Later tokens score higher (position / seq): the "the model reads the end" baseline."""
    scores = torch.arange(len(sample.input_ids), dtype=torch.float32) / len(sample.input_ids)
    return Detection(
        scores=scores, flagged=top_k_mask(scores, top_k, sample.prompt_length), settings={"top_k": top_k}
    )


_WORD = re.compile(r"[A-Za-z0-9]+")
_STOPWORDS = frozenset(
    "a an and are as at be before by did do does for from has have he her his in is it its of on or she "
    "that the their them they this to was were what where which who why with you your".split()
)


@register("lexical_overlap")
def lexical_overlap(model, tokenizer, sample: Sample) -> Detection:
    """1 for context tokens inside a word that also occurs in the question (LOGO's chunk scoring, per word).

    Words are case-folded alphanumeric runs of the sample text, stop words excluded; tokens map
    to words through the sample's token offsets. Flags every overlapping token.
    """
    (q_start, q_end), *_ = sample.char_spans["question"]
    question_words = {w.lower() for w in _WORD.findall(sample.text[q_start:q_end])} - _STOPWORDS
    overlapping = np.zeros(len(sample.text), dtype=bool)
    for match in _WORD.finditer(sample.text):
        if match.group().lower() in question_words:
            overlapping[match.start() : match.end()] = True
    scores = torch.tensor([float(overlapping[start:end].any()) for start, end in sample.offsets])
    scores[sample.prompt_length :] = 0.0
    question = torch.zeros_like(scores, dtype=torch.bool)
    for start, end in sample.spans["question"]:
        question[start:end] = True
    scores[question] = 0.0  # the question trivially overlaps itself
    return Detection(scores=scores, flagged=scores > 0, settings={"stopwords": len(_STOPWORDS)})
