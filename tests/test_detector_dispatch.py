"""How a detector's name travels: looked up once per call (:func:`probe.detectors.registry.resolve`), then
the :class:`~probe.detectors.registry.Registered` it gives is used; what the registry declares of a
detector (its shared pass, its options, whether it takes the ranking of others) steers the dispatch."""

from __future__ import annotations

import collections

import pytest
import torch

import probe
from probe import detectors
from probe.detectors import registry
from probe.probes.attribution import answer_attribution


@pytest.fixture
def resolved(monkeypatch) -> collections.Counter:
    """How often each name is looked up (:func:`registry.resolve`, the one place a name is looked up)."""
    counts, real = collections.Counter(), registry.resolve
    monkeypatch.setattr(registry, "resolve", lambda name: counts.update([name]) or real(name))
    return counts


def test_a_name_is_looked_up_once_per_call(story, tokenizer, resolved):
    """detect, detect on several samples, detect_many, from_attribution and attribute each look every
    detector's name up once, whatever runs it (its own passes or the shared pass)."""
    model, sample = story
    calls = {
        "detect": lambda: probe.detect("recency", model, tokenizer, sample),
        "detect, shared pass": lambda: probe.detect("attention", model, tokenizer, sample, layers=[0]),
        "detect, samples": lambda: probe.detect("random", model, tokenizer, [sample, sample]),
        "detect, samples, shared pass": lambda: probe.detect(
            "embedding_grad", model, tokenizer, [sample] * 2
        ),
        "detect_many": lambda: detectors.detect_many(
            ["attention", "key_removal_grad", "recency", "random"], model, tokenizer, sample, {"random": {}}
        ),
        "attribute": lambda: probe.attribute(
            model, tokenizer, "Ann is in Rome. Bob is in Oslo.", "Where is Bob?", "Oslo", detector="recency"
        ),
    }
    for call, run in calls.items():
        resolved.clear()
        run()
        assert set(resolved.values()) == {1}, f"{call}: {dict(resolved)}"
    (attribution,) = answer_attribution(model, [sample.input_ids], [sample.target_positions], [0, 1])
    resolved.clear()
    detectors.from_attribution("fr", model, attribution, sample, layers=[0, 1])
    assert resolved == {"fr": 1}


def test_the_registry_declares_how_each_detector_runs():
    """Every registered detector resolves to one record: its shared pass and reader, or neither; only
    leave_one_out takes the ranking of others (its options rank_by, top_m and ranking)."""
    for name in detectors.names():
        found = registry.resolve(name)
        assert found.name == name and found.detector is registry.lookup(name)
        assert (found.shared_pass is None) == (found.reader is None) == (detectors.shared_pass(name) is None)
        assert found.options == detectors.options(name)
        assert found.takes_ranking == (name == "leave_one_out")


def test_replace_keeps_what_the_registry_declares():
    """A replaced detector keeps its shared pass and reader; detect calls the replacement, and sandbox
    puts the original back."""
    original = registry.resolve("attention")

    def wrapped(model, tokenizer, sample, **options):
        return original.detector(model, tokenizer, sample, **options)

    with detectors.sandbox():
        assert detectors.replace("attention", wrapped) is original.detector
        now = registry.resolve("attention")
        assert now.detector is wrapped and (now.shared_pass, now.reader) == (
            original.shared_pass,
            original.reader,
        )
    assert registry.resolve("attention") == original


def test_a_detector_declaring_a_ranking_is_handed_the_detections_at_hand(story, tokenizer, sandbox):
    """A detector with the options rank_by, top_m and ranking gets, pruned, the source scores of its
    rank_by detections this detect_many call made (same target); otherwise none, as a detector without
    those options."""
    model, sample = story
    given = []

    @detectors.register("hand_ranked")
    def hand_ranked(
        model, tokenizer, sample, rank_by: str = "recency", top_m: int | None = None, ranking=None
    ):
        given.append(ranking)
        return detectors.Detection(scores=torch.zeros(len(sample.input_ids)), flagged=None, settings={})

    assert registry.resolve("hand_ranked").takes_ranking
    recency = probe.detect("recency", model, tokenizer, sample)
    detectors.detect_many(["recency", "hand_ranked"], model, tokenizer, sample, {"hand_ranked": {"top_m": 2}})
    assert torch.equal(given.pop(), recency.source_scores(sample)[None])
    for names, options in (
        (["recency", "hand_ranked"], {}),  # not pruned
        (["hand_ranked", "recency"], {"hand_ranked": {"top_m": 2}}),  # recency not made yet
        (["random", "hand_ranked"], {"hand_ranked": {"top_m": 2}}),  # recency not in the call
    ):
        detectors.detect_many(names, model, tokenizer, sample, options)
        assert given.pop() is None
