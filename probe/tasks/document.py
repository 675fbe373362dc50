"""Planted chains in real essay text (``document-1`` … ``document-3``).

The context is Paul Graham essay sentences (category ``noise``), one source per sentence, as
:func:`probe.attribute` cuts a researcher's document. A chain of 1–3 plain-English sentences
(``supporting``) sits at random depths, in order; the answer needs every link:

1. "The Bell Rock lighthouse is kept by Margaret Ainsley."
2. "The Bell Rock lighthouse is kept by the owner of the green kayak."
   "Margaret Ainsley owns a green kayak."
3. "The Bell Rock lighthouse is kept by the owner of the green kayak."
   "Whoever owns a green kayak rents 14 Harbour Lane."  "Margaret Ainsley rents 14 Harbour Lane."

Question: "Who keeps the Bell Rock lighthouse?" -> "Margaret Ainsley". The links after the first
share no word with the question, so word overlap cannot find them. Distractors (``interference``)
share the question's words and the chain's form: other landmarks kept by other people, other owners of
other vehicles, a sentence about the asked landmark that names nobody; at least one after the last
link. The gold answer is teacher-forced.
"""

from __future__ import annotations

import re

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.tasks.haystack import facts_in_essays
from probe.tasks.sample import Prompt, Sample

LANDMARKS = (
    "Bell Rock lighthouse", "Ardnacross mill", "Kestrel Point observatory", "Marlow canal lock",
    "Thornby bell tower", "Glenrock signal station", "Saltmarsh ferry", "Harwick toll bridge",
)  # fmt: skip
PEOPLE = (
    "Margaret Ainsley", "Tobias Wren", "Lucinda Marsh", "Oswin Pryce", "Harriet Quill", "Ezra Holloway",
    "Beatrix Lowe", "Cedric Vane", "Imogen Stroud", "Rupert Calloway", "Winifred Oakes", "Silas Thorne",
)  # fmt: skip
COLOURS = ("green", "yellow", "crimson", "silver", "orange", "violet", "turquoise", "scarlet")
VEHICLES = ("kayak", "tractor", "motorbike", "canoe", "caravan", "scooter", "sailboat", "wagon")
STREETS = ("Harbour Lane", "Mill Street", "Orchard Row", "Quarry Road", "Chapel Close", "Ferry Walk")
SCENERY = (
    "Tourists who visit the {landmark} often photograph it at dusk.",
    "Nobody remembers exactly when the {landmark} was built.",
    "The {landmark} is closed to visitors every winter.",
)
INSTRUCTION = "Answer the question using the context."


def document(
    tokenizer: PreTrainedTokenizerBase,
    settings: dict,
    rng: np.random.Generator,
    hops: int,
    chat: bool | None = None,
) -> Sample:
    """A ``hops``-link chain (1–3) in essay text; see the module docstring."""
    landmark, *other_landmarks = rng.permutation(LANDMARKS).tolist()
    person, *others = rng.permutation(PEOPLE).tolist()
    colour, *other_colours = rng.permutation(COLOURS).tolist()
    vehicle, *other_vehicles = rng.permutation(VEHICLES).tolist()
    street, *other_streets = rng.permutation(STREETS).tolist()
    address = f"{rng.integers(2, 99)} {street}"
    owner = f"the owner of the {colour} {vehicle}"
    chain = {
        1: [f"The {landmark} is kept by {person}."],
        2: [f"The {landmark} is kept by {owner}.", f"{person} owns a {colour} {vehicle}."],
        3: [f"The {landmark} is kept by {owner}.", f"Whoever owns a {colour} {vehicle} rents {address}.",
            f"{person} rents {address}."],
    }[hops]  # fmt: skip
    distractors = [
        f"The {other_landmarks[0]} is kept by {others[0]}.",
        rng.choice(SCENERY).format(landmark=landmark),
        f"{others[1]} owns a {other_colours[0]} {other_vehicles[0]}.",
        f"The {other_landmarks[1]} is kept by the owner of the {other_colours[1]} {other_vehicles[1]}.",
        f"{others[2]} rents {rng.integers(2, 99)} {other_streets[0]}.",
    ][: int(rng.integers(hops + 1, 2 * hops + 2))]
    prompt = Prompt(
        instruction=INSTRUCTION,
        question=f"Who keeps the {landmark}?",
        answer=person,
        answer_prefix=f"The {landmark} is kept by",
        answer_pattern=r"\b(" + "|".join(map(re.escape, PEOPLE)) + r")\b",
        context_open="Context:\n",
    )
    return facts_in_essays(tokenizer, prompt, settings, rng, chain, distractors, chat=chat)
