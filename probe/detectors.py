"""Critical-token detectors: one registry, one signature.

Every detector maps ``(model, tokenizer, sample, **options)`` to one score per token of the
sample (higher = more critical) and the set it would flag by its own rule, returned as a
:class:`Detection` that carries its settings. The answer rows are the rows that predict the
sample's teacher-forced gold answer (rows ``sample.target_positions − 1``); scores for tokens at
or after the answer are not meaningful for detection and :mod:`probe.metrics` ignores them.
A detector is named once, in ``@register(name)``; the registry stamps the name on its result.

    >>> detection = probe.detect("information_flow", model, tokenizer, sample)
    >>> detection.scores.shape, detection.flagged.sum()
    >>> probe.detectors.names()
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np
import pandas as pd
import torch

from probe import views
from probe.at2 import HeadWeights, token_features
from probe.attribution import (
    AnswerAttribution,
    answer_attribution,
    attention_rows,
    embedding_grad_norms,
    key_removal_gradient,
)
from probe.attribution import information_flow as information_flow_per_layer
from probe.checks import check_layers, check_sample_fits, hf_model, input_device
from probe.faithfulness import answer_scores, lds, random_masks, source_scores
from probe.lrp import relevance
from probe.objectives import critical_tokens
from probe.planner import guarded
from probe.results import read_json, write_json
from probe.shared_state import frozen_parameters
from probe.target import Contrast, Target, describe, target_loss_of
from probe.tasks import Sample


@dataclass
class Detection:
    """What a detector found on one sample.

    ``scores``: Tensor[seq], higher = more critical. ``flagged``: bool Tensor[seq], the
    detector's own rule. ``details``: extra tensors (e.g. ``per_layer`` [layers, seq],
    ``per_head`` [layers, heads, seq]) and diagnostics (``convergence_delta``).
    ``settings``: every option that produced the result. ``name``: the registered detector's name,
    set by the registry (``None`` for a detection built by hand). ``sample``: the sample it was
    found on (set by the registry; not saved), which :meth:`show` draws. ``rows``: what
    :meth:`to_frame` gives a row for by default, ``"token"`` or ``"source"`` (:func:`attribute`).
    """

    scores: torch.Tensor
    flagged: torch.Tensor
    settings: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    sample: Sample | None = field(default=None, repr=False, compare=False)
    rows: str = "token"

    def _view(self, sample: Sample | None) -> str:
        sample = sample if sample is not None else self.sample
        if sample is None:
            raise ValueError("this detection carries no sample (loaded from a file?): pass show(sample=...)")
        return views.token_view(sample, self.scores, f"{self.name or 'detection'} scores")

    def show(self, sample: Sample | None = None):
        """The token view (:func:`probe.views.token_view`) in a notebook: each token shaded by its score."""
        from IPython.display import HTML

        return HTML(self._view(sample))

    def _repr_html_(self) -> str | None:
        return None if self.sample is None else self._view(None)

    def save_html(self, path: str | Path, sample: Sample | None = None) -> Path:
        """The token view as a self-contained HTML page, written atomically."""
        return views.save_html(path, self._view(sample), f"longprobe: {self.name or 'detection'}")

    def source_scores(self, sample: Sample | None = None, reduce: str = "mean") -> torch.Tensor:
        """One score per source of ``sample`` (default: the detection's own): Tensor[sources]. The
        detector's own ``details["source_scores"]`` where it has them (ablation and additive
        detectors), else ``reduce`` over each source's tokens (:func:`probe.faithfulness.source_scores`)."""
        if "source_scores" in self.details:
            return self.details["source_scores"].float()
        sample = sample if sample is not None else self.sample
        if sample is None:
            raise ValueError("this detection carries no sample (loaded from a file?): pass the sample")
        return source_scores(self.scores, sample.sources, reduce)

    def to_frame(self, tokenizer=None, sample: Sample | None = None, rows: str | None = None) -> pd.DataFrame:
        """One row per token (position, score, flagged; token text and category given a sample and
        tokenizer) or, with ``rows="source"``, one row per source of the sample (its category, token
        span, text, score and rank, 1 = highest). ``rows`` defaults to :attr:`rows`."""
        rows = rows or self.rows
        if rows == "source":
            return self._source_frame(sample if sample is not None else self.sample)
        if rows != "token":
            raise ValueError(f"rows must be 'token' or 'source', got {rows!r}")
        sample = sample if sample is not None or tokenizer is None else self.sample
        frame = pd.DataFrame(
            {
                "position": np.arange(len(self.scores)),
                "score": self.scores.numpy(),
                "flagged": self.flagged.numpy(),
            }
        )
        if sample is not None:
            frame["category"] = sample.categories
            if tokenizer is not None:
                frame["token"] = [tokenizer.decode(t) for t in sample.input_ids]
        return frame.assign(detector=self.name)

    def _source_frame(self, sample: Sample | None) -> pd.DataFrame:
        if sample is None:
            raise ValueError("a per-source frame needs the sample: pass to_frame(sample=...)")
        scores = self.source_scores(sample).numpy()
        frame = pd.DataFrame(
            {
                "source": range(len(sample.sources)),
                "category": [source.category for source in sample.sources],
                "start": [source.start for source in sample.sources],
                "end": [source.end for source in sample.sources],
                "text": [sample.text[slice(*sample.char_spans[s.category][s.index])] for s in sample.sources],
                "score": scores,
            }
        )
        frame["rank"] = frame.score.rank(ascending=False, method="first").astype(int)
        return frame.assign(detector=self.name)

    def save(self, path: str | Path) -> None:
        """Write name, scores, flags, settings and details as JSON, atomically (tensors as nested lists)."""
        record = {
            "name": self.name,
            "rows": self.rows,
            "settings": self.settings,
            "scores": self.scores.tolist(),
            "flagged": self.flagged.tolist(),
            "details": {k: v.tolist() if torch.is_tensor(v) else v for k, v in self.details.items()},
        }
        write_json(path, record)

    @classmethod
    def load(cls, path: str | Path) -> Detection:
        """The detection :meth:`save` wrote."""
        record = read_json(path, "Detection", ("scores", "flagged", "settings", "details"))
        return cls(
            name=record.get("name"),
            rows=record.get("rows", "token"),
            scores=torch.tensor(record["scores"]),
            flagged=torch.tensor(record["flagged"], dtype=torch.bool),
            settings=record["settings"],
            details={k: torch.tensor(v) if isinstance(v, list) else v for k, v in record["details"].items()},
        )


