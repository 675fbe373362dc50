"""LongEval "lines" retrieval (LongChat, ``longeval/utils.py::generate_lines_testcases``, LRT-NL).

Records ``line {adjective-noun}: REGISTER_CONTENT is <number>``; the question asks for the number
of one line. By default the record fills the whole length (the asked line is ``supporting``, all
others ``interference``). The easy setting ``lines=n`` keeps only ``n`` lines and fills the rest
with essay noise, one sentence per line.
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.errors import InvalidValueError
from probe.tasks import words
from probe.tasks.haystack import build
from probe.tasks.noise import noise_units
from probe.tasks.sample import Prompt, Sample, Unit

HEADER = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' and "
    "contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. For each line index, "
    "memorize its corresponding <REGISTER_CONTENT>. At the end of the record, I will ask you to retrieve "
    "the corresponding <REGISTER_CONTENT> of a certain line index. Now the record start:"
)


def lines(
    tokenizer: PreTrainedTokenizerBase,
    settings: dict,
    rng: np.random.Generator,
    chat=None,
    lines: int | None = None,
) -> Sample:
    """The asked line at ``depth``; ``lines=None``: other lines fill the length, else ``lines`` in all."""
    if lines is not None and lines < 1:
        raise InvalidValueError(f"lines must be at least 1, got {lines}")
    keys = words.keys(rng, len(words.ADJECTIVES) * len(words.NOUNS))  # all keys, in random order
    values = rng.integers(1, 50001, len(keys))
    records = [f"line {key}: REGISTER_CONTENT is <{value}>" for key, value in zip(keys, values, strict=True)]
    prompt = Prompt(
        instruction=HEADER,
        question=f"Now the record is over. Tell me what is the <REGISTER_CONTENT> in line {keys[0]}? "
        "I need the number.",
        answer=str(values[0]),
        answer_prefix=f"The <REGISTER_CONTENT> in line {keys[0]} is",
        answer_pattern=r"\d+",
        separator="\n",
    )
    asked = [Unit(records[0], "supporting")]
    others = (Unit(record, "interference") for record in records[1:])
    if lines is None:
        return build(tokenizer, prompt, settings, rng, others, asked, chat=chat)
    scattered = [next(others) for _ in range(lines - 1)]
    return build(tokenizer, prompt, settings, rng, noise_units(rng), asked, scattered=scattered, chat=chat)
