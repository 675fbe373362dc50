"""Multi-hop story facts in essay noise (BABILong qa1-qa3 style; CDT 002 Fig. 2 / App. A.1).

Supporting facts about one character and one object are placed in order at the requested depths;
1-2x as many interference facts (other characters, other objects, same kind of sentences) are
scattered through the noise, at least one after the last supporting fact; a few emoji sit between
noise sentences as low-frequency tokens. Hops:

1. "X went to the P1."  Where is X?  -> P1
2. "X took the O." "X went to the P1."  Where is the O?  -> P1
3. "X took the O." "X went to the P1." "X went to the P2."  Where was the O before the P2?  -> P1
4. (CDT's 4-hop pattern, Fig. 12) "X went to the P1." "X took the O." "X went to the P2."
   "X dropped the O."  Where was the O before the place where it was dropped?  -> P1
"""

from __future__ import annotations

import re

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.errors import InvalidValueError
from probe.tasks import words
from probe.tasks.haystack import facts_in_essays
from probe.tasks.noise import EMOJI, emoji
from probe.tasks.sample import Prompt, Sample, Unit

INSTRUCTION = (
    "I will give you context with the facts about positions of different persons and objects hidden in "
    "some random text and a question. You need to answer the question based only on the information "
    "from the facts."
)


def story(
    tokenizer: PreTrainedTokenizerBase,
    settings: dict,
    rng: np.random.Generator,
    hops: int,
    chat=None,
    emojis: int = 3,
) -> Sample:
    """A ``hops``-hop question over supporting facts at ``depth`` (one depth per fact, or one for all)."""
    if not 0 <= emojis <= len(EMOJI):
        raise InvalidValueError(f"emojis must be between 0 and {len(EMOJI)}, got {emojis}")

    def pick(options):
        return options[rng.integers(len(options))]

    characters = rng.permutation(words.CHARACTERS).tolist()
    objects = rng.permutation(words.OBJECTS).tolist()
    hero, thing = characters.pop(), objects.pop()
    first, second = rng.choice(words.PLACES, 2, replace=False).tolist()
    went = f"{hero} {pick(words.MOVE)} the {first}."
    took = f"{hero} {pick(words.PICK)} the {thing}."
    went_again = f"{hero} {pick(words.MOVE)} the {second}."
    facts, question, answer_prefix = {
        1: ([went], f"Where is {hero}?", f"{hero} is in the"),
        2: ([took, went], f"Where is the {thing}?", f"The {thing} is in the"),
        3: (
            [took, went, went_again],
            f"Where was the {thing} before the {second}?",
            f"Before the {second}, the {thing} was in the",
        ),
        4: (
            [went, took, went_again, f"{hero} {pick(words.DROP)} the {thing}."],
            f"Where was the {thing} before the place where it was dropped?",
            f"Before the place where it was dropped, the {thing} was in the",
        ),
    }[hops]

    # Interference: the same kinds of sentences about other characters and other objects.
    interference = []
    for _ in range(int(rng.integers(len(facts), 2 * len(facts) + 1))):
        verb = pick([words.MOVE, words.PICK, words.DROP])
        target = pick(words.PLACES) if verb is words.MOVE else pick(objects)
        interference.append(f"{pick(characters)} {pick(verb)} the {target}.")
    prompt = Prompt(
        instruction=INSTRUCTION,
        question=question,
        answer=first,
        answer_prefix=answer_prefix,
        answer_pattern=r"\b(" + "|".join(map(re.escape, words.PLACES)) + r")\b",
    )
    low_frequency = [Unit(e, "low_frequency") for e in emoji(rng, emojis)]
    return facts_in_essays(tokenizer, prompt, settings, rng, facts, interference, low_frequency, chat)