Detector = Callable[..., Detection]
_REGISTRY: dict[str, Detector] = {}


def register(name: str) -> Callable[[Detector], Detector]:
    """Add a detector ``fn(model, tokenizer, sample, **options) -> Detection`` to the registry as ``name``.

    Returns ``fn`` wrapped so that its :class:`Detection` carries ``name``: a detector never writes
    its own name. Refuses a name already taken and a function with another signature.
    """

    def add(fn: Detector) -> Detector:
        if name in _REGISTRY:
            raise ValueError(f"a detector named {name!r} is already registered")
        if list(inspect.signature(fn).parameters)[:3] != ["model", "tokenizer", "sample"]:
            raise TypeError(f"detector {name!r} must take (model, tokenizer, sample, **options)")

        @functools.wraps(fn)
        def named(model, tokenizer, sample: Sample, **options) -> Detection:
            check_sample_fits(model, sample, tokenizer)
            detection = _with_target(fn(model, tokenizer, sample, **options), options.get("target"))
            return _on_cpu(dataclasses.replace(detection, name=name, sample=sample))

        _REGISTRY[name] = named
        return named

    return add


def _with_target(detection: Detection, target) -> Detection:
    """The detection with its target among its settings (as text: :func:`probe.target.describe`),
    unless it is the default."""
    if target is None:
        return detection
    return dataclasses.replace(detection, settings={**detection.settings, "target": describe(target)})


def _on_cpu(detection: Detection) -> Detection:
    """The detection with its tensors on the CPU, detached: results are data, wherever the model ran."""

    def cpu(value):
        return value.detach().cpu() if torch.is_tensor(value) else value

    details = {key: cpu(value) for key, value in detection.details.items()}
    return dataclasses.replace(
        detection, scores=cpu(detection.scores), flagged=cpu(detection.flagged), details=details
    )


def names() -> list[str]:
    """Names of all registered detectors."""
    return list(_REGISTRY)


