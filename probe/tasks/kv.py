"""Key-value retrieval (Liu et al., "Lost in the Middle", TACL 2024, ``make_kv_retrieval_data.py``).

A JSON object of random UUID -> UUID pairs fills the length; the question asks for the value of
the gold key, whose pair sits at ``depth``. The gold pair is ``supporting``, the others
``interference``. A pair's span is ``key": "value`` without its outer quotes: byte-level tokenizers
merge a closing quote with the following comma (``",``), so the quotes belong to the separator.
"""

from __future__ import annotations

import itertools
import uuid

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.tasks.haystack import build
from probe.tasks.sample import Prompt, Sample, Unit

UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def kv(tokenizer: PreTrainedTokenizerBase, settings: dict, rng: np.random.Generator, chat=None) -> Sample:
    """Gold UUID pair at ``depth`` among random pairs filling the length."""

    def random_uuid() -> str:
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))

    gold_key, gold_value = random_uuid(), random_uuid()
    prompt = Prompt(
        instruction="Extract the value corresponding to the specified key in the JSON object below.",
        question=f'What is the value of the key "{gold_key}"?',
        answer=gold_value,
        answer_prefix="The value of the key is",
        answer_pattern=UUID,
        context_open='JSON data:\n{"',
        context_close='"}',
        separator='", "',
    )
    others = (Unit(f'{random_uuid()}": "{random_uuid()}', "interference") for _ in itertools.count())
    gold = Unit(f'{gold_key}": "{gold_value}', "supporting")
    return build(tokenizer, prompt, settings, rng, others, [gold], chat=chat)
