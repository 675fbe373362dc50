"""Text-level rewrites of a sample, tokenized again with the span rule: sources removed
(:meth:`Sample.without <probe.tasks.Sample.without>`) and another answer teacher-forced
(:meth:`Sample.with_answer <probe.tasks.Sample.with_answer>`); both methods call these functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from probe.checks import check_tokenizer
from probe.errors import InvalidValueError
from probe.tasks.spans import tokenize_with_spans, uses_chat


def without(sample, sources: Sequence, tokenizer: PreTrainedTokenizerBase):
    """``sample`` with the text of ``sources`` removed (see :meth:`probe.tasks.Sample.without`)."""
    own = sample.sources
    chosen = set(sources)
    for source in chosen:
        if source.category in ("question", "answer"):
            raise InvalidValueError(f"the {source.category} is never removed from a sample, got {source}")
        if source not in own:
            raise InvalidValueError(f"{source} is not one of this sample's sources")
    chars = [sample.char_spans[source.category][source.index] for source in own]
    gaps = {sample.text[end:start] for (_, end), (start, _) in zip(chars, chars[1:], strict=False)}
    if len(gaps) > 1:
        raise InvalidValueError(f"the sources are not joined by one separator (found {sorted(gaps)})")

    gone = [source in chosen for source in own]
    last_kept = max((i for i, flag in enumerate(gone) if not flag), default=-1)
    cuts = []  # character ranges to delete, in text order
    for i, flag in enumerate(gone):
        if not flag:
            continue
        if 0 <= last_kept < i:  # after the last kept source: the separator before it goes
            cuts.append((chars[i - 1][1], chars[i][1]))
        elif i + 1 < len(own):  # otherwise the separator after it goes
            cuts.append((chars[i][0], chars[i + 1][0]))
        else:  # the only source of the body
            cuts.append(chars[i])
    kept_text = np.ones(len(sample.text), dtype=bool)
    pieces, position = [], 0
    for start, end in cuts:
        kept_text[start:end] = False
        pieces.append(sample.text[position:start])
        position = end
    text = "".join(pieces) + sample.text[position:]
    new_position = np.concatenate([[0], np.cumsum(kept_text)])  # old character index -> new one

    dropped = {(source.category, source.index) for source in chosen}
    char_spans = {
        category: [
            (int(new_position[start]), int(new_position[end]))
            for index, (start, end) in enumerate(spans)
            if (category, index) not in dropped
        ]
        for category, spans in sample.char_spans.items()
    }
    with_chat = uses_chat(tokenizer, sample.options.get("chat"))
    input_ids, offsets, spans, cuts = tokenize_with_spans(tokenizer, text, char_spans, not with_chat)
    for category in ("question", "answer"):
        (old_start, old_end), (new_start, new_end) = sample.spans[category][0], spans[category][0]
        if not torch.equal(sample.input_ids[old_start:old_end], input_ids[new_start:new_end]):
            raise InvalidValueError(
                f"the {category} tokenizes differently after the removal: is {type(tokenizer).__name__} "
                "the tokenizer that rendered this sample?"
            )
    removed = set(sample.removed) | {
        (source.category, _full_index(sample.removed, source.category, source.index)) for source in chosen
    }
    return dataclasses.replace(
        sample,
        options=dict(sample.options),
        text=text,
        input_ids=input_ids,
        prompt_length=spans["answer"][0][0],
        spans=spans,
        char_spans=char_spans,
        offsets=offsets,
        removed=tuple(sorted(removed)),
        cuts=cuts,
    )


def with_answer(sample, answer: str, tokenizer: PreTrainedTokenizerBase):
    """``sample`` with ``answer`` teacher-forced (see :meth:`probe.tasks.Sample.with_answer`)."""
    check_tokenizer(tokenizer)
    if not isinstance(answer, str) or not answer.strip():
        raise InvalidValueError(f"answer must be non-empty text, got {answer!r}")
    answer = answer.strip()
    (start, end), *_ = sample.char_spans["answer"]
    gold = sample.text[start:end]
    separator = gold[: len(gold) - len(gold.lstrip())]  # the answer separator recorded with it
    text = sample.text[:start] + separator + answer
    char_spans = dict(sample.char_spans) | {"answer": [(start, len(text))]}
    with_chat = uses_chat(tokenizer, sample.options.get("chat"))
    input_ids, offsets, spans, cuts = tokenize_with_spans(tokenizer, text, char_spans, not with_chat)
    prompt_length = spans["answer"][0][0]
    if prompt_length != sample.prompt_length or not torch.equal(input_ids[:prompt_length], sample.prompt_ids):
        raise InvalidValueError(
            f"the prompt tokenizes differently before the answer {answer[:40]!r}: is "
            f"{type(tokenizer).__name__} the tokenizer that rendered this sample?"
        )
    return dataclasses.replace(
        sample, text=text, input_ids=input_ids, answer=answer, spans=spans, char_spans=char_spans,
        offsets=offsets, cuts=cuts,
    )  # fmt: skip


def _full_index(removed: Sequence[tuple[str, int]], category: str, index: int) -> int:
    """The index in the full sample of the ``index``-th remaining entry of ``category``, given the
    entries already ``removed`` (full-sample numbering): the ``index``-th integer not among them."""
    gone = {i for cat, i in removed if cat == category}
    full = -1
    for _ in range(index + 1):
        full += 1
        while full in gone:
            full += 1
    return full