def options(name: str) -> list[str]:
    """The options detector ``name`` accepts (beyond model, tokenizer and sample)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown detector {name!r}; registered detectors: {', '.join(_REGISTRY)}")
    return list(inspect.signature(_REGISTRY[name]).parameters)[3:]


def check_detection_of(detection: Detection, sample: Sample) -> None:
    """Refuse a detection made for another sample, or with NaN scores (they would rank as numbers)."""
    if len(detection.scores) != len(sample.input_ids):
        raise ValueError(
            f"detection {detection.name!r} has {len(detection.scores)} token scores but the sample has "
            f"{len(sample.input_ids)} tokens: it was made for another sample"
        )
    nan = torch.isnan(detection.scores[: sample.prompt_length].float()).nonzero().flatten()
    if nan.numel():
        raise ValueError(
            f"detection {detection.name!r} has NaN scores at context positions {nan[:8].tolist()}: NaN "
            "cannot be ranked; fix or drop the detector (a division by zero or an overflow in its scores?)"
        )


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
    if name not in _REGISTRY:
        raise ValueError(f"unknown detector {name!r}; registered detectors: {', '.join(_REGISTRY)}")
    if not isinstance(sample, Sample):
        return [found[name] for found in detect_many([name], model, tokenizer, sample, {name: options})]
    return _REGISTRY[name](model, tokenizer, sample, **options)


def attribute(
    model,
    tokenizer,
    context: str,
    query: str,
    response: str | None = None,
    method: str = "key_removal_grad",
    sources: str | Sequence[str] | Sequence[tuple[int, int]] = "sentences",
    chat: bool | None = None,
    max_new_tokens: int = 64,
    **options,
) -> Detection:
    """Which parts of ``context`` carry the answer to ``query``: ContextCite's question, in one call.

    The context becomes a sample (:meth:`probe.tasks.Sample.from_text`, cut into ``sources``); the
    model answers greedily (at most ``max_new_tokens``) unless ``response`` is given; detector
    ``method`` (any of :func:`names`, ``options`` to it) explains the response's teacher-forced
    tokens. Returns the :class:`Detection`, its sample attached (``detection.sample``, with the
    response as its answer), whose :meth:`~Detection.to_frame` has one row per source (text, score,
    rank) and whose view shows the text; :func:`probe.faithfulness.evaluate` and every metric take it.
    """
    if method not in _REGISTRY:
        raise ValueError(f"unknown method {method!r}; registered detectors: {', '.join(_REGISTRY)}")
    if response is None:
        from probe.generation import answer

        prompt = Sample.from_text(tokenizer, context, query, None, sources, chat)
        response = answer(model, tokenizer, prompt, max_new_tokens)
        if not response:
            raise ValueError("the model's greedy answer is empty: pass response=... to explain a given one")
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
    samples = [sample] if single else list(sample)
    options = dict(options or {})
    unknown = [name for name in [*names, *options] if name not in _REGISTRY]
    if unknown:
        raise ValueError(f"unknown detectors {unknown}; registered detectors: {', '.join(_REGISTRY)}")
    shared = {name: _settings(name, model, options.get(name, {})) for name in names if name in SHARED_PASS}
    layers = sorted({layer for settings in shared.values() for layer in settings.get("layers", ())})
    if "at2" in shared:  # its weights cover every head
        layers = check_layers(model, None)
    for one in samples:
        check_sample_fits(model, one, tokenizer)
    explaining = [name for name in shared if "target" in inspect.signature(_REGISTRY[name]).parameters]
    given = [options.get(name, {}).get("target") for name in explaining]
    chosen = {describe(t) if t is None or isinstance(t, Contrast) else id(t): t for t in given}
    if len(chosen) > 1:
        raise ValueError("the detectors of one shared pass explain one target: give each the same target=")
    (target,) = chosen.values() if chosen else (None,)
    attributions = [None] * len(samples)
    if layers:
        ids, targets = [s.input_ids for s in samples], [s.target_positions for s in samples]
        attributions = answer_attribution(model, ids, targets, layers, checkpoint, target=target)
    found = []
    for one, attribution in zip(samples, attributions, strict=True):
        detections = {}
        for name in names:
            if attribution is not None and name in shared:
                detection = _from_attribution(name, attribution, one, shared[name])
                detection = _with_target(detection, target if name in explaining else None)
                detections[name] = _on_cpu(dataclasses.replace(detection, name=name, sample=one))
            else:
                detections[name] = detect(name, model, tokenizer, one, **options.get(name, {}))
        found.append(detections)
    return found[0] if single else found


# how the shared pass runs and what it explains, not what a detector reads off it
PASS_OPTIONS = ("checkpoint", "target")


def _settings(name: str, model, options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of detector ``name`` (``options`` over its defaults; ``layers`` checked), but
    :data:`PASS_OPTIONS`."""
    bound = inspect.signature(_REGISTRY[name]).bind(model, None, None, **options)
    bound.apply_defaults()
    settings = {key: bound.arguments[key] for key in list(bound.arguments)[3:] if key not in PASS_OPTIONS}
    if "layers" in settings:
        settings["layers"] = check_layers(model, settings["layers"])
    if name == "at2":
        settings["weights"] = HeadWeights.for_model(model, settings["weights"])
    return settings


