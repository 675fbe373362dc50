"""Several sequences in one pass (probe.attention.batch): each result equals running its sequence alone."""

from __future__ import annotations

import pytest
import torch
from reference import head_weights_for
from transformers import AutoTokenizer

import probe
from probe import detectors, tasks
from probe.attention.batch import batch_of, is_batch
from probe.models import converted_folder

LENGTHS = (40, 25, 33)  # longer than the tiny Gemma 3's window of 6: sliding layers are exercised
TOLERANCE = 1e-5


def _sequences():
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 128, (n,), generator=generator) for n in LENGTHS]
    targets = [[37, 39, 38], [5, 20], [32]]  # any order, any count
    return ids, targets


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max() <= TOLERANCE * max(1.0, float(b.abs().max())), (a - b).abs().max()


def _rows(model, ids, targets, **kw):
    """attention_rows of the rows predicting ``targets`` (t − 1), one list per sequence for a batch."""
    several = is_batch(ids, kw.get("attention_mask"))
    rows = [torch.as_tensor(t) - 1 for t in targets] if several else torch.as_tensor(targets) - 1
    return probe.attention_rows(model, ids, rows, **kw)


PROBES = {
    "information_flow": probe.information_flow,
    "embedding_grads": probe.embedding_grads,
    "embedding_grad_norms": probe.embedding_grad_norms,
    "attention_rows": _rows,
    "answer_attribution": lambda *args, **kw: _flatten(probe.answer_attribution(*args, **kw)),
}


def _flatten(found):
    if isinstance(found, list):
        return [_flatten(one) for one in found]
    return torch.cat([found.pattern.flatten(), found.pattern_grad.flatten(), found.embedding_grad.flatten()])


@pytest.mark.parametrize("name", PROBES)
def test_a_list_of_sequences_equals_one_by_one(tiny, name):
    ids, targets = _sequences()
    batched = PROBES[name](tiny, ids, targets)
    assert len(batched) == len(ids)
    for one, (seq, where) in zip(batched, zip(ids, targets, strict=True), strict=True):
        _close(one, PROBES[name](tiny, seq, where))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", PROBES)
def test_padded_rows_with_an_attention_mask_equal_one_by_one(tiny, name, side):
    ids, targets = _sequences()
    width = max(LENGTHS) + 2  # every row padded, the longest too
    padded = torch.full((len(ids), width), 7)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    shifted = []
    for b, (seq, where) in enumerate(zip(ids, targets, strict=True)):
        start = width - len(seq) if side == "left" else 0
        padded[b, start : start + len(seq)], mask[b, start : start + len(seq)] = seq, 1
        shifted.append([t + start for t in where])  # positions index the padded row
    batched = PROBES[name](tiny, padded, shifted, attention_mask=mask)
    for one, seq, where in zip(batched, ids, targets, strict=True):
        _close(one, PROBES[name](tiny, seq, where))


def test_checkpointed_batches_equal_plain_batches(tiny):
    ids, targets = _sequences()
    plain = probe.information_flow(tiny, ids, targets, checkpoint=False)
    for a, b in zip(plain, probe.information_flow(tiny, ids, targets, checkpoint=True), strict=True):
        assert (a - b).abs().max() <= 1e-6


def test_one_sequence_keeps_its_single_result(tiny):
    ids, targets = _sequences()
    one = probe.information_flow(tiny, ids[0], targets[0])
    assert isinstance(one, torch.Tensor) and one.shape == (probe.checks.n_layers(tiny), LENGTHS[0])
    assert isinstance(probe.information_flow(tiny, ids[0][None], targets[0]), torch.Tensor)
    (listed,) = probe.information_flow(tiny, ids[:1], targets[:1])
    _close(listed, one)


def test_bad_batches_say_what_is_wrong(tiny):
    ids, targets = _sequences()
    with pytest.raises(ValueError, match="3 sequences but 2 lists of target_positions"):
        probe.information_flow(tiny, ids, targets[:2])
    with pytest.raises(IndexError, match=r"target_positions of sequence 1 \[25\] out of range"):
        probe.information_flow(tiny, ids, [targets[0], [25], targets[2]])
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    ones = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="one contiguous run of tokens"):
        probe.information_flow(tiny, ones, [[1], [2]], attention_mask=holes)
    with pytest.raises(ValueError, match="must have the shape of input_ids"):
        probe.information_flow(tiny, ones, [[1], [2]], attention_mask=holes[:, :3])
    with pytest.raises(ValueError, match="inputs_embeds replaces the embeddings of one sequence"):
        probe.embedding_grads(tiny, ids, targets, inputs_embeds=torch.zeros(40, 32))
    assert batch_of(tiny, ids, targets).input_ids.shape == (3, max(LENGTHS))


@pytest.fixture(scope="module")
def story():
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    samples = [tasks.make("multihop-1", tokenizer, n, seed=s) for n, s in ((160, 0), (200, 1), (130, 2))]
    return probe.tiny_model("gemma3", vocab_size=len(tokenizer)), tokenizer, samples


@pytest.mark.parametrize("name", [*(n for n in detectors.names() if detectors.shared_pass(n)), "recency"])
def test_detectors_take_several_samples(story, name):
    model, tokenizer, samples = story
    options = {"weights": head_weights_for(model)} if name == "at2" else {}
    batched = probe.detect(name, model, tokenizer, samples, **options)
    for detection, sample in zip(batched, samples, strict=True):
        alone = probe.detect(name, model, tokenizer, sample, **options)
        _close(detection.scores, alone.scores)
        assert detection.name == name and detection.settings == alone.settings
        assert torch.equal(detection.flagged, alone.flagged)


def test_detect_many_batches_the_shared_pass(story, monkeypatch):
    model, tokenizer, samples = story
    passes = []
    real = detectors.registry.answer_attribution
    for module in (detectors.registry,):  # the one shared pass, alone or in detect_many
        monkeypatch.setattr(module, "answer_attribution", lambda *a, **k: passes.append(1) or real(*a, **k))
    names = ["attention", "information_flow", "embedding_grad", "recency"]
    found = detectors.detect_many(names, model, tokenizer, samples)
    assert passes == [1] and [list(one) for one in found] == [names] * len(samples)
    for one, sample in zip(found, samples, strict=True):
        alone = detectors.detect_many(names, model, tokenizer, sample)
        for name in names:
            _close(one[name].scores, alone[name].scores)
