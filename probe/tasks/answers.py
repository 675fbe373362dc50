"""Checking a free-form answer against the gold one: exact match and token F1 after SQuAD's normalization
(lower case, no punctuation, no articles a / an / the, single spaces), the official HotpotQA and SQuAD
answer metrics (Rajpurkar et al., EMNLP 2016; Yang et al., EMNLP 2018)."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """``text`` in lower case without punctuation and articles, words separated by single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def answer_match(generated: str, gold: str) -> dict[str, float]:
    """``{"exact_match": 0 or 1, "f1": token F1}`` of ``generated`` against ``gold``, both normalized
    (:func:`normalize_answer`). As HotpotQA's evaluation: a yes / no / noanswer gold answer scores F1 0
    unless the answer is the same word."""
    predicted, truth = normalize_answer(generated), normalize_answer(gold)
    exact = float(predicted == truth)
    if {predicted, truth} & {"yes", "no", "noanswer"} and predicted != truth:
        return {"exact_match": exact, "f1": 0.0}
    common = Counter(predicted.split()) & Counter(truth.split())
    overlap = sum(common.values())
    if overlap == 0:
        return {"exact_match": exact, "f1": 0.0}
    precision, recall = overlap / len(predicted.split()), overlap / len(truth.split())
    return {"exact_match": exact, "f1": 2 * precision * recall / (precision + recall)}
