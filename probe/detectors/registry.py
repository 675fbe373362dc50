"""The detector registry: :class:`Detection`, ``@register(name)``, and what every detector shares.

A detector is named once, in ``@register(name)``, which also says how it runs: on passes of its own,
or read off the one shared answer-attribution pass (``shared_pass=``, :class:`SharedPass`). A name is
looked up once, by :func:`resolve`, into a :class:`Registered` that every later step uses. The
registry stamps the name on its result, checks the sample fits the model, records a non-default target
among the settings and moves the result's tensors to the CPU. :func:`names` lists the registered
detectors in registration order: the one-pass detectors, the baselines, the ablations
(:mod:`probe.detectors` imports their modules in that order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from probe import journal
from probe.checks import check_layers, check_option, check_sample_fits, check_tokenizer
from probe.detectors.detection import Detection
from probe.errors import InvalidTypeError, InvalidValueError
from probe.probes.attribution import AnswerAttribution, answer_attribution, attention_rows
from probe.target import CHECKED, describe, vocabulary_size
from probe.tasks import Sample, check_sample

Detector = Callable[..., Detection]


@dataclass(frozen=True)
class SharedPass:
    """How a detector reads the shared answer-attribution pass
    (:func:`probe.probes.attribution.answer_attribution`).

    ``layers``: the layers the pass must capture for it: ``"layers"`` (those its ``layers`` option names),
    ``"all"``, or ``"none"`` (it reads no attention rows). ``backward``: whether it reads gradients; one
    that reads none runs alone as a forward pass (:func:`probe.probes.attribution.attention_rows`).
    ``key_bias``: whether it reads the gradient of a key bias at 0
    (:meth:`~probe.probes.attribution.AnswerAttribution.key_removal_gradient`), which the pass then holds.
    """

    layers: str = "layers"
    backward: bool = True
    key_bias: bool = False

    def __post_init__(self) -> None:
        if self.layers not in ("layers", "all", "none"):
            raise InvalidValueError(f"SharedPass.layers: 'layers', 'all' or 'none', not {self.layers!r}")
        if self.key_bias and not self.backward:
            raise InvalidValueError("SharedPass(key_bias=True) reads a gradient: it needs backward=True")

    def layers_of(self, model, read: Callable[..., Detection], options: dict[str, Any]) -> list[int]:
        """The layers the pass captures for a detector reading it with ``options``."""
        if self.layers == "none":
            return []
        if self.layers == "all":
            return check_layers(model, None)
        default = inspect.signature(read).parameters["layers"].default
        return check_layers(model, options.get("layers", default))


PASS_OPTIONS = ("checkpoint", "target")  # how the shared pass runs and what it explains
RANKING_OPTIONS = ("rank_by", "top_m", "ranking")  # a detector pruned by the rankings of others


@dataclass(frozen=True)
class Registered:
    """A registered detector, as :func:`resolve` gives it for its name: all that running it needs.

    ``detector``: what :func:`~probe.detectors.detect` calls, ``(model, tokenizer, sample, **options)``
    (the registry's checked wrapper, or what :func:`replace` put in its place). ``shared_pass`` and
    ``reader``: how it reads the shared pass and the function that reads it, ``None`` for a detector
    running passes of its own. ``takes_ranking``: it takes the options :data:`RANKING_OPTIONS`, so,
    pruned (``top_m``), it ranks sources by the detectors ``rank_by`` names and takes their source scores
    as ``ranking`` instead of running them (``leave_one_out``): :func:`~probe.detectors.detect_many`
    hands over those it has made already.
    """

    name: str
    detector: Detector
    shared_pass: SharedPass | None = None
    reader: Callable[..., Detection] | None = None
    takes_ranking: bool = False

    @property
    def options(self) -> list[str]:
        """The options it accepts (beyond model, tokenizer and sample)."""
        return list(inspect.signature(self.detector).parameters)[3:]

    def _refuse_unknown(self, given: Iterable[str]) -> None:
        """Refuse options it does not take, with a ``TypeError`` (as Python refuses an unexpected keyword)
        that lists the options it does take."""
        accepted = self.options
        unknown = sorted(set(given) - set(accepted))
        if unknown:
            listed = ", ".join(map(repr, unknown))
            raise InvalidTypeError(
                f"detector {self.name!r} takes no option {listed}; its options: {accepted}"
            )

    def option_default(self, option: str) -> Any:
        """The default value of its ``option``, as its signature gives it."""
        self._refuse_unknown([option])
        return inspect.signature(self.detector).parameters[option].default

    def check_options(self, given: Mapping[str, Any]) -> None:
        """Refuse an option it does not take (a ``TypeError`` listing those it takes) and a value the
        option's annotation rules out (:func:`probe.checks.check_option`), before any model work."""
        self._refuse_unknown(given)
        parameters = inspect.signature(self.detector).parameters
        for option, value in given.items():
            check_option(value, str(parameters[option].annotation), f"detector {self.name!r} option {option}")


_REGISTRY: dict[str, Registered] = {}


def register(name: str, shared_pass: SharedPass | None = None) -> Callable[[Callable], Detector]:
    """Add a detector to the registry as ``name``.

    Without ``shared_pass`` the function is the detector, ``fn(model, tokenizer, sample, **options)``.
    With one, it is a reader of the shared pass, ``fn(model, attribution, sample, **options)`` (an
    :class:`~probe.probes.attribution.AnswerAttribution` over the layers ``shared_pass`` asks for), and the
    registry makes the detector: one pass, then ``fn``; a detector that reads gradients gains the pass's
    options ``checkpoint`` (:mod:`probe.probes.attribution`) and ``target`` (:mod:`probe.target`).
    :func:`~probe.detectors.detect_many` reads every such detector off one pass. A detector taking the
    options :data:`RANKING_OPTIONS` is one that ranks by others (:attr:`Registered.takes_ranking`).

    Returns the detector, its :class:`Detection` carrying ``name`` (a detector never writes its own
    name). Refuses a name already taken and a function with another signature.
    """

    def add(fn: Callable) -> Detector:
        if name in _REGISTRY:
            raise InvalidValueError(f"a detector named {name!r} is already registered")
        first = ["model", "tokenizer" if shared_pass is None else "attribution", "sample"]
        if list(inspect.signature(fn).parameters)[:3] != first:
            raise InvalidTypeError(f"detector {name!r} must take ({', '.join(first)}, **options)")
        run = fn if shared_pass is None else _alone(fn, shared_pass)

        @functools.wraps(fn)
        def named(model, tokenizer, sample: Sample, **options) -> Detection:
            registered.check_options(options)
            check_tokenizer(tokenizer, optional=True)  # the sample carries its ids
            check_sample(sample)
            check_answered(sample)
            if isinstance(options.get("target"), CHECKED):  # before any model work
                options["target"].check(sample.input_ids[sample.target_positions], vocabulary_size(model))
            check_sample_fits(model, sample, tokenizer)
            journaled = journal.active()
            resumed = journaled.resumed if journaled is not None else 0
            start = time.perf_counter()
            detection = run(model, tokenizer, sample, **options)
            seconds = time.perf_counter() - start
            if journaled is not None and journaled.resumed > resumed:  # an earlier process ran some passes
                seconds = None
            return finished(detection, name, sample, seconds, options.get("target"))

        named.__signature__ = inspect.signature(run)
        takes_ranking = set(RANKING_OPTIONS) <= set(inspect.signature(run).parameters)
        reader = None if shared_pass is None else fn
        registered = Registered(name, named, shared_pass, reader, takes_ranking)
        _REGISTRY[name] = registered
        return named

    return add


@contextlib.contextmanager
def sandbox() -> Iterator[None]:
    """A block in which :func:`register` and :func:`replace` change the registry only until it ends (even
    by an exception): a detector tried in a notebook or a test, or one wrapped to count its calls, leaves
    the registry as it was."""
    saved = dict(_REGISTRY)
    try:
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)


