"""Bad inputs get errors that say what is wrong and what to do (issue 14's list of raw errors)."""

from __future__ import annotations

import json

import pytest
import torch

import probe
from probe.probes.lsd import KeyTokens, LongPPLResult


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


def test_floats_and_booleans_are_not_positions(tiny):
    """Integers only: a float tensor (even 3.0) or a boolean one (True would act as position 1)."""
    with pytest.raises(TypeError, match="must be integers, got torch.float32 values"):
        probe.attention_rows(tiny, torch.arange(20), torch.tensor([3.0, 7.0]))
    with pytest.raises(TypeError, match="boolean tensor: pass mask.nonzero"):
        probe.information_flow(tiny, torch.arange(20), torch.arange(20) == 19)
    with pytest.raises(TypeError, match="must be integers, got booleans"):
        probe.information_flow(tiny, torch.arange(20), [5], layers=[True])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: probe.mask_keys(m, [2.5]), "key positions must be integers"),
        (
            lambda m: probe.mask_keys(m, torch.tensor([True, False])),
            r"boolean key mask must be \[batch, seq\]",
        ),
        (lambda m: probe.trace(m, rows=[2.5]), "rows must be integers"),
        (lambda m: probe.trace(m, rows=torch.tensor([True])), "rows must be integer positions"),
        (lambda m: probe.ablate_heads(m, [(0, 1.5)]), "head of a .layer, head. pair must be an integer"),
        (lambda m: probe.ablate_heads(m, [(True, 0)]), "layer of a .layer, head. pair must be an integer"),
        (lambda m: probe.attention_window(m, 2.5), "window must be an integer"),
        (lambda m: probe.attention_window(m, True), "window must be an integer, got True"),
        (lambda m: probe.attention_window(m, 0), "window must be at least 1"),
    ],
)
def test_modifiers_refuse_what_they_used_to_truncate(tiny, call, message):
    with pytest.raises((TypeError, ValueError), match=message), call(tiny):
        tiny(torch.arange(20)[None])


def test_keys_beyond_the_input_and_bare_layer_numbers_are_refused(tiny):
    with (
        pytest.raises(IndexError, match=r"hides positions \[50\] beyond the 20 tokens"),
        probe.mask_keys(tiny, [3, 50]),
    ):
        tiny(torch.arange(20)[None])
    with pytest.raises(TypeError, match=r"layers must be a list or tensor of integers, got 1: pass \[1\]"):
        probe.attention_rows(tiny, torch.arange(20), [3], layers=1)
    with pytest.raises(TypeError, match="got '1'"):
        probe.attention_rows(tiny, torch.arange(20), [3], layers="1")


def test_a_flat_list_of_rows_for_a_batch_is_refused(tiny):
    """Two sequences and rows [3, 4] used to mean row 3 of the first and row 4 of the second."""
    with pytest.raises(TypeError, match=r"one list of positions per sequence \(\[\[\.\.\.\], \[\.\.\.\]\]\)"):
        probe.attention_rows(tiny, torch.arange(40).reshape(2, 20), [3, 4])


