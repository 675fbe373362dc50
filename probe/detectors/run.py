"""Running detectors: :func:`detect` (one detector), :func:`detect_many` (several, the attention
family from one shared pass), :func:`from_attribution` (a detection read off a pass already run) and
:func:`attribute` (ContextCite's question in one call).
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any, overload

import torch

from probe.at2 import HeadWeights
from probe.attribution import AnswerAttribution, answer_attribution
from probe.checks import check_layers, check_sample, check_sample_fits, check_tokenizer
from probe.detectors import registry
from probe.detectors.one_pass import (
    _additive,
    _at2_from,
    _attention_from,
    _embedding_grad_from,
    _fact_retrieval_from,
    _information_flow_from,
)
from probe.detectors.registry import Detection, _on_cpu, _with_target
from probe.errors import InvalidTypeError, InvalidValueError
from probe.target import Contrast, describe
from probe.tasks import Sample


@overload
def detect(name: str, model, tokenizer, sample: Sample, **options) -> Detection: ...


@overload
def detect(name: str, model, tokenizer, sample: Sequence[Sample], **options) -> list[Detection]: ...


def detect(
    name: str, model, tokenizer, sample: Sample | Sequence[Sample], **options
) -> Detection | list[Detection]:
    """Run detector ``name`` on ``sample``; ``options`` go to the detector (see its docstring).

    Several samples: one :class:`Detection` each, the attention family from one batched pass
    (:func:`detect_many`).
    """
    detector = registry.lookup(name)
    if isinstance(sample, (list, tuple)):
        return [found[name] for found in detect_many([name], model, tokenizer, sample, {name: options})]
    return detector(model, tokenizer, sample, **options)


def attribute(
    model,
    tokenizer,
    context: str,
    query: str,
    response: str | None = None,
    method: str = "key_removal_banzhaf",
    sources: str | Sequence[str] | Sequence[tuple[int, int]] = "sentences",
    chat: bool | None = None,
    max_new_tokens: int = 64,
    **options,
) -> Detection:
    """Which parts of ``context`` carry the answer to ``query``: ContextCite's question, in one call.

    The context becomes a sample (:meth:`probe.tasks.Sample.from_text`, cut into ``sources``); the
    model answers greedily (at most ``max_new_tokens``) unless ``response`` is given; detector
    ``method`` (any of :func:`names`, ``options`` to it) explains the response's teacher-forced
    tokens; the default, ``key_removal_banzhaf``, is the one-pass detector nearest exact ablation
    (LDS, RESULTS.md). Returns the :class:`Detection`, its sample attached (``detection.sample``, with the
    response as its answer), whose :meth:`~Detection.to_frame` has one row per source (text, score,
    rank) and whose view shows the text; :func:`probe.faithfulness.evaluate` and every metric take it.
    """
    registry.check_options(method, options)
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
    return dataclasses.replace(detect(method, model, tokenizer, sample, **options), rows="source")


SHARED_PASS = ("attention", "fr", "embedding_grad", "information_flow", "grad_times_input", "at2")


@overload
def detect_many(
    names: Sequence[str],
    model,
    tokenizer,
    sample: Sample,
    options: Mapping[str, Mapping[str, Any]] | None = ...,
    checkpoint: bool | str = ...,
) -> dict[str, Detection]: ...


@overload
def detect_many(
    names: Sequence[str],
    model,
    tokenizer,
    sample: Sequence[Sample],
    options: Mapping[str, Mapping[str, Any]] | None = ...,
    checkpoint: bool | str = ...,
) -> list[dict[str, Detection]]: ...


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
    ``detect(name, model, tokenizer, sample, **options[name])`` one by one, but when ``names``
    holds at least one of ``attention``, ``fr`` and ``information_flow``, the attention family
    (:data:`SHARED_PASS`, ``embedding_grad`` included) is computed from one
    :func:`probe.attribution.answer_attribution` forward+backward pass over the union of their
    layers instead of one pass each (``checkpoint``: that pass's, see
    :func:`~probe.attribution.answer_attribution`). The other detectors run as usual.

    Several samples: one such dict per sample; the shared pass then runs once for all of them
    (:mod:`probe.batch`), the other detectors sample by sample.
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
    shared = {name: _settings(name, model, options.get(name, {})) for name in names if name in SHARED_PASS}
    layers = sorted({layer for settings in shared.values() for layer in settings.get("layers", ())})
    if "at2" in shared:  # its weights cover every head
        layers = check_layers(model, None)
    for one in samples:
        check_sample_fits(model, one, tokenizer)
    explaining = [
        name for name in shared if "target" in inspect.signature(registry.lookup(name)).parameters
    ]
    given = [options.get(name, {}).get("target") for name in explaining]
    chosen = {describe(t) if t is None or isinstance(t, Contrast) else id(t): t for t in given}
    if len(chosen) > 1:
        raise InvalidValueError(
            "the detectors of one shared pass explain one target: give each the same target="
        )
    (target,) = chosen.values() if chosen else (None,)
    for one in samples if isinstance(target, Contrast) else ():  # before any model work
        target.check(one.input_ids[one.target_positions])
    attributions, start = [None] * len(samples), time.perf_counter()
    if layers:
        ids, targets = [s.input_ids for s in samples], [s.target_positions for s in samples]
        attributions = answer_attribution(model, ids, targets, layers, checkpoint, target=target)
    seconds = (time.perf_counter() - start) / len(samples)  # the shared pass's, a sample
    found = []
    for one, attribution in zip(samples, attributions, strict=True):
        detections = {}
        for name in names:
            if attribution is not None and name in shared:
                detection = _from_attribution(name, attribution, one, shared[name])
                detection = _with_target(detection, target if name in explaining else None)
                detection = dataclasses.replace(detection, name=name, sample=one, seconds=seconds)
                detections[name] = _on_cpu(detection)
            else:
                reused = _ranking_at_hand(name, options, detections, one)
                detections[name] = detect(name, model, tokenizer, one, **options.get(name, {}), **reused)
        found.append(detections)
    return found[0] if single else found


def _ranking_at_hand(
    name: str, options: Mapping[str, Mapping[str, Any]], made: Mapping[str, Detection], sample: Sample
) -> dict[str, torch.Tensor]:
    """``{"ranking": …}`` for a pruned ``leave_one_out`` whose ``rank_by`` detection this call has
    already made for the same target (then it need not run again); ``{}`` otherwise."""
    chosen = options.get(name, {})
    if name != "leave_one_out" or chosen.get("top_m") is None or "ranking" in chosen:
        return {}
    defaults = inspect.signature(registry.lookup(name)).parameters
    rank_by = chosen.get("rank_by", defaults["rank_by"].default)
    if rank_by not in made or options.get(rank_by, {}).get("target") is not chosen.get("target"):
        return {}
    return {"ranking": made[rank_by].source_scores(sample)}


# how the shared pass runs and what it explains, not what a detector reads off it
PASS_OPTIONS = ("checkpoint", "target")


def _settings(name: str, model, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of detector ``name`` (``options`` over its defaults; ``layers`` checked), but
    :data:`PASS_OPTIONS`."""
    bound = inspect.signature(registry.lookup(name)).bind(model, None, None, **options)
    bound.apply_defaults()
    settings = {key: bound.arguments[key] for key in list(bound.arguments)[3:] if key not in PASS_OPTIONS}
    if "layers" in settings:
        settings["layers"] = check_layers(model, settings["layers"])
    if name == "at2":
        settings["weights"] = HeadWeights.for_model(model, settings["weights"])
    return settings


