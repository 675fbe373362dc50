"""Property tests of probe.tasks on the real tokenizers (no model forward passes)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types

import numpy as np
import pytest
import torch
from reference import token_starts, tokens_starting_in
from transformers import AutoTokenizer

import probe
from probe import tasks
from probe.models import converted_folder
from probe.tasks import words
from probe.tasks.document import PEOPLE

TOKENIZERS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
LENGTH = 1024
DEPTH = 0.3


@functools.cache
def tokenizer(name: str):
    return AutoTokenizer.from_pretrained(converted_folder(name))


@functools.cache
def sample(task: str, name: str, seed: int = 0, depth=DEPTH, length: int = LENGTH, **options) -> tasks.Sample:
    return tasks.make(task, tokenizer(name), length, seed=seed, depth=depth, **options)


# key-token: tests/test_key_token.py; hotpotqa (real questions, no planted facts): tests/test_hotpotqa.py
PLANTED = [task for task in tasks.names() if task not in ("key-token", "hotpotqa")]
CASES = (
    [(task, name, ()) for task in PLANTED for name in TOKENIZERS]
    + [("lines", name, (("lines", 5),)) for name in TOKENIZERS]
    + [("niah", "gemma3-270m", (("distractors", 3),)), ("passkey", "smollm2-135m", (("chat", False),))]
)


@pytest.fixture(params=CASES, ids=lambda c: "-".join([c[0], c[1]] + [f"{k}={v}" for k, v in c[2]]))
def case(request) -> tuple[tasks.Sample, object]:
    task, name, options = request.param
    return sample(task, name, **dict(options)), tokenizer(name)


def test_spans_hold_the_tokens_that_start_inside_them(case):
    """The span rule (:mod:`probe.tasks.sample`), checked token by token; each span's tokens decode to
    its recorded text, give or take the whitespace and punctuation merged at its edges."""
    sample, tok = case
    starts = token_starts(sample.text, sample.offsets)
    for category, token_spans in sample.spans.items():
        char_spans = sample.char_spans[category]
        for (start, end), (char_start, char_end) in zip(token_spans, char_spans, strict=True):
            assert tokens_starting_in(starts, (char_start, char_end)) == list(range(start, end)), category
            decoded = tok.decode(sample.input_ids[start:end], clean_up_tokenization_spaces=False)
            assert sample.text[char_start:char_end].strip() in decoded, category


def test_spans_cover_the_facts_and_do_not_overlap(case):
    sample, _ = case
    assert len(sample.spans["supporting"]) >= 1
    assert len(sample.spans["question"]) == len(sample.spans["answer"]) == 1
    assert any(sample.answer in text for text in sample.span_text("supporting"))
    assert sample.span_text("answer")[0].strip() == sample.answer
    everything = sorted(span for spans in sample.spans.values() for span in spans)
    assert all(start < end for start, end in everything)
    assert all(end <= start for (_, end), (start, _) in zip(everything, everything[1:], strict=False))
    assert everything[-1][1] == len(sample.input_ids)  # the answer closes the sequence


def test_length_and_depth(case):
    """Prompt length within 5% of the target; a fraction DEPTH of the filler precedes the facts."""
    sample, _ = case
    assert abs(len(sample.prompt_ids) - LENGTH) <= 0.05 * LENGTH
    filler = "noise" if sample.spans["noise"] else "interference"
    sizes = [end - start for start, end in sample.spans[filler]]
    first_fact = sample.spans["supporting"][0][0]
    before = sum(end - start for start, end in sample.spans[filler] if end <= first_fact)
    assert abs(before / sum(sizes) - DEPTH) <= max(sizes) / sum(sizes)  # within one filler unit


def test_prompt_ids_are_the_tokenized_prompt(case):
    sample, tok = case
    chat = sample.options.get("chat", tok.chat_template is not None)
    encoded = tok(sample.prompt_text, add_special_tokens=not chat)["input_ids"]
    assert encoded == sample.prompt_ids.tolist()
    assert sample.input_ids.dtype.is_floating_point is False and sample.input_ids.dim() == 1


def test_same_seed_same_sample_other_seed_other_sample(case):
    sample, tok = case
    settings = dict(depth=sample.depth, **sample.options)
    again = tasks.make(sample.task, tok, sample.length, seed=sample.seed, **settings)
    assert again.text == sample.text and again.spans == sample.spans
    assert again.input_ids.equal(sample.input_ids)
    other = tasks.make(sample.task, tok, sample.length, seed=sample.seed + 1, **settings)
    assert other.text != sample.text


def test_score_accepts_gold_and_rejects_wrong(case):
    sample, _ = case
    assert sample.score(sample.span_text("answer")[0]) == 1.0
    assert sample.score(f" {sample.answer.upper()}. That is all.") == 1.0
    text = sample.prompt_text + " 12345 garden cellar"
    candidates = re.finditer(sample.answer_pattern, text, re.IGNORECASE)
    wrong = next(m.group(0) for m in candidates if m.group(0).lower() != sample.answer.lower())
    assert sample.score(f" {wrong}") == 0.0
    assert sample.score(f" {wrong}, or maybe {sample.answer}") == 0.0  # the first candidate counts
    assert sample.score("") == 0.0


def test_to_dict_is_json(case):
    sample, _ = case
    record = json.loads(json.dumps(sample.to_dict()))
    assert record["input_ids"] == sample.input_ids.tolist()
    assert record["task"] == sample.task and record["options"] == sample.options
    assert record["offsets"] == sample.offsets.tolist()


@pytest.mark.parametrize("depth", [DEPTH, (0.1, 0.5, 0.9)])
def test_from_dict_round_trips_through_json(depth):
    sample_ = sample("multihop-3", "smollm2-135m", depth=depth)
    restored = tasks.Sample.from_dict(json.loads(json.dumps(sample_.to_dict())))
    assert restored.to_dict() == sample_.to_dict() and restored.depth == sample_.depth
    assert restored.input_ids.dtype == torch.long and torch.equal(restored.input_ids, sample_.input_ids)
    assert restored.offsets.dtype == np.int64 and np.array_equal(restored.offsets, sample_.offsets)
    assert restored.spans == sample_.spans and restored.char_spans == sample_.char_spans
    assert restored.sources == sample_.sources
    assert torch.equal(restored.target_positions, sample_.target_positions)


def test_offsets_are_the_tokenizers_offset_mapping(case):
    """Kept from rendering: the same as a fresh tokenization of the text, chat (no special tokens added)
    or completion (``<bos>`` added, at (0, 0))."""
    sample, tok = case
    chat = sample.options.get("chat", tok.chat_template is not None)
    fresh = tok(sample.text, add_special_tokens=not chat, return_offsets_mapping=True)
    assert fresh["input_ids"] == sample.input_ids.tolist()
    assert sample.offsets.dtype == np.int64 and sample.offsets.shape == (len(sample.input_ids), 2)
    assert sample.offsets.tolist() == [list(span) for span in fresh["offset_mapping"]]


def test_target_positions_are_the_answer_tokens(case):
    sample, tok = case
    positions = sample.target_positions
    assert positions.dtype == torch.long
    assert positions.tolist() == list(range(sample.prompt_length, len(sample.input_ids)))
    assert tok.decode(sample.input_ids[positions]).strip() == sample.answer


def test_categories_label_every_token_once(case):
    sample, _ = case
    labels = sample.categories
    assert labels.shape == (len(sample.input_ids),)
    for category, token_spans in sample.spans.items():
        assert all((labels[start:end] == category).all() for start, end in token_spans)
    spanned = sum(end - start for token_spans in sample.spans.values() for start, end in token_spans)
    assert (labels == "other").sum() == len(labels) - spanned > 0  # template, instruction, separators


def test_sources_are_the_context_spans_in_text_order(case):
    """One source per fact / needle / line / emoji / essay sentence; never the question or the answer."""
    sample, _ = case
    sources = sample.sources
    assert {source.category for source in sources} <= set(tasks.CONTEXT_CATEGORIES)
    assert {source.category for source in sources} >= {"supporting"}
    for category in tasks.CONTEXT_CATEGORIES:
        mine = [source for source in sources if source.category == category]
        assert [(source.start, source.end) for source in mine] == list(sample.spans[category])
        assert [source.index for source in mine] == list(range(len(mine)))
    assert all(a.end <= b.start for a, b in zip(sources, sources[1:], strict=False))  # text order, disjoint
    (question_start, _), (answer_start, _) = sample.spans["question"][0], sample.spans["answer"][0]
    assert sources[-1].end <= question_start < answer_start
    with pytest.raises(dataclasses.FrozenInstanceError):
        sources[0].start = 0


def test_chat_template_for_instruct_completion_prompt_for_base():
    smol, gemma = sample("passkey", "smollm2-135m"), sample("passkey", "gemma3-270m")
    assert smol.text.startswith("<|im_start|>") and "<|im_start|>assistant\nThe pass key is " in smol.text
    assert gemma.input_ids[0] == tokenizer("gemma3-270m").bos_token_id
    assert gemma.prompt_text.endswith("\nAnswer: The pass key is")


@pytest.mark.parametrize("task", ["passkey", "multihop-2", "kv"])
@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_extreme_depths(task, depth):
    sample_ = sample(task, "gemma3-270m", depth=depth)
    filler = "noise" if sample_.spans["noise"] else "interference"
    first_fact, last_fact = sample_.spans["supporting"][0][0], sample_.spans["supporting"][-1][1]
    if depth == 0.0:
        assert first_fact < sample_.spans[filler][0][0]
    else:
        assert last_fact > sample_.spans[filler][-1][1]


def test_one_depth_per_fact_keeps_the_story_in_order():
    sample_ = sample("multihop-3", "smollm2-135m", depth=(0.1, 0.5, 0.9))
    noise = sample_.spans["noise"]
    total = sum(e - s for s, e in noise)
    for (start, _), depth in zip(sample_.spans["supporting"], (0.1, 0.5, 0.9), strict=True):
        assert abs(sum(e - s for s, e in noise if e <= start) / total - depth) < 0.05


@pytest.mark.parametrize("hops", [1, 2, 3, 4])
def test_interference_facts_leave_the_answer_unchanged(hops):
    """Interference is about other characters and objects, one of them after the last supporting fact."""
    sample_ = sample(f"multihop-{hops}", "smollm2-135m", seed=3, depth=None)
    supporting, interference = sample_.span_text("supporting"), sample_.span_text("interference")
    hero = supporting[0].split()[0]
    thing = [w.strip(".") for w in " ".join(supporting).split() if w.strip(".") in words.OBJECTS]
    assert len(supporting) <= len(interference) <= 2 * len(supporting)
    assert not any(set(fact.rstrip(".").split()) & {hero, *thing} for fact in interference)
    assert sample_.spans["interference"][-1][0] > sample_.spans["supporting"][-1][0]
    assert len(sample_.spans["low_frequency"]) == 3


def test_bad_input_raises_clear_errors():
    tok = tokenizer("smollm2-135m")
    with pytest.raises(ValueError, match="valid tasks: multihop-1"):
        tasks.make("no-such-task", tok, 512)
    with pytest.raises(ValueError, match=r"depth must lie in \[0, 1\]"):
        tasks.make("passkey", tok, 512, depth=1.5)
    with pytest.raises(ValueError, match="must not decrease"):
        tasks.make("multihop-2", tok, 512, depth=(0.8, 0.2))
    with pytest.raises(ValueError, match="too short"):
        tasks.make("multihop-4", tok, 64)
    with pytest.raises(ValueError, match="beyond what the filler text can fill"):
        tasks.make("passkey", tok, 400_000)
    with pytest.raises(TypeError, match="Hugging Face tokenizer"):
        tasks.make("passkey", types.SimpleNamespace(is_fast=False, chat_template=None), 512)
    with pytest.raises(TypeError, match="unexpected keyword"):
        tasks.make("passkey", tok, 512, colour="red")


def test_names_lists_every_task():
    assert set(tasks.names()) == {
        "multihop-1",
        "multihop-2",
        "multihop-3",
        "multihop-4",
        "lines",
        "passkey",
        "niah",
        "multivalue-niah",
        "kv",
        "document-1",
        "document-2",
        "document-3",
        "key-token",
        "hotpotqa",
    }


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("length", [512, 4096])
@pytest.mark.parametrize("task", PLANTED)
def test_every_task_builds_for_every_bundled_tokenizer_from_512_to_4k(task, name, length):
    sample_ = sample(task, name, length=length)
    assert abs(sample_.prompt_length - length) <= 0.05 * length
    starts = token_starts(sample_.text, sample_.offsets)
    for source in sample_.sources:
        chars = sample_.char_spans[source.category][source.index]
        assert tokens_starting_in(starts, chars) == list(range(source.start, source.end))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_sample_at_the_models_full_context_keeps_its_answer_within_it(name):
    """At ``length`` = the model's context, a prompt of about ``length`` tokens leaves the answer past
    the context on many seeds: with ``model=`` the prompt comes out shorter, the whole sample fits, and a
    sample that fitted already is unchanged."""
    context, tok = 512, tokenizer(name)
    model = probe.tiny_model("llama", vocab_size=len(tok), max_position_embeddings=context)
    overflowed = 0
    for task in tasks.HELD_OUT_TASKS:
        if task == "key-token":  # scored by the model: tests/test_key_token.py
            continue
        for seed in range(4):
            free, fitted = (
                tasks.make(task, tok, context, seed),
                tasks.make(task, tok, context, seed, model=model),
            )
            assert 0.85 * context <= len(fitted.input_ids) <= context, (task, seed)  # a unit shorter or so
            assert fitted.length == context and fitted.target_positions[-1] < context
            if len(free.input_ids) <= context:
                assert fitted.input_ids.equal(free.input_ids) and fitted.text == free.text, (task, seed)
            else:
                overflowed += 1
                assert fitted.answer == free.answer
                assert fitted.span_text("supporting") == free.span_text("supporting")
            assert fitted.input_ids.equal(tasks.make(task, tok, context, seed, model=model).input_ids)
    assert overflowed  # the case this test is for occurred
    with pytest.raises(ValueError, match="longer than the model's context of 512 tokens"):
        tasks.make("kv", tok, context + 1, model=model)


@pytest.mark.parametrize("hops", [1, 2, 3])
def test_document_chains_need_every_link_and_distractors_share_the_question(hops):
    """Links after the first share no word with the question; some distractor shares its landmark."""
    sample_ = sample(f"document-{hops}", "qwen2.5-coder-0.5b", seed=2, depth=None)
    chain, distractors = sample_.span_text("supporting"), sample_.span_text("interference")
    question = sample_.span_text("question")[0]

    def words_of(text: str) -> set[str]:
        return set(re.findall(r"\w+", text.lower()))

    assert len(chain) == hops and sample_.answer in chain[-1] and sample_.answer not in question
    assert all(not words_of(link) & words_of(question) for link in chain[1:])
    landmark = question.removeprefix("Who keeps the ").rstrip("?")
    assert landmark in chain[0] and any(landmark in text for text in distractors)
    assert sample_.answer in PEOPLE and not any(sample_.answer in text for text in distractors)
    assert sample_.spans["interference"][-1][0] > sample_.spans["supporting"][-1][0]


def test_easy_lines_setting_scatters_few_lines_in_noise():
    sample_ = sample("lines", "gemma3-270m", lines=5)
    assert len(sample_.spans["supporting"]) == 1 and len(sample_.spans["interference"]) == 4
    assert len(sample_.spans["noise"]) > 10
