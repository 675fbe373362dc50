"""Needle-in-a-haystack tasks over essay noise.

- ``passkey``: the pass-key retrieval of Mohtashami & Jaggi (landmark attention), haystack = essays.
- ``niah``: a single key -> number needle in RULER's wording, optionally with distractor needles
  (other keys, category ``interference``).
- ``multivalue-niah``: LOGO (003, App. B, Fig. 8): several needles, one per city, share one
  activity; the question asks for the single thing to do in all of them (the shared activity).
"""

from __future__ import annotations

import re

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.checks import check_int
from probe.errors import InvalidValueError
from probe.tasks import words
from probe.tasks.haystack import build
from probe.tasks.noise import noise_units
from probe.tasks.sample import Prompt, Sample, Unit

NUMBER = r"\d+"


def passkey(
    tokenizer: PreTrainedTokenizerBase, settings: dict, rng: np.random.Generator, chat=None, digits: int = 5
) -> Sample:
    """One pass-key sentence (a ``digits``-digit number, stated twice) hidden in essay noise."""
    digits = check_int(digits, "digits", minimum=1)
    key = str(rng.integers(10 ** (digits - 1), 10**digits))
    prompt = Prompt(
        instruction="There is an important info hidden inside a lot of irrelevant text. Find it and "
        "memorize it. I will quiz you about the important information there.",
        question="What is the pass key?",
        answer=key,
        answer_prefix="The pass key is",
        answer_pattern=NUMBER,
    )
    needle = Unit(f"The pass key is {key}. Remember it. {key} is the pass key.", "supporting")
    return build(tokenizer, prompt, settings, rng, noise_units(rng), [needle], chat=chat)


def niah(
    tokenizer: PreTrainedTokenizerBase,
    settings: dict,
    rng: np.random.Generator,
    chat=None,
    distractors: int = 0,
) -> Sample:
    """RULER-style single needle "One of the special magic numbers for {key} is: {value}."."""
    keys = words.keys(rng, distractors + 1)
    values = [str(v) for v in rng.integers(10**6, 10**7, len(keys))]
    needles = [
        Unit(f"One of the special magic numbers for {key} is: {value}.", "supporting")
        for key, value in zip(keys, values, strict=True)
    ]
    prompt = Prompt(
        instruction="Some special magic numbers are hidden within the following text. Make sure to "
        "memorize them. I will quiz you about the numbers afterwards.",
        question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
        answer=values[0],
        answer_prefix=f"The special magic number for {keys[0]} mentioned in the provided text is",
        answer_pattern=NUMBER,
    )
    others = [Unit(n.text, "interference") for n in needles[1:]]
    return build(tokenizer, prompt, settings, rng, noise_units(rng), needles[:1], scattered=others, chat=chat)


def multivalue_niah(
    tokenizer: PreTrainedTokenizerBase, settings: dict, rng: np.random.Generator, chat=None, needles: int = 2
) -> Sample:
    """LOGO's multi-value NIAH: ``needles`` city needles sharing one activity, which is the answer."""
    if not 2 <= needles <= len(words.CITIES):
        raise InvalidValueError(f"needles must be between 2 and {len(words.CITIES)}, got {needles}")
    cities = rng.choice(words.CITIES, needles, replace=False).tolist()
    shared = words.SHARED_ACTIVITIES[rng.integers(len(words.SHARED_ACTIVITIES))]
    local = rng.choice(words.LOCAL_ACTIVITIES, needles, replace=False).tolist()
    all_cities = ", ".join(cities[:-1]) + " and " + cities[-1]
    candidates = sorted(words.SHARED_ACTIVITIES + words.LOCAL_ACTIVITIES, key=len, reverse=True)
    prompt = Prompt(
        instruction="Some facts about cities are hidden within the following text. Read them carefully. "
        "I will ask you about them afterwards.",
        question=f"What is the single best thing to do in both {all_cities}?",
        answer=shared,
        answer_prefix=f"The single best thing to do in both {all_cities} is to",
        answer_pattern="|".join(re.escape(c) for c in candidates),
    )
    facts = [
        Unit(f"The best thing to do in {city} is to {shared} and {activity}.", "supporting")
        for city, activity in zip(cities, local, strict=True)
    ]
    return build(tokenizer, prompt, settings, rng, noise_units(rng), facts, chat=chat)