def replace(name: str, detector: Detector) -> Detector:
    """Put ``detector`` in place of the registered detector ``name`` (e.g. it, wrapped to count its calls)
    and return the one it replaces. Meant inside :func:`sandbox`, which puts the original back."""
    replaced = resolve(name)
    if not callable(detector):
        raise InvalidTypeError(
            f"detector must be callable (model, tokenizer, sample, **options), got {detector!r}"
        )
    _REGISTRY[name] = dataclasses.replace(replaced, detector=detector)
    return replaced.detector


def _alone(read: Callable[..., Detection], shared_pass: SharedPass) -> Detector:
    """The detector that runs the pass ``read`` needs on one sample, then reads it."""
    positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    own = [p.replace(kind=keyword) for p in list(inspect.signature(read).parameters.values())[3:]]
    pass_options = [
        inspect.Parameter("checkpoint", keyword, default="auto", annotation="bool | str"),
        inspect.Parameter("target", keyword, default=None, annotation="Target | None"),
    ]

    def alone(model, tokenizer, sample: Sample, checkpoint: bool | str = "auto", target=None, **options):
        layers = shared_pass.layers_of(model, read, options)
        (attribution,) = run_pass(model, [sample], layers, shared_pass, checkpoint, target)
        return read(model, attribution, sample, **options)

    parameters = [inspect.Parameter(p, positional) for p in ("model", "tokenizer", "sample")]
    alone.__signature__ = inspect.Signature(parameters + own + (pass_options if shared_pass.backward else []))
    return alone