def top_k_mask(scores: torch.Tensor, k: int, context: int) -> torch.Tensor:
    """bool Tensor[seq]: the ``k`` highest scores among the first ``context`` tokens."""
    flagged = torch.zeros(len(scores), dtype=torch.bool)
    flagged[scores[:context].topk(min(k, context)).indices.cpu()] = True
    return flagged


# --- the detectors ---------------------------------------------------------------------------


@register("attention")
def attention(model, tokenizer, sample: Sample, layers=None, top_k: int = 30) -> Detection:
    """Attention from the answer-predicting rows, summed over heads, mean over rows and ``layers``.

    Flags the ``top_k`` context tokens (CDT §6.1 uses top-30).
    """
    layers = check_layers(model, layers)
    pattern = attention_rows(model, sample.input_ids, sample.target_positions - 1, layers)
    return _attention_from(pattern, sample, layers, top_k)


def _attention_from(pattern: torch.Tensor, sample: Sample, layers: list[int], top_k: int) -> Detection:
    """The ``attention`` detection from the answer rows' ``pattern`` Tensor[layers, heads, rows, seq]."""
    per_layer = pattern.sum(dim=1).mean(dim=1)
    scores = per_layer.mean(dim=0)
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"layers": layers, "top_k": top_k},
        details={"per_layer": per_layer},
    )


@register("fr")
def fact_retrieval(model, tokenizer, sample: Sample, layers=None, top_k: int = 30) -> Detection:
    """Fact-retrieval score (CDT §3.1): how often a token is among a head's top-k attended tokens.

    At each answer step j every head attends the ``top_k`` tokens it weights most (its set s_j).
    ``scores[i]`` = fraction of (head, step) pairs whose s_j contains token i (the per-token
    form of FR averaged over heads); ``details["per_head"]`` [layers, heads, seq] holds the
    per-head fractions, from which FR_{h,l}^{(r)} = |s_j ∩ T_r| / |T_r| follows per category,
    and ``details["mass_per_head"]`` the attention-mass variant (mean attention per head).
    Flags the ``top_k`` tokens with the highest score.
    """
    layers = check_layers(model, layers)
    pattern = attention_rows(model, sample.input_ids, sample.target_positions - 1, layers)
    return _fact_retrieval_from(pattern, sample, layers, top_k)


def _fact_retrieval_from(pattern: torch.Tensor, sample: Sample, layers: list[int], top_k: int) -> Detection:
    """The ``fr`` detection from the answer rows' ``pattern`` Tensor[layers, heads, rows, seq]."""
    context = sample.prompt_length
    chosen = pattern[..., :context].topk(min(top_k, context), dim=-1).indices
    attended = torch.zeros_like(pattern).scatter_(-1, chosen, 1.0)
    per_head = attended.mean(dim=2)  # [L, H, S]
    scores = per_head.mean(dim=(0, 1))
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, context),
        settings={"layers": layers, "top_k": top_k},
        details={"per_head": per_head, "mass_per_head": pattern.mean(dim=2)},
    )


@register("embedding_grad")
def embedding_grad(
    model,
    tokenizer,
    sample: Sample,
    p: float = 2,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """‖∂L/∂e_i‖_p of the answer loss (CDT §4.1); flags context tokens at or above the context mean.
    ``checkpoint``: see :mod:`probe.attribution`."""
    ids, targets = sample.input_ids, sample.target_positions
    scores = embedding_grad_norms(model, ids, targets, p, checkpoint, target=target)
    return _embedding_grad_from(scores, sample, p)


def _embedding_grad_from(scores: torch.Tensor, sample: Sample, p: float) -> Detection:
    """The ``embedding_grad`` detection from the gradient norms ``scores`` Tensor[seq]."""
    return Detection(scores=scores, flagged=critical_tokens(scores, sample.prompt_length), settings={"p": p})


@register("information_flow")
def information_flow(
    model,
    tokenizer,
    sample: Sample,
    layers=None,
    reduce: str = "sum_then_abs",
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """The IG / information-flow score (CDT eq. 1) from the answer rows, summed over ``layers``.

    ``details["per_layer"]`` [layers, seq] keeps each layer's score. Flags the ``top_k`` tokens.
    ``checkpoint``: see :mod:`probe.attribution`.
    """
    layers = check_layers(model, layers)
    per_layer = information_flow_per_layer(
        model, sample.input_ids, sample.target_positions, layers, reduce, checkpoint, target=target
    )
    return _information_flow_from(per_layer, sample, layers, reduce, top_k)


def _information_flow_from(
    per_layer: torch.Tensor, sample: Sample, layers: list[int], reduce: str, top_k: int
) -> Detection:
    """The ``information_flow`` detection from its ``per_layer`` scores Tensor[layers, seq]."""
    scores = per_layer.sum(dim=0)
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"layers": layers, "reduce": reduce, "top_k": top_k},
        details={"per_layer": per_layer},
    )


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


