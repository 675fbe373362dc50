"""probe.probes.alignment against sets of characters and the tokenizers' own offsets."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import probe
from probe.models import converted_folder
from probe.probes import alignment

TEXT = "The key is 12345 ok"
#       0123456789012345678
WORDS = np.array([[0, 3], [3, 7], [7, 10], [10, 16], [16, 19]])  # "The", " key", " is", " 12345", " ok"
TRIMMED = np.array([[0, 3], [4, 7], [8, 10], [11, 14], [14, 16], [17, 19]])  # no spaces; "123", "45"
CHARS = np.array([[i, i + 1] for i in range(len(TEXT))])


def keys(source_offsets, source_values, target_offsets, skip_spaces=True):
    values = alignment.transfer_to_tokens(
        TEXT, source_offsets, np.asarray(source_values, float), target_offsets, "all", skip_spaces
    )
    return [TEXT[a:b] for (a, b), v in zip(target_offsets, values, strict=True) if v == 1]


def test_finer_evaluated_tokens_each_become_key():
    assert keys(WORDS, [0, 0, 0, 1, 0], CHARS) == [" ", "1", "2", "3", "4", "5"]


def test_coarser_evaluated_token_is_key_only_if_wholly_covered():
    assert keys(TRIMMED, [0, 0, 0, 1, 0, 0], WORDS) == []  # " 12345" is only partly key ("123")
    assert keys(TRIMMED, [0, 0, 0, 1, 1, 0], WORDS) == [" 12345"]  # the uncovered space is ignored
    assert keys(TRIMMED, [0, 0, 0, 1, 1, 0], WORDS, skip_spaces=False) == []  # official: raw containment
    assert keys(WORDS, [0, 0, 0, 1, 0], TRIMMED) == ["123", "45"]
    assert keys(WORDS, [np.nan, 1, 1, 1, 1], WORDS) == [" key", " is", " 12345", " ok"]


def test_soft_weights_are_string_level_averages():
    weights = alignment.transfer_to_tokens(TEXT, TRIMMED, np.array([1, 1, 1, 3, 1, np.nan]), WORDS, "mean")
    np.testing.assert_allclose(weights, [1, 1, 1, (3 * 3 + 1 * 2) / 5, np.nan])


def test_character_runs_merge_touching_spans():
    assert alignment.character_runs(TRIMMED, [1, 0, 0, 1, 1, 0]) == [(0, 3), (11, 16)]


class NoOffsets:
    """A tokenizer without offset mapping (like tiktoken-based ones): raises when asked for offsets."""

    def __init__(self, tokenizer, lowercase=False):
        self.tokenizer, self.lowercase = tokenizer, lowercase

    def __call__(self, text, return_offsets_mapping=False, **kwargs):
        if return_offsets_mapping:
            raise NotImplementedError("no offsets")
        return self.tokenizer(text, **kwargs)

    def decode(self, ids, **kwargs):
        text = self.tokenizer.decode(ids, **kwargs)
        return text.lower() if self.lowercase else text


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_offsets_fallback_rebuilds_the_text(name):
    tokenizer = AutoTokenizer.from_pretrained(converted_folder(name))
    text = " ".join(probe.tasks.noise.sentences()[:40]) + " Ünïcödé ✓ 12345\n\n  end"
    ids, offsets = alignment.encode(tokenizer, text)
    fallback_ids, fallback = alignment.encode(NoOffsets(tokenizer), text)
    assert torch.equal(ids, fallback_ids)
    assert "".join(text[a:b] for a, b in fallback) == text
    differ = (offsets != fallback).any(axis=1)  # only where byte tokens split a character
    assert differ.sum() <= 3 and all(not text[a:b].isascii() for a, b in offsets[differ])
    with pytest.raises(ValueError, match="cannot be mapped to characters"):
        alignment.encode(NoOffsets(tokenizer, lowercase=True), text)
