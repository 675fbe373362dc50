"""What a detector found on one sample: :class:`Detection`, its scores, settings, cost and certificate,
its views (token view, frames) and its file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from probe import views
from probe.errors import InvalidValueError
from probe.faithfulness import source_scores
from probe.results import read_json, reading, write_json
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
    :func:`~probe.detectors.detect_many`'s shared pass gets that pass's time over its samples); None
    where it was not measured: some of its passes were read from a :class:`probe.journal.Journal` an
    earlier process wrote (a resumed run).
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
        return views.token_view(sample, self.scores, f"{self.name or 'detection'} scores", self.certificate())

    def certificate(self) -> str:
        """What this detection measured exactly and how it scored the rest, in one line ("" for a detection
        that measured nothing): the sources removed one by one with their drops, the detector and scale
        that scored the others, and the check of the ranking's head (its sources removed together)."""
        details = self.details
        if "measured" not in details:
            return ""
        scores, measured = details["source_scores"], details["measured"].nonzero().flatten().tolist()
        drops = ", ".join(f"#{i} {float(scores[i]):.2f}" for i in measured)
        parts = [f"measured exactly: {len(measured)} of {len(scores)} sources (drops in nats: {drops})"]
        if "estimated_by" in details and len(measured) < len(scores):
            times = "" if details["scale"] == 1 else f" × {details['scale']:.3g}"
            parts.append(f"the others: {details['estimated_by']}{times}")
        if "head_drop" in details:
            parts.append(
                f"the top {len(details['head'])} removed together lose {details['head_drop']:.2f} nats, "
                f"their scores sum to {details['head_sum']:.2f}"
            )
        return "; ".join(parts)

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
        span, text, score and rank, 1 = highest; ``measured`` where the detector removed sources: whether
        the score is the source's exact drop, :meth:`certificate`). ``rows`` defaults to :attr:`rows`."""
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
        if "measured" in self.details:  # the certificate: which scores are exact drops
            frame["measured"] = self.details["measured"].bool().numpy()
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