def _additive(scores: torch.Tensor, sample: Sample, top_k: int, **settings) -> Detection:
    """A detection from per-token first-order effects that add up over a source: each source's score
    is the sum over its tokens (``details["source_scores"]``); flags the ``top_k`` context tokens.
    ``settings``: the detector's other options, recorded."""
    scores = scores.detach().float().cpu()
    source_scores = torch.stack([scores[source.start : source.end].sum() for source in sample.sources])
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"top_k": top_k, **settings},
        details={"source_scores": source_scores},
    )


@register("grad_times_input")
def grad_times_input(
    model,
    tokenizer,
    sample: Sample,
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """Gradient × input on the embeddings: e_i · ∂ log P(answer)/∂e_i (Shrikumar et al. 2016), the
    first-order drop of the gold answer's log-probability when token i's embedding is zeroed.

    Signed (positive = the answer leans on the token); a source scores the sum over its tokens
    (``details["source_scores"]``). From the shared pass (:func:`detect_many`) at no extra cost.
    ``checkpoint``: see :mod:`probe.attribution`.
    """
    attribution = answer_attribution(
        model, sample.input_ids, sample.target_positions, [0], checkpoint, target=target
    )
    return _additive(attribution.grad_times_input(), sample, top_k)


@register("key_removal_grad")
def key_removal_grad(
    model,
    tokenizer,
    sample: Sample,
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    depth: float = 0.0,
    steps: int = 1,
    target: Target | None = None,
) -> Detection:
    """The key-removal gradient (:func:`probe.attribution.key_removal_gradient`): ∂ log P(answer)/∂b_j
    for a bias b_j on key j's attention logit from every later query, every layer and head, at b = 0.

    A first-order estimate of removing token j from every attention, indirect paths included (a
    second hop reading the first), at one forward and backward; a source scores the sum over its
    tokens (``details["source_scores"]``), its first-order removal effect. Flags the ``top_k``
    tokens. ``depth``, ``steps``: integrate the gradient along the path of every bias from 0 to
    −``depth`` instead (``steps`` passes); ``checkpoint``: see
    :func:`~probe.attribution.key_removal_gradient`.
    """
    gradient = key_removal_gradient(
        model, sample.input_ids, sample.target_positions, checkpoint, depth=depth, steps=steps, target=target
    )
    return _additive(gradient, sample, top_k, depth=depth, steps=steps)


@register("at2")
def at2(
    model,
    tokenizer,
    sample: Sample,
    weights: HeadWeights | str | Path | None = None,
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """AT2 (Cohen-Wang et al. 2025, "Learning to Attribute with Attention"): per-head weights, learned
    from this toolkit's ablations (:mod:`probe.at2`), on the answer rows' attention mass and saliency.

    ``weights``: a :class:`~probe.at2.HeadWeights` or its file; ``None`` = the weights bundled for the
    model's architecture (SmolLM2-135M, Gemma 3 270M; learn others' with
    ``python -m analyses.learn_head_weights``). One forward+backward pass over every layer, shared
    with the attention family in :func:`detect_many`. A source scores the sum over its tokens.
    """
    attribution = answer_attribution(
        model, sample.input_ids, sample.target_positions, None, checkpoint, target=target
    )
    return _at2_from(attribution, sample, HeadWeights.for_model(model, weights), top_k)


def _at2_from(attribution: AnswerAttribution, sample: Sample, weights: HeadWeights, top_k: int) -> Detection:
    """The ``at2`` detection from a pass over every layer."""
    detection = _additive(weights.token_scores(token_features(attribution)), sample, top_k)
    detection.settings["weights"] = weights.settings.get("name", "custom")
    return detection


@register("attn_lrp")
def attn_lrp(model, tokenizer, sample: Sample, top_k: int = 30, checkpoint: bool | str = "auto") -> Detection:
    """AttnLRP relevance (Achtibat et al., ICML 2024; :func:`probe.lrp.relevance`): gradient × input at
    the embeddings with the LRP rules for attention, products, norms and gated MLPs, explaining the
    gold answer tokens' logits. One forward and backward; a source scores the sum of its tokens'
    relevance. ``checkpoint``: see :mod:`probe.attribution`."""
    return _additive(relevance(model, sample.input_ids, sample.target_positions, checkpoint), sample, top_k)


@register("integrated_gradients")
def integrated_gradients(
    model,
    tokenizer,
    sample: Sample,
    n_steps: int = 16,
    internal_batch_size: int = 4,
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """captum ``LayerIntegratedGradients`` on the embedding layer.

    The attributed function is the mean log-probability of the answer tokens (= −L); the
    baseline puts the pad token's embedding (EOS if there is none) at every position. A token's
    score is |Σ_d attribution| (``details["signed"]`` keeps the sign).
    ``details["convergence_delta"]`` is captum's completeness gap |Σ attributions − (f(x) − f(baseline))|:
    read it before trusting the scores (long inputs and few steps make it large). ``checkpoint``:
    see :mod:`probe.attribution` (planned per batch of ``internal_batch_size`` interpolated inputs).
    """
    from captum.attr import LayerIntegratedGradients

    inner = hf_model(model)
    ids = sample.input_ids[None].to(input_device(inner))
    targets = sample.target_positions.to(ids.device)
    baseline_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def answer_log_prob(batch_ids: torch.Tensor) -> torch.Tensor:
        logits = inner(input_ids=batch_ids, use_cache=False, logits_to_keep=targets - 1).logits.float()
        answer = ids[0, targets]  # fixed: the baseline's ids are pads
        return torch.stack([-target_loss_of(target, one, answer) for one in logits])

    batch = min(internal_batch_size, n_steps)
    with (
        guarded(model, ids.shape[1], "embedding_grads", checkpoint, len(targets), batch),
        frozen_parameters(inner),
    ):
        method = LayerIntegratedGradients(answer_log_prob, inner.get_input_embeddings())
        attributions, delta = method.attribute(
            ids,
            baselines=torch.full_like(ids, baseline_id),
            n_steps=n_steps,
            internal_batch_size=internal_batch_size,
            return_convergence_delta=True,
        )
    signed = attributions[0].sum(dim=-1).detach()
    scores = signed.abs()
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"n_steps": n_steps, "top_k": top_k, "baseline_token_id": baseline_id},
        details={"signed": signed, "convergence_delta": float(delta.abs().item())},
    )


@register("lsd")
def long_short_difference(
    model, tokenizer, sample: Sample, K: int = 256, d: int = 128, alpha: float = 2.0, beta: float = -2.0
) -> Detection:
    """Long-short difference LSD(x_i) = log P(x_i | all) − log P(x_i | last K tokens) (LongPPL eq. 2).

    Flags the key tokens of LongPPL eq. 4: LSD > α and LCL > β. The shared implementation is
    :func:`probe.lsd.lsd_scores` (sliding windows of step ``d``). Tokens without a
    short-context score (the first K) get score 0 and are never flagged. The paper's K=4096
    needs samples well beyond 4K tokens; the default K=256 suits ~1K-token samples.
    """
    from probe.lsd import key_token_mask, lsd_scores

    lsd, lcl = lsd_scores(model, sample.input_ids, K=K, d=d)
    flagged = key_token_mask(lsd, lcl, alpha, beta)
    flagged[sample.prompt_length :] = False
    return Detection(
        scores=lsd.nan_to_num(0.0),
        flagged=flagged,
        settings={"K": K, "d": d, "alpha": alpha, "beta": beta},
        details={"lcl": lcl},
    )


@register("random")
def random_scores(model, tokenizer, sample: Sample, seed: int = 0, top_k: int = 30) -> Detection:
    """Uniform random scores (seeded): the chance level of every metric."""
    scores = torch.rand(len(sample.input_ids), generator=torch.Generator().manual_seed(seed))
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"seed": seed, "top_k": top_k},
    )


