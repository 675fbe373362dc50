"""Bad inputs get errors that say what is wrong and what to do (issue 14's list of raw errors)."""

from __future__ import annotations

import json

import pytest
import torch

import probe
from probe.lsd import KeyTokens, LongPPLResult


def test_token_ids_outside_the_vocabulary_name_the_tokenizer_mismatch(tiny):
    with pytest.raises(IndexError, match=r"token ids \[128, 200\] are outside .* vocabulary of 128 ids"):
        probe.information_flow(tiny, torch.tensor([1, 2, 128, 200, 5]), [4])
    with pytest.raises(IndexError, match="tokenizer probably does not belong to this model"):
        probe.attention_rows(tiny, [[1, 2, 3], [4, -1, 6]], [[2], [2]])


def test_an_empty_layer_list_is_refused(tiny):
    with pytest.raises(ValueError, match="layers is empty: pass None for all layers"):
        probe.information_flow(tiny, torch.arange(20), [5], layers=[])
    with pytest.raises(ValueError, match="layers is empty"):
        probe.attention_rows(tiny, torch.arange(20), [5], layers=[])


@pytest.mark.parametrize(
    "call",
    [
        lambda m: probe.attention_rows(m, torch.arange(20), [3.5]),
        lambda m: probe.information_flow(m, torch.arange(20), torch.tensor([4.25])),
        lambda m: probe.information_flow(m, torch.arange(20), [5], layers=[0.5]),
        lambda m: probe.embedding_grads(m, [torch.arange(20), torch.arange(9)], [[5], [6.5]]),
        lambda m: probe.information_flow(m, [0.5, 1.0, 2.0], [2]),
    ],
)
def test_fractional_positions_layers_or_ids_are_refused_not_truncated(tiny, call):
    with pytest.raises(TypeError, match="must be integers, got"):
        call(tiny)


def test_whole_floats_still_count_as_positions(tiny):
    assert torch.equal(
        probe.attention_rows(tiny, torch.arange(20), torch.tensor([3.0, 7.0])),
        probe.attention_rows(tiny, torch.arange(20), [3, 7]),
    )


@pytest.mark.parametrize(
    "load,name",
    [
        (probe.Detection.load, "Detection"),
        (probe.RetrievalScores.load, "RetrievalScores"),
        (KeyTokens.load, "KeyTokens"),
        (LongPPLResult.load, "LongPPLResult"),
    ],
)
def test_files_that_are_not_ours_say_what_was_expected(tmp_path, load, name):
    text, other, listed = tmp_path / "notes.txt", tmp_path / "other.json", tmp_path / "list.json"
    text.write_text("not json at all")
    other.write_text(json.dumps({"model": "x", "rows": [1, 2]}))
    listed.write_text("[1, 2, 3]")
    for path in (text, other, listed):
        with pytest.raises(ValueError, match=rf"is not a {name} file: .*expected .*{name}"):
            load(path)
