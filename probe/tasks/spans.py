"""Exact token spans of character ranges, for any tokenizer: the span rule, the context cut into
sources, and the chat template's wrapper.

**A token belongs to the span in which it starts**, where a token starts at its first
non-whitespace character (a whitespace-only token at its first character). So a sentence owns its
closing ``.\n\n`` or ``." `` (BPEs of the Qwen2.5 / Llama 3 kind merge them), the next sentence
owns the merged leading space of `` She``, and whitespace between units on its own belongs to none.
The text is tokenized once, as the model sees it: no token is split to fit a span, and any
tokenizer's output maps. A span's tokens may therefore cover a little text beyond its characters
(the punctuation or whitespace merged at its end); ``offsets`` says exactly which. Where a span
would own no token at all (all of it merged into a token that starts before it: a source cut inside a
word, or a BPE that merges across spaces), and only there, the text is tokenized in two pieces at that
span's start; ``Sample.cuts`` records where. No text is refused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from probe.errors import InvalidValueError

SOURCE_SPLITS = ("sentences", "paragraphs")
SENTENCE_END = re.compile(r"(?<=[.!?…])[\"')\]]*\s+(?=\S)")
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")

_SENTINEL = "\ue000LONGPROBE_CONTENT\ue000"  # private-use characters: never part of a template


def source_ranges(
    context: str, sources: str | Sequence[str] | Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Character ranges [start, end) of the sources of ``context`` (see :meth:`Sample.from_text`),
    each stripped of surrounding whitespace, in order, none empty."""
    if isinstance(sources, str):
        if sources not in SOURCE_SPLITS:
            raise InvalidValueError(
                f"sources must be one of {SOURCE_SPLITS}, a list of strings or of (start, end) spans, "
                f"got {sources!r}"
            )
        pattern = SENTENCE_END if sources == "sentences" else PARAGRAPH_BREAK
        cuts = [0, *(m.end() for m in pattern.finditer(context)), len(context)]
        ranges = list(zip(cuts, cuts[1:], strict=False))
    elif sources and all(isinstance(source, str) for source in sources):
        ranges, position = [], 0
        for source in sources:
            start = context.find(source, position)
            if start < 0:
                raise InvalidValueError(
                    f"source {source[:60]!r} does not occur in the context after position {position}"
                )
            ranges.append((start, start + len(source)))
            position = start + len(source)
    else:
        ranges = [tuple(int(x) for x in source) for source in sources]
        if not ranges or any(len(r) != 2 for r in ranges):
            raise InvalidValueError(
                "sources must be a non-empty list of strings or of (start, end) character spans"
            )
        for (start, end), (next_start, _) in zip(ranges, [*ranges[1:], (len(context), 0)], strict=True):
            if not 0 <= start < end <= next_start <= len(context):
                raise InvalidValueError(
                    f"source span {(start, end)} is empty, out of the context's {len(context)} characters, "
                    "or overlaps the next: give sorted, disjoint (start, end) ranges"
                )
    stripped = []
    for start, end in ranges:
        text = context[start:end]
        start, end = start + len(text) - len(text.lstrip()), end - len(text) + len(text.rstrip())
        if end > start:
            stripped.append((start, end))
    if not stripped:
        raise InvalidValueError("the context holds no source: every one is empty or whitespace")
    return stripped


def uses_chat(tokenizer: PreTrainedTokenizerBase, chat: bool | None = None) -> bool:
    """Whether prompts go through the chat template (default: when the tokenizer has one)."""
    return tokenizer.chat_template is not None if chat is None else chat


def chat_wrapper(tokenizer: PreTrainedTokenizerBase) -> tuple[str, str]:
    """(prefix, suffix) the chat template puts around one user message, generation prompt included."""
    render = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
    )
    if render.count(_SENTINEL) != 1:
        raise InvalidValueError("the chat template does not reproduce the user message verbatim")
    prefix, suffix = render.split(_SENTINEL)
    return prefix, suffix


def tokenize_with_spans(
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    char_spans: dict[str, list[tuple[int, int]]],
    special_tokens: bool,
) -> tuple[torch.Tensor, np.ndarray, dict[str, list[tuple[int, int]]], tuple[int, ...]]:
    """``(input_ids LongTensor[seq], offsets int64 [seq, 2], token spans per category, cuts)`` of
    ``text`` by the span rule (see the module docstring).

    The text is tokenized in one piece, as the model reads it. Only where a span would own no token
    (all of it merged into a token that starts before it: a source cut inside a word, or a BPE without
    pre-tokenizer merging across a space) is the text cut at that span's start and the pieces
    tokenized separately, the first with the tokenizer's special tokens; ``cuts`` lists those
    character positions (empty for ordinary text and every bundled tokenizer's tasks).
    """
    cuts: list[int] = []
    while True:
        bounds = [0, *cuts, len(text)]
        ids, offsets = [], []
        for piece, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
            special = special_tokens and piece == 0
            encoding = tokenizer(text[start:end], add_special_tokens=special, return_offsets_mapping=True)
            ids += encoding["input_ids"]
            offsets += [(first + start, last + start) for first, last in encoding["offset_mapping"]]
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        starts = token_starts(text, offsets)
        spans = {cat: [token_span(starts, span) for span in ranges] for cat, ranges in char_spans.items()}
        orphans = {
            span[0]
            for category, ranges in char_spans.items()
            for span, found in zip(ranges, spans[category], strict=True)
            if found is None
        }
        if not orphans:
            return torch.tensor(ids, dtype=torch.long), offsets, spans, tuple(cuts)
        if orphans <= set(cuts):
            raise InvalidValueError(
                f"spans at characters {sorted(orphans)} own no token even when tokenized apart"
            )
        cuts = sorted(set(cuts) | orphans)


def token_starts(text: str, offsets: np.ndarray) -> np.ndarray:
    """int64 [seq]: the character at which each token starts by the span rule (see the module docstring): its
    first non-whitespace character, or its first character if it has none. An added special token
    with an empty offset (``<bos>`` at (0, 0)) starts nowhere: −1, in no span."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    position = np.arange(len(text) + 1)
    visible = np.append(~np.array([c.isspace() for c in text], dtype=bool), True)
    next_visible = np.minimum.accumulate(np.where(visible, position, len(text))[::-1])[::-1]
    first_visible = next_visible[np.minimum(starts, len(text))]
    return np.where(ends <= starts, -1, np.where(first_visible < ends, first_visible, starts))


def token_span(token_starts: np.ndarray, char_span: tuple[int, int]) -> tuple[int, int] | None:
    """Tokens ``start:end`` that start inside ``char_span`` (the span rule, module docstring), or
    ``None`` if none does. ``token_starts``: :func:`token_starts` of the tokenization."""
    char_start, char_end = char_span
    inside = np.flatnonzero((token_starts >= char_start) & (token_starts < char_end))
    if len(inside) == 0:
        return None
    start, end = int(inside[0]), int(inside[-1]) + 1
    if end - start != len(inside):
        raise InvalidValueError(f"the tokens that start inside characters {char_span} are not contiguous")
    return start, end