@register("recency")
def recency(model, tokenizer, sample: Sample, top_k: int = 30) -> Detection:
    """Later tokens score higher (position / seq): the "the model reads the end" baseline."""
    scores = torch.arange(len(sample.input_ids), dtype=torch.float32) / len(sample.input_ids)
    return Detection(
        scores=scores, flagged=top_k_mask(scores, top_k, sample.prompt_length), settings={"top_k": top_k}
    )


_WORD = re.compile(r"[A-Za-z0-9]+")
_STOPWORDS = frozenset(
    "a an and are as at be before by did do does for from has have he her his in is it its of on or she "
    "that the their them they this to was were what where which who why with you your".split()
)


@register("lexical_overlap")
def lexical_overlap(model, tokenizer, sample: Sample) -> Detection:
    """1 for context tokens inside a word that also occurs in the question (LOGO's chunk scoring, per word).

    Words are case-folded alphanumeric runs of the sample text, stop words excluded; tokens map
    to words through the sample's token offsets. Flags every overlapping token.
    """
    (q_start, q_end), *_ = sample.char_spans["question"]
    question_words = {w.lower() for w in _WORD.findall(sample.text[q_start:q_end])} - _STOPWORDS
    overlapping = np.zeros(len(sample.text), dtype=bool)
    for match in _WORD.finditer(sample.text):
        if match.group().lower() in question_words:
            overlapping[match.start() : match.end()] = True
    scores = torch.tensor([float(overlapping[start:end].any()) for start, end in sample.offsets])
    scores[sample.prompt_length :] = 0.0
    question = torch.zeros_like(scores, dtype=torch.bool)
    for start, end in sample.spans["question"]:
        question[start:end] = True
    scores[question] = 0.0  # the question trivially overlaps itself
    return Detection(scores=scores, flagged=scores > 0, settings={"stopwords": len(_STOPWORDS)})


