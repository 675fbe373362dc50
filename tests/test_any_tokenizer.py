"""The span rule holds for any tokenizer: property tests over random texts and source splits.

Tokenizers: the three bundled ones (SmolLM2, Gemma 3, Qwen2.5, whose BPE merges ``.\\n\\n``), a
GPT-2-style byte-level BPE and a synthetic BPE with no pre-tokenizer whose merges cross every kind of
boundary (``.\\n\\n``, ``." ``, ``? ``, `` S``), both trained here with the ``tokenizers`` library.
Each check is computed a slow, obvious way (a loop over tokens and characters) and compared with the
sample: every span holds exactly the tokens that start inside it (the rule of
:mod:`probe.tasks.sample`), the text is tokenized as the model sees it, removing a source removes
exactly its tokens, and a compacted faithfulness pass equals key masking with an explicit mask.
"""

from __future__ import annotations

import functools
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import token_starts, tokens_starting_in
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import probe
from probe import faithfulness
from probe.faithfulness import compaction
from probe.models import converted_folder
from probe.tasks import Sample

WORDS = ("she", "said", "the", "lighthouse", "keeper", "Margaret", "Sam", "Stone", "was", "on", "rock",
         "why", "not", "startup", "founders", "ask", "it", "is", "42", "naïve", "café", "🌙")  # fmt: skip
ENDS = (".", "?", "!", '."', '?"', ".)", "…", ".'")
GAPS = (" ", "\n\n", "\n", "  ", " \n\n", "\n\n\n", "\t")
BOUNDARIES = (".\n\n", '." ', "? ", " S")


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 7))]
    opening = rng.choice(("", "", '"', "(", "S"))
    return opening + " ".join(words).capitalize() + rng.choice(ENDS)


def document(rng: random.Random, sentences: int) -> str:
    parts = [sentence(rng) for _ in range(sentences)]
    return "".join(part + rng.choice(GAPS) for part in parts[:-1]) + parts[-1]


@functools.cache
def synthetic_tokenizer(byte_level_words: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on random documents: GPT-2's pre-tokenizer (``byte_level_words``), or
    none at all, so that merges cross spaces, newlines and quotes."""
    rng = random.Random(0)
    corpus = [document(rng, 12) for _ in range(400)]
    corpus += ["end.\n\nSo", 'end." So', "end? So", "and So"] * 200  # every boundary merge, often
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=byte_level_words)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=model)


@functools.cache
def tokenizer(name: str):
    if name == "gpt2-style-bpe":
        return synthetic_tokenizer(True)
    if name == "boundary-bpe":
        return synthetic_tokenizer(False)
    return AutoTokenizer.from_pretrained(converted_folder(name))


TOKENIZERS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "gpt2-style-bpe", "boundary-bpe"]


def random_sources(rng: random.Random, context: str):
    """``"sentences"``, ``"paragraphs"`` or random (start, end) ranges cut at word boundaries."""
    choice = rng.randrange(3)
    if choice < 2:
        return ("sentences", "paragraphs")[choice]
    boundaries = [i for i in range(1, len(context)) if context[i - 1].isspace() != context[i].isspace()]
    cuts = sorted(rng.sample(boundaries, min(len(boundaries), rng.randint(1, 6))))
    ranges = [(a, b) for a, b in zip([0, *cuts], [*cuts, len(context)], strict=True)]
    return [(a, b) for a, b in ranges if context[a:b].strip()]


def random_sample(name: str, seed: int, chat: bool | None = None, answered: bool = False) -> Sample:
    """A random document cut at random into sources; a prompt-only sample (no response) one time in five
    unless ``answered``."""
    rng = random.Random(seed)
    context = document(rng, rng.randint(2, 9))
    response = None if rng.random() < 0.2 and not answered else sentence(rng)
    sources = random_sources(rng, context)
    return Sample.from_text(tokenizer(name), context, sentence(rng), response, sources, chat)


def removed_tokens(sample: Sample, removed: list[bool]) -> list[int]:
    """The slow way: every token that starts inside a removed source's characters."""
    starts = token_starts(sample.text, sample.offsets)
    sources = [s for s, gone in zip(sample.sources, removed, strict=True) if gone]
    chars = [sample.char_spans[s.category][s.index] for s in sources]
    return sorted({i for span in chars for i in tokens_starting_in(starts, span)})


def test_the_boundary_bpe_merges_across_every_kind_of_boundary():
    """Otherwise the tests below could not fail for it."""
    tok = tokenizer("boundary-bpe")
    pieces = [tok.convert_tokens_to_string([token]) for token in tok.get_vocab()]
    for boundary in BOUNDARIES:
        assert any(boundary in piece for piece in pieces), boundary
    qwen = tokenizer("qwen2.5-coder-0.5b")
    assert ".\n\n" in [qwen.decode([i]) for i in qwen("Margaret.\n\nThe").input_ids]


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_every_span_holds_exactly_the_tokens_that_start_inside_it(name, seed):
    sample = random_sample(name, seed)
    tok = tokenizer(name)
    chat = sample.options["chat"]
    fresh = tok(sample.text, add_special_tokens=not chat, return_offsets_mapping=True)
    if name != "boundary-bpe":  # ordinary tokenizers: the tokenization the model sees, in one piece
        assert sample.cuts == () and sample.input_ids.tolist() == fresh["input_ids"]
    bounds = [0, *sample.cuts, len(sample.text)]
    pieces = [
        tok(sample.text[a:b], add_special_tokens=not chat and a == 0).input_ids
        for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    assert sample.input_ids.tolist() == [i for piece in pieces for i in piece]
    whole = token_starts(sample.text, np.asarray(fresh["offset_mapping"]))
    spans = [span for spans in sample.char_spans.values() for span in spans]
    for cut in sample.cuts:  # only where a span would own no token in one piece
        assert any(start == cut and not tokens_starting_in(whole, (start, end)) for start, end in spans)
    starts = token_starts(sample.text, sample.offsets)
    for category, char_spans in sample.char_spans.items():
        for (char_start, char_end), (start, end) in zip(char_spans, sample.spans[category], strict=True):
            if category == "answer" and not sample.answer:
                assert start == end == len(sample.input_ids)
                continue
            inside = tokens_starting_in(starts, (char_start, char_end))
            assert inside == list(range(start, end)), (category, sample.text[char_start:char_end])
    labels = sample.categories
    spanned = sum(end - start for spans in sample.spans.values() for start, end in spans)
    assert spanned == sum(labels != "other")  # no token in two spans


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), data=st.data())
def test_removing_a_source_removes_exactly_its_tokens(name, seed, data):
    sample = random_sample(name, seed)
    sources = sample.sources
    removed = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(sources), max_size=len(sources))))
    expected = removed_tokens(sample, removed.tolist())
    assert compaction.removed_positions(sources, removed).tolist() == expected