def from_attribution(
    name: str, model, attribution: AnswerAttribution, sample: Sample, **options
) -> Detection:
    """Detection ``name`` (one of :data:`SHARED_PASS`) read off an answer attribution of ``sample``
    (:func:`~probe.attribution.answer_attribution`, with the layers it needs), as :func:`detect_many`
    does: no model pass."""
    detection = _from_attribution(name, attribution, sample, _settings(name, model, options))
    return _on_cpu(dataclasses.replace(detection, name=name, sample=sample))


def _from_attribution(
    name: str, attribution: AnswerAttribution, sample: Sample, settings: dict[str, Any]
) -> Detection:
    """Detection ``name`` (one of :data:`SHARED_PASS`) from the shared pass; settings as :func:`_settings`."""
    if name == "embedding_grad":
        return _embedding_grad_from(attribution.embedding_grad_norms(settings["p"]), sample, **settings)
    if name == "grad_times_input":
        return _additive(attribution.grad_times_input(), sample, **settings)
    if name == "at2":
        return _at2_from(attribution, sample, **settings)
    if name == "information_flow":
        per_layer = attribution.information_flow(settings["layers"], settings["reduce"])
        return _information_flow_from(per_layer, sample, **settings)
    pattern, _ = attribution.select(settings["layers"])
    return {"attention": _attention_from, "fr": _fact_retrieval_from}[name](pattern, sample, **settings)
