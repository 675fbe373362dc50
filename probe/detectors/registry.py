"""The detector registry: :class:`Detection`, ``@register(name)``, and what every detector shares.

A detector is named once, in ``@register(name)``; the registry stamps the name on its result, checks
the sample fits the model, records a non-default target among the settings and moves the result's
tensors to the CPU. :func:`names` lists the registered detectors in registration order.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probe import views
from probe.checks import check_option, check_sample, check_sample_fits, check_tokenizer
from probe.errors import InvalidTypeError, InvalidValueError
from probe.faithfulness import source_scores
from probe.results import read_json, reading, write_json
from probe.target import Contrast, describe
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
    ``seconds``: what it cost, wall time (set by the registry; a detection read off
    :func:`~probe.detectors.detect_many`'s shared pass gets that pass's time over its samples).
    """

    scores: torch.Tensor
    flagged: torch.Tensor
    settings: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    sample: Sample | None = field(default=None, repr=False, compare=False)
    rows: str = "token"
    seconds: float | None = field(default=None, compare=False)

    def _view(self, sample: Sample | None) -> str:
        sample = sample if sample is not None else self.sample
        if sample is None:
            raise InvalidValueError(
                "this detection carries no sample (loaded from a file?): pass show(sample=...)"
            )
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
            raise InvalidValueError("this detection carries no sample (loaded from a file?): pass the sample")
        return source_scores(self.scores, sample.sources, reduce)

    def to_frame(self, tokenizer=None, sample: Sample | None = None, rows: str | None = None) -> pd.DataFrame:
        """One row per token (position, score, flagged; token text and category given a sample and
        tokenizer) or, with ``rows="source"``, one row per source of the sample (its category, token
        span, text, score and rank, 1 = highest). ``rows`` defaults to :attr:`rows`."""
        rows = rows or self.rows
        if rows == "source":
            return self._source_frame(sample if sample is not None else self.sample)
        if rows != "token":
            raise InvalidValueError(f"rows must be 'token' or 'source', got {rows!r}")
        sample = sample if sample is not None or tokenizer is None else self.sample
        if sample is not None and len(sample.input_ids) != len(self.scores):
            raise InvalidValueError(
                f"the sample has {len(sample.input_ids)} tokens, this detection {len(self.scores)} scores: "
                "pass the sample it was made for"
            )
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
            raise InvalidValueError("a per-source frame needs the sample: pass to_frame(sample=...)")
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
            "seconds": self.seconds,
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
        with reading(path, "Detection"):
            details = {k: torch.tensor(v) if isinstance(v, list) else v for k, v in record["details"].items()}
            return cls(
                name=record.get("name"),
                rows=record.get("rows", "token"),
                seconds=record.get("seconds"),
                scores=torch.tensor(record["scores"]),
                flagged=torch.tensor(record["flagged"], dtype=torch.bool),
                settings=record["settings"],
                details=details,
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
            raise InvalidValueError(f"a detector named {name!r} is already registered")
        if list(inspect.signature(fn).parameters)[:3] != ["model", "tokenizer", "sample"]:
            raise InvalidTypeError(f"detector {name!r} must take (model, tokenizer, sample, **options)")

        @functools.wraps(fn)
        def named(model, tokenizer, sample: Sample, **options) -> Detection:
            check_options(name, options)
            check_tokenizer(tokenizer, optional=True)  # the sample carries its ids
            check_sample(sample)
            check_answered(sample)
            if isinstance(options.get("target"), Contrast):  # before any model work
                options["target"].check(sample.input_ids[sample.target_positions])
            check_sample_fits(model, sample, tokenizer)
            start = time.perf_counter()
            detection = _on_cpu(_with_target(fn(model, tokenizer, sample, **options), options.get("target")))
            seconds = time.perf_counter() - start
            return dataclasses.replace(detection, name=name, sample=sample, seconds=seconds)

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


def lookup(name: str) -> Detector:
    """The registered detector ``name``; the one place an unknown name is refused."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise InvalidValueError(f"unknown detector {name!r}; registered detectors: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def options(name: str) -> list[str]:
    """The options detector ``name`` accepts (beyond model, tokenizer and sample)."""
    return list(inspect.signature(lookup(name)).parameters)[3:]


def check_options(name: str, given: dict[str, Any]) -> None:
    """Refuse an option detector ``name`` does not take (a ``TypeError``, as Python refuses an unexpected
    keyword), and a value its annotation rules out
    (:func:`probe.checks.check_option`), before any model work."""
    parameters = inspect.signature(lookup(name)).parameters
    unknown = sorted(set(given) - set(list(parameters)[3:]))
    if unknown:
        raise InvalidTypeError(f"detector {name!r} takes no option {unknown}; its options: {options(name)}")
    for option, value in given.items():
        check_option(value, str(parameters[option].annotation), f"detector {name!r} option {option}")


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
