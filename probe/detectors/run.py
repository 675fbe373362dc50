"""Running detectors: :func:`detect` (one detector), :func:`detect_many` (several, the attention
family from one shared pass), :func:`from_attribution` (a detection read off a pass already run) and
:func:`attribute` (ContextCite's question in one call).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probe import journal
from probe.checks import check_sample_fits, check_tokenizer
from probe.detectors import registry
from probe.detectors.registry import PASS_OPTIONS, Detection, Registered, SharedPass, finished
from probe.errors import InvalidTypeError, InvalidValueError
from probe.faithfulness import sample_digest
from probe.probes.attribution import AnswerAttribution
from probe.target import CHECKED, describe, vocabulary_size
from probe.tasks import Sample, check_sample


def detect(
    detector: str, model, tokenizer, sample: Sample | Sequence[Sample], **options
) -> Detection | list[Detection]:
    """Run the detector registered as ``detector`` (:func:`names`) on ``sample``; ``options`` go to it
    (see its docstring).

    Several samples: one :class:`Detection` each, the shared-pass readers from one batched pass
    (:func:`detect_many`).
    """
    found = registry.resolve(detector)
    if not isinstance(sample, (list, tuple)):
        return found.detector(model, tokenizer, sample, **options)
    samples = _samples(sample)
    check_tokenizer(tokenizer, optional=True)
    found.check_options(options)
    many = _run({detector: found}, model, tokenizer, samples, {detector: options}, "auto")
    return [one[detector] for one in many]


def attribute(
    model,
    tokenizer,
    context: str,
    query: str,
    response: str | None = None,
    detector: str = "key_removal_banzhaf",
    sources: str | Sequence[str] | Sequence[tuple[int, int]] = "sentences",
    chat: bool | None = None,
    max_new_tokens: int = 64,
    **options,
) -> Detection:
    """Which parts of ``context`` carry the answer to ``query``: ContextCite's question, in one call.

    The context becomes a sample (:meth:`probe.tasks.Sample.from_text`, cut into ``sources``); the
    model answers greedily (at most ``max_new_tokens``) unless ``response`` is given; detector
    ``detector`` (any of :func:`names`, ``options`` to it) explains the response's teacher-forced
    tokens; the default, ``key_removal_banzhaf``, is the one-pass detector nearest exact ablation
    (LDS, RESULTS.md). Returns the :class:`Detection`, its sample attached (``detection.sample``, with the
    response as its answer), whose :meth:`~Detection.to_frame` has one row per source (text, score,
    rank) and whose view shows the text; :func:`probe.faithfulness.evaluate` and every metric take it.
    """
    found = registry.resolve(detector)
    found.check_options(options)
    check_tokenizer(tokenizer)
    if response is None:
        from probe.generation import answer

        prompt = Sample.from_text(tokenizer, context, query, None, sources, chat)
        response = answer(model, tokenizer, prompt, max_new_tokens)
        if not response:
            raise InvalidValueError(
                "the model's greedy answer is empty: pass response=... to explain a given one"
            )
    sample = Sample.from_text(tokenizer, context, query, response, sources, chat)
    return dataclasses.replace(found.detector(model, tokenizer, sample, **options), rows="source")


def detect_many(
    names: Sequence[str],
    model,
    tokenizer,
    sample: Sample | Sequence[Sample],
    options: Mapping[str, Mapping[str, Any]] | None = None,
    checkpoint: bool | str = "auto",
) -> dict[str, Detection] | list[dict[str, Detection]]:
    """Run every detector in ``names`` on ``sample``, ``options[name]`` going to detector ``name``.

    Returns name → :class:`Detection`, in the order of ``names``: the same detections as
    ``detect(name, model, tokenizer, sample, **options[name])`` one by one, but every detector that
    reads the shared pass (``@register(name, shared_pass=...)``: ``attention``, ``fr``,
    ``embedding_grad``, ``information_flow``, ``grad_times_input``, ``key_removal_grad``, ``at2``) reads one
    :func:`probe.probes.attribution.answer_attribution` forward+backward pass over the union of their
    layers instead of one pass each (a forward pass alone when none of them reads gradients;
    ``checkpoint``: that pass's, see :func:`~probe.probes.attribution.answer_attribution`). The other
    detectors run as usual.

    Several samples: one such dict per sample; the shared pass then runs once for all of them
    (:mod:`probe.attention.batch`), the other detectors sample by sample. Within a
    :class:`probe.journal.Journal` a detection it holds for the same sample, detector and options (by
    ``repr``) is read, not run (the shared pass runs only for samples that lack one of its readers), and
    each one run is written to it. A detector that ranks by others (``leave_one_out`` pruned, see
    :attr:`~probe.detectors.registry.Registered.takes_ranking`) is handed their detections made here.
    """
    samples = _samples(sample)
    if not isinstance(options or {}, Mapping):
        raise InvalidTypeError(f"options must map detector names to their options, got {options!r:.80}")
    options = dict(options or {})
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise InvalidTypeError(f"names must be a list of detector names, got {names!r}")
    check_tokenizer(tokenizer, optional=True)
    resolved = _resolved([*names, *options], options)
    found = _run({name: resolved[name] for name in names}, model, tokenizer, samples, options, checkpoint)
    return found[0] if isinstance(sample, Sample) else found


def _samples(sample: Sample | Sequence[Sample]) -> list[Sample]:
    """``sample`` as a list of samples; refuses anything but a sample or a non-empty list of them."""
    if isinstance(sample, Sample):
        return [sample]
    if not (isinstance(sample, (list, tuple)) and sample):
        got = repr(sample)[:60]
        raise InvalidTypeError(f"sample must be a probe.Sample or a non-empty list of them, got {got}")
    return list(sample)


def _resolved(names: list[str], options: Mapping[str, Any]) -> dict[str, Registered]:
    """Each detector of ``names`` looked up once, the options ``options`` gives it checked."""
    resolved = {}
    for name in dict.fromkeys(names):
        if not isinstance(options.get(name, {}), Mapping):
            raise InvalidTypeError(f"options[{name!r}] must be a dict of options, got {options[name]!r:.80}")
        resolved[name] = registry.resolve(name)
        resolved[name].check_options(options.get(name, {}))
    return resolved


def _run(
    detectors: dict[str, Registered],
    model,
    tokenizer,
    samples: list[Sample],
    options: Mapping[str, Mapping[str, Any]],
    checkpoint: bool | str,
) -> list[dict[str, Detection]]:
    """:func:`detect_many` once its arguments are checked and its names resolved: the checks left before
    any model work, then each sample's detections read from the journal, off the shared pass, or run."""
    for one in samples:
        check_sample(one)
        registry.check_answered(one)
        check_sample_fits(model, one, tokenizer)
    shared = _SharedRun.of(detectors, model, samples, options, checkpoint)
    files = _journal_files(samples, detectors, options)
    held = [{name: Detection.load(file) for name, file in each.items() if file.exists()} for each in files]
    attributions, seconds = shared.run(model, samples, held)
    found = []
    for i, one in enumerate(samples):
        made: dict[str, Detection] = {}
        for name, detector in detectors.items():
            if name in held[i]:
                made[name] = dataclasses.replace(held[i][name], sample=one)
                continue
            if name in shared.readers:
                made[name] = shared.read(name, model, attributions[i], one, seconds)
            else:
                made[name] = _run_own(detector, model, tokenizer, one, options, made)
            if name in files[i]:
                made[name].save(files[i][name])
        found.append(made)
    return found


@dataclass(frozen=True)
class _SharedRun:
    """The one shared pass of a :func:`detect_many` call: its ``readers``, the ``options`` each reads
    with, the ``layers`` it captures, what it ``needs`` (gradients, a key bias), the one ``target`` its
    gradients explain and its ``checkpoint``."""

    readers: dict[str, Registered]
    options: dict[str, dict[str, Any]]
    layers: list[int]
    needs: SharedPass
    target: Any
    checkpoint: bool | str

    @classmethod
    def of(
        cls,
        detectors: dict[str, Registered],
        model,
        samples: list[Sample],
        options: Mapping[str, Mapping[str, Any]],
        checkpoint: bool | str,
    ) -> _SharedRun:
        """The pass the readers among ``detectors`` need, checked before any model work: the union of
        their layers, and one target for those reading gradients (:func:`_one_target`)."""
        readers = {name: detector for name, detector in detectors.items() if detector.shared_pass is not None}
        read = {
            name: {k: v for k, v in options.get(name, {}).items() if k not in PASS_OPTIONS}
            for name in readers
        }
        needed = [r.shared_pass.layers_of(model, r.reader, read[name]) for name, r in readers.items()]
        layers = sorted({layer for each in needed for layer in each})
        explaining = [name for name, r in readers.items() if r.shared_pass.backward]
        target = _one_target([options.get(name, {}).get("target") for name in explaining], model, samples)
        needs = SharedPass(
            backward=bool(explaining), key_bias=any(r.shared_pass.key_bias for r in readers.values())
        )
        return cls(readers, read, layers, needs, target, checkpoint)

    def run(
        self, model, samples: list[Sample], held: list[dict[str, Detection]]
    ) -> tuple[dict[int, AnswerAttribution], float]:
        """The pass over the samples lacking a reader's detection in ``held``: their attributions by
        sample index, and the pass's seconds a sample."""
        passing = [i for i, each in enumerate(held) if set(self.readers) - set(each)]
        if not passing:
            return {}, 0.0
        start = time.perf_counter()
        chosen = [samples[i] for i in passing]
        ran = registry.run_pass(model, chosen, self.layers, self.needs, self.checkpoint, self.target)
        return dict(zip(passing, ran, strict=True)), (time.perf_counter() - start) / len(passing)

    def read(
        self, name: str, model, attribution: AnswerAttribution, sample: Sample, seconds: float
    ) -> Detection:
        """Reader ``name``'s detection of ``sample``, read off its ``attribution``."""
        reader = self.readers[name]
        detection = reader.reader(model, attribution, sample, **self.options[name])
        explained = self.target if reader.shared_pass.backward else None
        return finished(detection, name, sample, seconds, explained)


def _one_target(given: list[Any], model, samples: list[Sample]) -> Any:
    """The one target the shared pass's gradients explain, of those ``given`` to its readers (``None``:
    the default), checked against each sample's answer; refuses different ones."""
    chosen = {describe(t) if t is None or isinstance(t, CHECKED) else id(t): t for t in given}
    if len(chosen) > 1:
        raise InvalidValueError(
            "the detectors of one shared pass explain one target: give each the same target="
        )
    (target,) = chosen.values() if chosen else (None,)
    for one in samples if isinstance(target, CHECKED) else ():
        target.check(one.input_ids[one.target_positions], vocabulary_size(model))
    return target


def _journal_files(
    samples: list[Sample], detectors: dict[str, Registered], options: Mapping[str, Mapping[str, Any]]
) -> list[dict[str, Path]]:
    """For each sample, the file of the active :class:`probe.journal.Journal` that holds each detector's
    detection of it with its options (by ``repr``); none without a journal."""
    journaled = journal.active()
    if journaled is None:
        return [{} for _ in samples]
    return [
        {
            name: journaled.detection_file(f"{sample_digest(one)}|{name}|{options.get(name, {})!r}")
            for name in detectors
        }
        for one in samples
    ]


def _run_own(
    detector: Registered,
    model,
    tokenizer,
    sample: Sample,
    options: Mapping[str, Mapping[str, Any]],
    made: Mapping[str, Detection],
) -> Detection:
    """A detector that runs passes of its own, on ``sample`` with its ``options``; one that takes the
    ranking of others (:attr:`~probe.detectors.registry.Registered.takes_ranking`), pruned, is handed
    its ``rank_by`` detections when this call ``made`` them all already for the same target (then they
    need not run again)."""
    given = options.get(detector.name, {})
    if detector.takes_ranking and given.get("top_m") is not None and "ranking" not in given:
        rank_by = given.get("rank_by", detector.option_default("rank_by"))
        rankers = [rank_by] if isinstance(rank_by, str) else list(rank_by)
        target = given.get("target")
        if rankers and all(r in made and options.get(r, {}).get("target") is target for r in rankers):
            ranking = torch.stack([made[r].source_scores(sample) for r in rankers])
            return detector.detector(model, tokenizer, sample, **given, ranking=ranking)
    return detector.detector(model, tokenizer, sample, **given)


def from_attribution(
    name: str, model, attribution: AnswerAttribution, sample: Sample, **options
) -> Detection:
    """Detection ``name`` (a reader of the shared pass, :func:`registry.shared_pass`) read off an answer
    attribution of ``sample`` (:func:`~probe.probes.attribution.answer_attribution`, with the layers it
    needs), as :func:`detect_many` does: no model pass."""
    found = registry.resolve(name)
    if found.shared_pass is None:
        raise InvalidValueError(f"detector {name!r} runs passes of its own, it reads no attribution")
    found.check_options(options)
    detection = found.reader(model, attribution, sample, **options)
    return finished(detection, name, sample, None)