def test_unknown_detectors_nan_scores_and_another_samples_detection_are_refused(tiny):
    from test_detectors import hand_sample
    from transformers import AutoTokenizer

    from probe import detectors, metrics, tasks
    from probe.detectors import Detection
    from probe.models import converted_folder

    with pytest.raises(ValueError, match="unknown detector 'nope'; registered detectors: attention"):
        detectors.options("nope")
    sample = hand_sample()
    scores = torch.rand(len(sample.input_ids))
    scores[3] = float("nan")
    with pytest.raises(ValueError, match=r"'mine' has NaN scores at context positions \[3\]"):
        metrics.plausibility(Detection(scores, scores > 0.5, {}, name="mine"), sample)
    short = torch.rand(5)
    with pytest.raises(ValueError, match="5 token scores but the sample has 48 tokens: .* another sample"):
        metrics.plausibility(Detection(short, short > 0.5, {}, name="mine"), sample)
    with pytest.raises(ValueError, match="top_k must be at least 1, got 0"):
        metrics.plausibility(Detection(scores.nan_to_num(), scores > 0.5, {}, name="mine"), sample, top_k=0)
    with pytest.raises(ValueError, match="digits must be at least 1, got 0"):
        tasks.make(
            "passkey", AutoTokenizer.from_pretrained(converted_folder("smollm2-135m")), 256, seed=0, digits=0
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


def test_a_sample_refuses_another_tokenizer_or_a_model_of_another_vocabulary():
    """A SmolLM2 sample (49,152 ids) fits inside Gemma 3's vocabulary (262,144): without its
    tokenizer's fingerprint it would run on Gemma as other words, without an error."""
    from transformers import AutoTokenizer

    from probe import detectors, faithfulness, tasks
    from probe.models import converted_folder
    from probe.tasks import Sample

    smollm2, gemma = (
        AutoTokenizer.from_pretrained(converted_folder(n)) for n in ("smollm2-135m", "gemma3-270m")
    )
    sample = tasks.make("multihop-1", smollm2, 160, seed=0)
    assert sample.tokenizer["vocab_size"] == len(smollm2)
    assert Sample.from_dict(json.loads(json.dumps(sample.to_dict()))).tokenizer == sample.tokenizer
    wide = probe.tiny_model("llama", vocab_size=len(gemma))
    with pytest.raises(ValueError, match=r"smollm2-135m \(49152 tokens\), but the model has 262"):
        detectors.detect("attention", wide, smollm2, sample)
    with pytest.raises(
        ValueError, match="not by the tokenizer given .*: make the sample with this model's own"
    ):
        detectors.detect("recency", probe.tiny_model("llama", vocab_size=len(smollm2)), gemma, sample)
    with pytest.raises(ValueError, match="but the model has 262"):
        faithfulness.answer_scores(wide, sample, torch.zeros(1, len(sample.sources), dtype=torch.bool))


def test_a_missing_cache_entry_and_a_zero_block_size_say_what_to_do(tiny):
    with probe.trace(tiny, rows=[3], layers=[0]) as cache:
        tiny(torch.arange(20)[None])
    with pytest.raises(KeyError, match="hook_pattern was not captured; the cache holds: blocks.0"):
        cache["pattern", 1]
    with pytest.raises(KeyError, match=r"need trace\(\.\.\., grad=True\)"):
        cache["pattern_grad", 0]
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        with probe.trace(tiny, block_size=0):
            pass


def test_a_foil_as_text_or_outside_the_vocabulary_and_a_one_mask_ceiling_are_refused_before_model_work(tiny):
    """Three inputs that once ended in another library's error: a Contrast foil given as text (torch's
    "new(): invalid data type 'str'"), a foil of token ids beyond the model's vocabulary (torch's index
    error, after the forward pass) and ``ceiling_masks=1`` (scikit-learn's "not enough values to
    unpack"). Each raises longprobe's own error, before any forward pass."""
    from test_detectors import hand_sample

    from probe import faithfulness
    from probe.errors import InvalidTypeError, InvalidValueError, OutOfRangeError
    from probe.target import Contrast

    for foil in (" Paris", b"Paris", [1.5, 2.0], [True], [], [[1, 2], [3, 4]]):
        with pytest.raises(InvalidTypeError, match="foil is token ids"):
            Contrast(foil)
    with pytest.raises(InvalidValueError, match="negative token ids"):
        Contrast([-1, 2])
    sample = hand_sample()
    k = len(sample.target_positions)
    vocab = tiny.get_output_embeddings().weight.shape[0]
    beyond = Contrast([vocab + 5] * k)
    flat = {"flat": torch.ones(len(sample.sources))}

    def forward(*args, **kwargs):
        raise AssertionError("the model ran")

    tiny.forward = forward
    with pytest.raises(OutOfRangeError, match=f"outside the model's vocabulary of {vocab} tokens"):
        probe.detect("embedding_grad", tiny, None, sample, target=beyond)
    with pytest.raises(OutOfRangeError, match="outside the model's vocabulary"):
        faithfulness.evaluate(tiny, sample, flat, how=faithfulness.Passes(target=beyond))
    with pytest.raises(InvalidValueError, match="ceiling_masks=1 leaves"):
        faithfulness.evaluate(tiny, sample, flat, faithfulness.Judgement(ceiling_masks=1))
