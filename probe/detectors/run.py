"""Running detectors: :func:`detect` (one detector), :func:`detect_many` (several, the attention
family from one shared pass), :func:`from_attribution` (a detection read off a pass already run) and
:func:`attribute` (ContextCite's question in one call).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from probe import journal
from probe.attribution import AnswerAttribution
from probe.checks import check_sample_fits, check_tokenizer
from probe.detectors import registry
from probe.detectors.registry import PASS_OPTIONS, Detection, finished
from probe.errors import InvalidTypeError, InvalidValueError
from probe.faithfulness import sample_digest
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
    run = registry.lookup(detector)
    if isinstance(sample, (list, tuple)):
        found = detect_many([detector], model, tokenizer, sample, {detector: options})
        return [one[detector] for one in found]
    return run(model, tokenizer, sample, **options)


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
    registry.check_options(detector, options)
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
    return dataclasses.replace(detect(detector, model, tokenizer, sample, **options), rows="source")


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
    :func:`probe.attribution.answer_attribution` forward+backward pass over the union of their
    layers instead of one pass each (a forward pass alone when none of them reads gradients;
    ``checkpoint``: that pass's, see :func:`~probe.attribution.answer_attribution`). The other
    detectors run as usual.

    Several samples: one such dict per sample; the shared pass then runs once for all of them
    (:mod:`probe.batch`), the other detectors sample by sample. Within a :class:`probe.journal.Journal`
    a detection it holds for the same sample, detector and options (by ``repr``) is read, not run (the
    shared pass runs only for samples that lack one of its readers), and each one run is written to it.
    """
    single = isinstance(sample, Sample)
    if not single and not (isinstance(sample, (list, tuple)) and sample):
        got = repr(sample)[:60]
        raise InvalidTypeError(f"sample must be a probe.Sample or a non-empty list of them, got {got}")
    samples = [sample] if single else list(sample)
    if not isinstance(options or {}, Mapping):
        raise InvalidTypeError(f"options must map detector names to their options, got {options!r:.80}")
    options = dict(options or {})
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise InvalidTypeError(f"names must be a list of detector names, got {names!r}")
    check_tokenizer(tokenizer, optional=True)
    for name in [*names, *options]:
        if not isinstance(options.get(name, {}), Mapping):
            raise InvalidTypeError(f"options[{name!r}] must be a dict of options, got {options[name]!r:.80}")
        registry.check_options(name, options.get(name, {}))
    for one in samples:
        check_sample(one)
        registry.check_answered(one)
    shared = {name: registry.shared_pass(name) for name in names if registry.shared_pass(name)}
    read_options = {
        name: {k: v for k, v in options.get(name, {}).items() if k not in PASS_OPTIONS} for name in shared
    }
    needed = [how.layers_of(model, read, read_options[name]) for name, (how, read) in shared.items()]
    layers = sorted({layer for each in needed for layer in each})
    for one in samples:
        check_sample_fits(model, one, tokenizer)
    explaining = [name for name, (how, _) in shared.items() if how.backward]
    given = [options.get(name, {}).get("target") for name in explaining]
    chosen = {describe(t) if t is None or isinstance(t, CHECKED) else id(t): t for t in given}
    if len(chosen) > 1:
        raise InvalidValueError(
            "the detectors of one shared pass explain one target: give each the same target="
        )
    (target,) = chosen.values() if chosen else (None,)
    for one in samples if isinstance(target, CHECKED) else ():  # before any model work
        target.check(one.input_ids[one.target_positions], vocabulary_size(model))
    journaled = journal.active()
    files = [
        {
            name: journaled.detection_file(f"{sample_digest(one)}|{name}|{options.get(name, {})!r}")
            for name in names
        }
        if journaled is not None
        else {}
        for one in samples
    ]
    held = [{name: Detection.load(file) for name, file in each.items() if file.exists()} for each in files]
    passing = [i for i, each in enumerate(held) if set(shared) - set(each)]  # samples the pass must run on
    attributions, start = {}, time.perf_counter()
    if passing:
        needs = registry.SharedPass(
            backward=bool(explaining), key_bias=any(how.key_bias for how, _ in shared.values())
        )
        ran = registry.run_pass(model, [samples[i] for i in passing], layers, needs, checkpoint, target)
        attributions = dict(zip(passing, ran, strict=True))
    seconds = (time.perf_counter() - start) / max(len(passing), 1)  # the shared pass's, a sample
    found = []
    for i, one in enumerate(samples):
        detections = {}
        for name in names:
            if name in held[i]:
                detections[name] = dataclasses.replace(held[i][name], sample=one)
                continue
            if name in shared:
                detection = shared[name][1](model, attributions[i], one, **read_options[name])
                explained = target if name in explaining else None
                detections[name] = finished(detection, name, one, seconds, explained)
            else:
                reused = _ranking_at_hand(name, options, detections, one)
                detections[name] = detect(name, model, tokenizer, one, **options.get(name, {}), **reused)
            if journaled is not None:
                detections[name].save(files[i][name])
        found.append(detections)
    return found[0] if single else found


def _ranking_at_hand(
    name: str, options: Mapping[str, Mapping[str, Any]], made: Mapping[str, Detection], sample: Sample
) -> dict[str, torch.Tensor]:
    """``{"ranking": Tensor[rankers, sources]}`` for a pruned ``leave_one_out`` whose ``rank_by``
    detections this call has all made already for the same target (then they need not run again);
    ``{}`` otherwise."""
    chosen = options.get(name, {})
    if name != "leave_one_out" or chosen.get("top_m") is None or "ranking" in chosen:
        return {}
    rankers = registry.looked_up(chosen.get("rank_by", registry.option_default(name, "rank_by")))
    target = chosen.get("target")
    if any(r not in made or options.get(r, {}).get("target") is not target for r in rankers):
        return {}
    return {"ranking": torch.stack([made[r].source_scores(sample) for r in rankers])}


def from_attribution(
    name: str, model, attribution: AnswerAttribution, sample: Sample, **options
) -> Detection:
    """Detection ``name`` (a reader of the shared pass, :func:`registry.shared_pass`) read off an answer
    attribution of ``sample`` (:func:`~probe.attribution.answer_attribution`, with the layers it needs),
    as :func:`detect_many` does: no model pass."""
    found = registry.shared_pass(name)
    if found is None:
        raise InvalidValueError(f"detector {name!r} runs passes of its own, it reads no attribution")
    registry.check_options(name, options)
    detection = found[1](model, attribution, sample, **options)
    return finished(detection, name, sample, None)