# --- ablation detectors: one score per source, from key-masked passes (probe.faithfulness) -------


def spread_over_tokens(values: torch.Tensor, sample: Sample) -> torch.Tensor:
    """Tensor[seq]: each token of a source gets its source's value (``values`` [sources]); others 0."""
    scores = torch.zeros(len(sample.input_ids))
    for source, value in zip(sample.sources, values.tolist(), strict=True):
        scores[source.start : source.end] = value
    return scores


@register("leave_one_out")
def leave_one_out(
    model,
    tokenizer,
    sample: Sample,
    reuse_prefix: bool = True,
    top_m: int | None = None,
    rank_by: str = "key_removal_grad",
    block: int = 1,
    refine: int = 4,
    target: Target | None = None,
) -> Detection:
    """Leave-one-out: a source's score is ``lp(full) − lp(without it)``, the drop of the gold answer's
    log-probability when it is removed (:func:`probe.faithfulness.answer_scores`), one pass per source.

    The gold standard of comprehensiveness at k = 1. Two cheaper forms, after AttriBoT (Liu et al.,
    ICLR 2025), exact where they measure:

    - ``top_m``: only the ``top_m`` sources ranked highest by detector ``rank_by`` are removed one by
      one; every other source scores ``rank_by``'s source score times the least-squares scale that maps
      it onto the measured drops (0 when fewer than two were measured);
    - ``block > 1`` (hierarchical): each run of ``block`` consecutive sources is removed at once, then
      the ``refine`` blocks with the largest drops are split and their sources removed one by one;
      a source of an unrefined block scores its block's drop shared equally.

    ``details``: ``source_scores`` Tensor[sources], ``measured`` BoolTensor[sources] (the source's own
    removal was run), ``passes`` (masked passes, the full pass included), ``full_logprob``. Each token
    carries its source's score. Flags the sources whose removal lowers the log-probability.
    """
    n_sources = len(sample.sources)
    if top_m is not None and block > 1:
        raise ValueError("choose one way to prune leave-one-out: top_m or block > 1, not both")
    if block < 1 or refine < 0 or (top_m is not None and top_m < 1):
        raise ValueError(f"block must be >= 1, refine >= 0 and top_m >= 1, got {block}, {refine}, {top_m}")
    none = torch.zeros(1, n_sources, dtype=torch.bool)
    settings = {
        "reuse_prefix": reuse_prefix,
        "top_m": top_m,
        "rank_by": rank_by,
        "block": block,
        "refine": refine,
    }
    if top_m is not None:
        ranking = {"target": target} if "target" in options(rank_by) else {}
        cheap = detect(rank_by, model, tokenizer, sample, **ranking).source_scores(sample)
        chosen = torch.argsort(-cheap, stable=True)[: min(top_m, n_sources)]
        logprob = answer_scores(
            model, sample, torch.cat([none, _single(chosen, n_sources)]), reuse_prefix, target=target
        ).logprob
        drops = logprob[0] - logprob[1:]
        scale = float(cheap[chosen] @ drops / (cheap[chosen] @ cheap[chosen])) if len(chosen) > 1 else 0.0
        effect = cheap * scale
        effect[chosen] = drops
        measured, passes = torch.zeros(n_sources, dtype=torch.bool), len(logprob)
        measured[chosen] = True
    elif block > 1:
        starts = torch.arange(0, n_sources, block)
        blocks = torch.zeros(len(starts), n_sources, dtype=torch.bool)
        for row, first in enumerate(starts.tolist()):
            blocks[row, first : first + block] = True
        coarse = answer_scores(model, sample, torch.cat([none, blocks]), reuse_prefix, target=target).logprob
        block_drops = coarse[0] - coarse[1:]
        refined = torch.argsort(-block_drops, stable=True)[:refine]
        chosen = blocks[refined].any(0).nonzero()[:, 0]
        fine = answer_scores(model, sample, _single(chosen, n_sources), reuse_prefix, target=target).logprob
        effect = (blocks.float() * (block_drops / blocks.sum(1))[:, None]).sum(0)
        effect[chosen] = coarse[0] - fine
        measured, passes = blocks[refined].any(0), len(coarse) + len(fine)
        logprob = coarse
    else:
        everyone = torch.cat([none, _single(torch.arange(n_sources), n_sources)])
        logprob = answer_scores(model, sample, everyone, reuse_prefix, target=target).logprob
        effect, measured, passes = (
            logprob[0] - logprob[1:],
            torch.ones(n_sources, dtype=torch.bool),
            len(logprob),
        )
    scores = spread_over_tokens(effect, sample)
    return Detection(
        scores=scores,
        flagged=scores > 0,
        settings=settings,
        details={
            "source_scores": effect,
            "measured": measured,
            "passes": passes,
            "full_logprob": float(logprob[0]),
        },
    )


