"""Lay out a context of filler units with items inserted at chosen depths, to a target token length.

Filler is whatever pads the context: essay sentences (category ``noise``) for needle and story
tasks, more records (category ``interference``) for LongEval lines and key-value retrieval. Items
are the units that matter: ``support`` (placed in order at the requested depths), ``scattered``
(interference facts, distractor needles, emoji: at random places) and ``after`` (at random places
after the last supporting item, CDT's "at least one interference fact after the last supporting
fact").

Depth is measured in filler tokens: an item at depth d has a fraction d of the filler tokens before
it (to within one filler unit). The number of filler units is chosen from their token counts so the
prompt has ``length`` tokens (to within about one unit), then corrected by re-tokenizing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import islice

import numpy as np
from transformers import PreTrainedTokenizerBase

from probe.errors import InvalidValueError
from probe.tasks.noise import noise_units
from probe.tasks.sample import Prompt, Sample, Unit, render

Depth = float | Sequence[float] | None


def support_depths(depth: Depth, count: int, rng: np.random.Generator) -> list[float]:
    """One depth per supporting item: uniform random (sorted) if ``None``, all equal if a number."""
    if depth is None:
        return sorted(rng.uniform(0.0, 1.0, count).tolist())
    depths = [float(depth)] * count if np.isscalar(depth) else [float(d) for d in depth]
    if len(depths) != count:
        raise InvalidValueError(f"got {len(depths)} depths for {count} supporting items")
    if not all(0.0 <= d <= 1.0 for d in depths):
        raise InvalidValueError(f"depth must lie in [0, 1], got {depth}")
    if depths != sorted(depths):
        raise InvalidValueError(f"depths of ordered supporting items must not decrease, got {depth}")
    return depths


def build(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    settings: dict,
    rng: np.random.Generator,
    filler: Iterator[Unit],
    support: list[Unit],
    scattered: Sequence[Unit] = (),
    after: Sequence[Unit] = (),
    chat: bool | None = None,
) -> Sample:
    """The sample of ``settings["length"]`` prompt tokens with ``support`` at ``settings["depth"]``."""
    length = settings["length"]
    depths = support_depths(settings["depth"], len(support), rng)
    scattered_at = rng.uniform(0.0, 1.0, len(scattered))
    after_at = rng.uniform(0.0, 1.0, len(after))

    def layout(cumulative: np.ndarray, units: list[Unit]) -> Sample:
        fractions = cumulative / max(cumulative[-1], 1)

        def slot(depth: float) -> int:
            return int(np.argmin(np.abs(fractions - depth)))

        support_slots = [slot(d) for d in depths]
        last = support_slots[-1] if support else 0
        after_slots = [last + round(f * (len(units) - last)) for f in after_at]
        inserted = (
            [(slot(f), 0, unit) for f, unit in zip(scattered_at, scattered, strict=True)]
            + [(s, 1, unit) for s, unit in zip(support_slots, support, strict=True)]
            + [(s, 2, unit) for s, unit in zip(after_slots, after, strict=True)]
        )
        inserted.sort(key=lambda entry: entry[:2])  # stable: list order within a slot and rank
        body: list[Unit] = []
        for k in range(len(units) + 1):
            body += [unit for s, _, unit in inserted if s == k] + units[k : k + 1]
        return render(tokenizer, prompt, body, settings, chat)

    fixed = layout(np.zeros(1), []).prompt_length
    budget = length - fixed
    if budget < 0:
        raise InvalidValueError(
            f"length {length} is too short for task {settings['task']!r}: its prompt needs {fixed} tokens "
            "before any filler"
        )
    units, counts = _draw_filler(tokenizer, filler, prompt.separator, budget)
    cumulative = np.concatenate([[0], np.cumsum(counts)])
    if cumulative[-1] < 0.98 * budget:
        raise InvalidValueError(
            f"length {length} is beyond what the filler text can fill "
            f"(at most about {fixed + cumulative[-1]} tokens for this tokenizer)"
        )
    # Per-unit counts ignore merges at unit boundaries: measure, correct, keep the closest.
    tried: dict[int, Sample] = {}
    n = int(np.argmin(np.abs(cumulative - budget)))
    while n not in tried:
        tried[n] = layout(cumulative[: n + 1], units[:n])
        n = int(np.argmin(np.abs(cumulative - (cumulative[n] - tried[n].prompt_length + length))))
    return min(tried.values(), key=lambda sample: abs(sample.prompt_length - length))


def facts_in_essays(
    tokenizer: PreTrainedTokenizerBase,
    prompt: Prompt,
    settings: dict,
    rng: np.random.Generator,
    facts: Sequence[str],
    interference: Sequence[str],
    scattered: Sequence[Unit] = (),
    chat: bool | None = None,
) -> Sample:
    """Supporting ``facts`` in order in essay noise, the ``interference`` sentences scattered through it,
    the first of them after the last fact (CDT's rule), and further ``scattered`` units."""
    distractors = [Unit(text, "interference") for text in interference]
    return build(
        tokenizer,
        prompt,
        settings,
        rng,
        noise_units(rng),
        [Unit(fact, "supporting") for fact in facts],
        scattered=[*distractors[1:], *scattered],
        after=distractors[:1],
        chat=chat,
    )


def _draw_filler(
    tokenizer: PreTrainedTokenizerBase, filler: Iterator[Unit], separator: str, budget: int
) -> tuple[list[Unit], list[int]]:
    """Filler units (and their token counts) until they hold ``budget`` tokens plus a margin."""
    units: list[Unit] = []
    counts: list[int] = []
    while sum(counts) < 1.05 * budget + 64:
        chunk = list(islice(filler, 64))
        if not chunk:
            break
        encoded = tokenizer([separator + u.text for u in chunk], add_special_tokens=False)["input_ids"]
        units += chunk
        counts += [len(ids) for ids in encoded]
    return units, counts