def run_pass(
    model,
    samples: list[Sample],
    layers: list[int],
    needs: SharedPass,
    checkpoint: bool | str = "auto",
    target=None,
) -> list[AnswerAttribution]:
    """The shared pass over ``samples`` (one pass for all): an answer attribution of ``layers`` each, from a
    forward and backward pass (with a key bias if ``needs.key_bias``), or from a forward pass alone
    (:meth:`AnswerAttribution.forward_only`) when ``needs.backward`` is false. No ``layers``: no reader
    needs attention rows, any layer will do."""
    layers = layers or [0]
    ids, targets = [s.input_ids for s in samples], [s.target_positions for s in samples]
    if needs.backward:
        return answer_attribution(
            model, ids, targets, layers, checkpoint, target=target, key_bias=needs.key_bias
        )
    patterns = attention_rows(model, ids, [t - 1 for t in targets], layers)
    return [AnswerAttribution.forward_only(p, layers, t) for p, t in zip(patterns, targets, strict=True)]


def shared_pass(name: str) -> tuple[SharedPass, Callable[..., Detection]] | None:
    """How detector ``name`` reads the shared pass and its reader, or ``None`` if it runs its own."""
    registered = resolve(name)
    return None if registered.shared_pass is None else (registered.shared_pass, registered.reader)


def finished(
    detection: Detection, name: str, sample: Sample, seconds: float | None, target=None
) -> Detection:
    """A detector's result as the registry hands it out: carrying its ``name``, ``sample`` and
    ``seconds``, its ``target`` among its settings unless the default (as text:
    :func:`probe.target.describe`), its tensors on the CPU (:func:`_on_cpu`)."""
    settings = detection.settings if target is None else {**detection.settings, "target": describe(target)}
    found = dataclasses.replace(detection, name=name, sample=sample, seconds=seconds, settings=settings)
    return _on_cpu(found)


def _on_cpu(detection: Detection) -> Detection:
    """The detection with its tensors on the CPU, detached, half-precision floats as float32: results
    are data (numpy, pandas and the views read them), wherever and in whatever dtype the model ran."""

    def cpu(value):
        if not torch.is_tensor(value):
            return value
        value = value.detach().cpu()
        if not value.is_floating_point():
            return value
        return value.to(torch.promote_types(value.dtype, torch.float32))

    details = {key: cpu(value) for key, value in detection.details.items()}
    return dataclasses.replace(
        detection, scores=cpu(detection.scores), flagged=cpu(detection.flagged), details=details
    )


def names() -> list[str]:
    """Names of all registered detectors."""
    return list(_REGISTRY)


def resolve(name: str) -> Registered:
    """The registered detector ``name``; the one place a name is looked up and an unknown one refused."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise InvalidValueError(f"unknown detector {name!r}; registered detectors: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def lookup(name: str) -> Detector:
    """The registered detector ``name``, the function :func:`~probe.detectors.detect` calls."""
    return resolve(name).detector


def looked_up(names: str | Sequence[str]) -> list[str]:
    """``names`` (one detector name or several) as a list, every name checked by :func:`resolve`."""
    listed = [names] if isinstance(names, str) else list(names)
    for name in listed:
        resolve(name)
    return listed


def options(name: str) -> list[str]:
    """The options detector ``name`` accepts (beyond model, tokenizer and sample)."""
    return resolve(name).options


def option_default(name: str, option: str) -> Any:
    """The default value of detector ``name``'s ``option``, as its signature gives it."""
    return resolve(name).option_default(option)


def check_answered(sample: Sample) -> None:
    """Refuse a prompt-only sample: a detector explains the answer's tokens, and it has none."""
    if len(sample.target_positions) == 0:
        raise InvalidValueError(
            "the sample has no answer to explain (a prompt only): give response= to Sample.from_text, or "
            "let probe.attribute generate the model's own answer"
        )


def check_detection_of(detection: Detection, sample: Sample) -> None:
    """Refuse a detection made for another sample, or with NaN scores (they would rank as numbers)."""
    if len(detection.scores) != len(sample.input_ids):
        raise InvalidValueError(
            f"detection {detection.name!r} has {len(detection.scores)} token scores but the sample has "
            f"{len(sample.input_ids)} tokens: it was made for another sample"
        )
    nan = torch.isnan(detection.scores[: sample.prompt_length].float()).nonzero().flatten()
    if nan.numel():
        raise InvalidValueError(
            f"detection {detection.name!r} has NaN scores at context positions {nan[:8].tolist()}: NaN "
            "cannot be ranked; fix or drop the detector (a division by zero or an overflow in its scores?)"
        )


def top_k_mask(scores: torch.Tensor, k: int, context: int) -> torch.Tensor:
    """bool Tensor[seq]: the ``k`` highest scores among the first ``context`` tokens."""
    flagged = torch.zeros(len(scores), dtype=torch.bool)
    flagged[scores[:context].topk(min(k, context)).indices.cpu()] = True
    return flagged


def spread_over_tokens(values: torch.Tensor, sample: Sample) -> torch.Tensor:
    """Tensor[seq]: each token of a source gets its source's value (``values`` [sources]); others 0."""
    scores = torch.zeros(len(sample.input_ids))
    for source, value in zip(sample.sources, values.tolist(), strict=True):
        scores[source.start : source.end] = value
    return scores
