"""Sample.without, the text-level ablation, on the real tokenizers: SmolLM2 (chat template) and
Gemma 3 (completion prompt). No model forward passes."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from reference import token_starts, tokens_starting_in
from transformers import AutoTokenizer

from probe import tasks
from probe.models import converted_folder
from probe.tasks import Sample, Source

TOKENIZERS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
TASKS = ["multihop-2", "kv", "lines", "niah"]


@functools.cache
def tokenizer(name: str):
    return AutoTokenizer.from_pretrained(converted_folder(name))


@functools.cache
def sample(task: str, name: str, **options) -> Sample:
    return tasks.make(task, tokenizer(name), 1024, seed=3, **options)


def selections(full: Sample) -> dict[str, list[Source]]:
    """Removals that cover every cut rule: first, middle, last, runs at both ends, the facts, all."""
    sources = full.sources
    supporting = [s for s in sources if s.category == "supporting"]
    return {
        "first": sources[:1],
        "last": sources[-1:],
        "middle_run": sources[3:6],
        "both_ends": sources[:2] + sources[-3:],
        "supporting": supporting,
        "every_other": sources[::2],
        "all_but_one": sources[:-1] if len(sources) % 2 else sources[1:],
        "all": sources,
    }


CASES = [(task, name) for task in TASKS for name in TOKENIZERS] + [("multihop-1", "smollm2-135m")]
SELECTIONS = list(selections(sample("multihop-1", "smollm2-135m")))


def assert_spans_decode_to_text(derived: Sample, tok) -> None:
    """Every span (all categories) holds the tokens that start inside it (the span rule), which decode
    to its text, give or take the whitespace and punctuation merged at its edges."""
    starts = token_starts(derived.text, derived.offsets)
    for category, token_spans in derived.spans.items():
        char_spans = derived.char_spans[category]
        for (start, end), (char_start, char_end) in zip(token_spans, char_spans, strict=True):
            assert tokens_starting_in(starts, (char_start, char_end)) == list(range(start, end)), category
            decoded = tok.decode(derived.input_ids[start:end], clean_up_tokenization_spaces=False)
            assert derived.text[char_start:char_end].strip() in decoded, category


@pytest.mark.parametrize("which", SELECTIONS)
@pytest.mark.parametrize("task, name", CASES, ids=lambda value: value)
def test_without_removes_exactly_the_sources(task, name, which):
    full, tok = sample(task, name), tokenizer(name)
    chosen = selections(full)[which]
    derived = full.without(chosen, tok)

    # one tokenization of the new text, spans exact
    encoding = tok(derived.text, add_special_tokens=tok.chat_template is None, return_offsets_mapping=True)
    assert derived.input_ids.tolist() == encoding["input_ids"]
    assert derived.offsets.tolist() == [list(o) for o in encoding["offset_mapping"]]
    assert_spans_decode_to_text(derived, tok)

    # the kept sources are the full sample's others, in order, text unchanged
    full_texts = [full.text[slice(*full.char_spans[s.category][s.index])] for s in full.sources]
    gone = [s in chosen for s in full.sources]
    kept_texts = [derived.text[slice(*derived.char_spans[s.category][s.index])] for s in derived.sources]
    assert kept_texts == [t for t, g in zip(full_texts, gone, strict=True) if not g]
    for text, flag in zip(full_texts, gone, strict=True):
        if flag and full.text.count(text) == 1:  # a unique removed text is gone from the new one
            assert text not in derived.text

    # the text is what render makes of the body without them: the kept sources, one separator apart
    chars = [full.char_spans[s.category][s.index] for s in full.sources]
    body_start, body_end = chars[0][0], chars[-1][1]
    assert derived.text == full.text[:body_start] + _separator(full).join(kept_texts) + full.text[body_end:]

    # question and answer intact, the answer last, prompt_length at its start
    for category in ("question", "answer"):
        assert derived.span_text(category) == full.span_text(category)
        (a, b), (c, d) = full.spans[category][0], derived.spans[category][0]
        assert torch.equal(full.input_ids[a:b], derived.input_ids[c:d])
    assert derived.prompt_length == derived.spans["answer"][0][0]
    assert derived.spans["answer"][0][1] == len(derived.input_ids)
    assert derived.prompt_text == derived.text[: derived.char_spans["answer"][0][0]]
    assert len(derived.input_ids) < len(full.input_ids) or not chosen

    # the removal is recorded in the full sample's numbering; the settings stay
    assert derived.removed == tuple(sorted((s.category, s.index) for s in set(chosen)))
    assert (derived.task, derived.length, derived.seed, derived.options) == (
        full.task,
        full.length,
        full.seed,
        full.options,
    )
    assert len(derived.sources) == len(full.sources) - len(set(chosen))


def _separator(full: Sample) -> str:
    """The one string that joins consecutive sources of ``full``."""
    chars = [full.char_spans[s.category][s.index] for s in full.sources]
    (separator,) = {full.text[end:start] for (_, end), (start, _) in zip(chars, chars[1:], strict=False)}
    return separator


@pytest.mark.parametrize("task, name", CASES, ids=lambda value: value)
def test_removing_nothing_returns_an_equal_sample(task, name):
    full = sample(task, name)
    same = full.without([], tokenizer(name))
    assert same.to_dict() == full.to_dict()
    assert same is not full and same.removed == ()


def test_completion_prompt_keeps_bos_and_chat_option_is_respected():
    """Gemma (no chat template) adds <bos>; SmolLM2 forced to a completion prompt adds none but keeps
    the prompt it was rendered with."""
    gemma = sample("multihop-1", "gemma3-270m")
    derived = gemma.without(gemma.sources[:3], tokenizer("gemma3-270m"))
    assert derived.input_ids[0] == tokenizer("gemma3-270m").bos_token_id == gemma.input_ids[0]
    completion = sample("passkey", "smollm2-135m", chat=False)
    derived = completion.without(completion.sources[:3], tokenizer("smollm2-135m"))
    assert "<|im_start|>" not in derived.text and derived.text.endswith(completion.text[-40:])
    assert_spans_decode_to_text(derived, tokenizer("smollm2-135m"))


def test_without_composes_in_the_full_numbering():
    full, tok = sample("multihop-2", "smollm2-135m"), tokenizer("smollm2-135m")
    sources = full.sources
    once = full.without([sources[1], sources[4], sources[2]], tok)
    twice = once.without([once.sources[1], once.sources[3]], tok)  # full sources 3 and 6
    direct = full.without([sources[i] for i in (1, 2, 3, 4, 6)], tok)
    assert twice.to_dict() == direct.to_dict()


def test_repeats_count_once_and_order_does_not_matter():
    full, tok = sample("kv", "gemma3-270m"), tokenizer("gemma3-270m")
    sources = full.sources
    a = full.without([sources[5], sources[0], sources[5]], tok)
    b = full.without([sources[0], sources[5]], tok)
    assert a.to_dict() == b.to_dict()


def test_refuses_question_answer_foreign_sources_and_another_tokenizer():
    full, tok = sample("multihop-1", "smollm2-135m"), tokenizer("smollm2-135m")
    for category in ("question", "answer"):
        start, end = full.spans[category][0]
        with pytest.raises(ValueError, match=f"the {category} is never removed"):
            full.without([Source(category, 0, start, end)], tok)
    other = sample("multihop-1", "gemma3-270m")
    foreign = next(s for s in other.sources if s not in full.sources)
    with pytest.raises(ValueError, match="not one of this sample's sources"):
        full.without([foreign], tok)
    with pytest.raises(ValueError):  # the Gemma tokenizer either misaligns a span or changes the answer
        full.without(full.sources[:1], tokenizer("gemma3-270m"))


def test_refuses_untracked_text_between_sources():
    full, tok = sample("multihop-1", "smollm2-135m"), tokenizer("smollm2-135m")
    (_, a_end), (b_start, _) = (full.char_spans[s.category][s.index] for s in full.sources[:2])
    text = full.text[:a_end] + " and then" + full.text[b_start:]
    shift = len(" and then")
    moved = {
        category: [(s + shift, e + shift) if s >= b_start else (s, e) for s, e in spans]
        for category, spans in full.char_spans.items()
    }
    broken = Sample(**(vars(full) | {"text": text, "char_spans": moved}))
    with pytest.raises(ValueError, match="not joined by one separator"):
        broken.without(full.sources[:1], tok)


def test_removed_round_trips_through_json():
    full, tok = sample("niah", "gemma3-270m"), tokenizer("gemma3-270m")
    derived = full.without(full.sources[2:5], tok)
    restored = Sample.from_dict(json.loads(json.dumps(derived.to_dict())))
    assert restored.to_dict() == derived.to_dict() and restored.removed == derived.removed
    assert np.array_equal(restored.offsets, derived.offsets)