@functools.cache
def tiny_for(name: str):
    return probe.tiny_model("llama", vocab_size=len(tokenizer(name)), max_position_embeddings=1024)


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31))
def test_compacted_passes_equal_key_masking_with_an_explicit_mask(name, seed):
    sample = random_sample(name, seed, chat=False, answered=True)
    model = tiny_for(name)
    n = len(sample.sources)
    removed = torch.rand(3, n, generator=torch.Generator().manual_seed(seed % 1000)) < 0.5
    compact = faithfulness.answer_scores(model, sample, removed, faithfulness.Passes(compact=True)).logprob
    rows = sample.target_positions - 1
    gold = sample.input_ids[sample.target_positions]
    for mask, value in zip(removed, compact, strict=True):
        hidden = torch.zeros(1, len(sample.input_ids), dtype=torch.bool)
        hidden[0, removed_tokens(sample, mask.tolist())] = True
        with torch.no_grad(), probe.mask_keys(model, hidden):
            logits = model(sample.input_ids[None], use_cache=False).logits[0, rows]
        expected = logits.log_softmax(-1).gather(-1, gold[:, None]).sum()
        assert abs(float(value) - float(expected)) <= 1e-4


def test_a_source_cut_inside_a_token_gets_its_own_tokens_there_and_only_there():
    tok = tokenizer("qwen2.5-coder-0.5b")
    context = "The lighthouse keeper was Margaret.\n\nShe kept it for forty years."
    sample = Sample.from_text(tok, context, "Who kept it?", "Margaret", [(0, 6), (6, 9), (9, len(context))])
    opening = sample.text.index(context)
    assert opening + 6 in sample.cuts and set(sample.cuts) <= {opening + 6, opening + 9}
    assert sample.span_text("context") == ["The li", "ght", context[9:]]
    assert all(end > start for start, end in sample.spans["context"])
    whole = Sample.from_text(tok, context, "Who kept it?", "Margaret", "paragraphs")
    assert whole.cuts == () and whole.span_text("context")[0] == "The lighthouse keeper was Margaret."
    start, end = whole.spans["context"][0]
    assert tok.decode(whole.input_ids[end - 1]) == ".\n\n"  # the sentence owns its closing token