def _single(chosen: torch.Tensor, n_sources: int) -> torch.Tensor:
    """BoolTensor[len(chosen), sources]: one mask per chosen source, removing it alone."""
    return torch.eye(n_sources, dtype=torch.bool)[chosen]


@register("context_cite")
def context_cite(
    model,
    tokenizer,
    sample: Sample,
    n_masks: int = 64,
    keep: float = 0.5,
    alpha: float = 0.01,
    holdout: float = 0.25,
    seed: int = 1,
    target: Target | None = None,
) -> Detection:
    """ContextCite's surrogate (Cohen-Wang et al. 2024): key-mask random subsets of the sources (each
    kept with probability ``keep``), fit a sparse linear model (scikit-learn LASSO, ``alpha``, on
    standardized masks) from the kept-source indicators to the gold answer's log-probability; a
    source's score is its weight in log-probability per source kept.

    The target is the log-probability (ContextCite uses the logit-probability log p − log(1 − p)).
    A ``holdout`` share of the masks is left out of the fit: ``details["heldout_spearman"]`` and
    ``details["heldout_r2"]`` say how well the surrogate predicts them (read them before trusting
    the weights). ``seed`` must differ from the seed of the masks a faithfulness evaluation uses.
    Flags the sources with positive weight.
    """
    from sklearn.linear_model import Lasso
    from sklearn.metrics import r2_score
    from sklearn.preprocessing import StandardScaler

    n_sources = len(sample.sources)
    kept = random_masks(n_sources, n_masks, keep, seed)
    logprob = answer_scores(model, sample, ~kept, target=target).logprob
    n_fit = n_masks - max(1, round(holdout * n_masks))
    scaler = StandardScaler().fit(kept[:n_fit].double().numpy())
    lasso = Lasso(alpha=alpha).fit(scaler.transform(kept[:n_fit].double().numpy()), logprob[:n_fit].numpy())
    weights = torch.tensor(lasso.coef_ / np.where(scaler.scale_ > 0, scaler.scale_, 1.0), dtype=torch.float32)
    predicted = lasso.predict(scaler.transform(kept[n_fit:].double().numpy()))
    scores = spread_over_tokens(weights, sample)
    return Detection(
        scores=scores,
        flagged=scores > 0,
        settings={"n_masks": n_masks, "keep": keep, "alpha": alpha, "holdout": holdout, "seed": seed},
        details={
            "source_scores": weights,
            "heldout_spearman": lds(weights, kept[n_fit:], logprob[n_fit:]),
            "heldout_r2": float(r2_score(logprob[n_fit:].numpy(), predicted)),
        },
    )
