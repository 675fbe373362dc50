"""Self-contained HTML views: a sample's tokens shaded by a detector's scores, a retrieval heatmap.

Pages need no network (inline CSS, no script, no CDN), so they open offline and in a notebook:
:class:`~probe.detectors.Detection`, :class:`~probe.tasks.Sample` and
:class:`~probe.probes.retrieval.RetrievalScores` show themselves through ``_repr_html_`` and write a page
with ``save_html(path)``.

Token view: the prompt as text (each token is the text from the end of the previous token to its
own end, so whitespace shows as in the prompt), shaded by its score (min–max over the context,
the answer's scores excluded), every span outlined in its category's colour, the gold answer
underlined twice, a legend; hovering a token shows its position, score and category.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from probe.atomic import atomic_write
from probe.errors import InvalidValueError

COLOURS = {
    "supporting": "#1b9e77",
    "interference": "#d95f02",
    "noise": "#7570b3",
    "low_frequency": "#e7298a",
    "context": "#a6761d",
    "question": "#66a61e",
    "answer": "#000000",
}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; max-width: 70em; }
h2 { font-size: 1.1em; } .meta { color: #555; font-size: 0.9em; }
.tokens { font-family: ui-monospace, monospace; font-size: 0.85em; line-height: 1.9; white-space: pre-wrap;
          border: 1px solid #ddd; padding: 0.8em; }
.tok { border-radius: 2px; } .answer { text-decoration: underline double; font-weight: bold; }
.legend span { display: inline-block; margin-right: 1.2em; padding: 0 0.3em; }
table.heatmap { border-collapse: collapse; font-size: 0.75em; }
table.heatmap td, table.heatmap th { width: 2.2em; height: 1.4em; text-align: center;
                                     border: 1px solid #fff; }
"""


def page(title: str, body: str) -> str:
    """A whole HTML document with the shared style."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def token_view(sample, scores: Sequence[float] | None = None, title: str = "", note: str = "") -> str:
    """The token view of ``sample`` (see the module docstring) as an HTML fragment ``<div>``.

    ``scores``: one per token (Tensor[seq] or array), or ``None`` for the spans alone. ``note``: a line
    shown under the title (a detection's certificate).
    """
    text, offsets = sample.text, np.asarray(sample.offsets)
    categories = np.asarray(sample.categories)
    values = None if scores is None else np.asarray(scores, dtype=float).reshape(-1)
    shade = _shades(values, sample.prompt_length, len(offsets))
    answer = set(range(*sample.spans["answer"][0])) if sample.spans.get("answer") else set()
    parts, previous = [], 0
    for i, end in enumerate(offsets[:, 1]):
        piece = text[previous:end] if end > previous else ""
        previous = max(previous, int(end))
        category = str(categories[i])
        style = f"background: rgba(214, 39, 40, {shade[i]:.3f});" if shade is not None else ""
        if category in COLOURS and category != "answer":
            style += f" box-shadow: inset 0 -3px 0 {COLOURS[category]};"
        value = "" if values is None else f", score {values[i]:.4g}"
        classes = "tok answer" if i in answer else "tok"
        parts.append(
            f'<span class="{classes}" style="{style}" title="{i}: {html.escape(category)}{value}">'
            f"{html.escape(piece)}</span>"
        )
    legend = "".join(
        f'<span style="box-shadow: inset 0 -3px 0 {colour}">{name}</span>'
        for name, colour in COLOURS.items()
        if name in set(categories) and name != "answer"
    )
    shading = "" if scores is None else "; red = higher score (min-max over the prompt)"
    meta = f"{sample.task}, seed {sample.seed}, {len(offsets)} tokens, answer {sample.answer!r}{shading}"
    return (
        f'<div class="longprobe-view"><h2>{html.escape(title)}</h2><p class="meta">{html.escape(meta)}</p>'
        + (f'<p class="note">{html.escape(note)}</p>' if note else "")
        + f'<p class="legend">{legend}<span class="answer">answer</span></p>'
        f'<div class="tokens">{"".join(parts)}</div></div>'
    )


def _shades(scores, context: int, n: int) -> np.ndarray | None:
    """Opacity in [0, 0.85] per token: min-max of the scores over the first ``context`` tokens."""
    if scores is None:
        return None
    values = np.asarray(scores, dtype=float).reshape(-1)
    if len(values) != n:
        raise InvalidValueError(f"{len(values)} scores for a {n}-token sample: give one score per token")
    finite = values[:context][np.isfinite(values[:context])]
    if finite.size == 0:
        return np.zeros(n)
    low, high = finite.min(), finite.max()
    scaled = (np.nan_to_num(values, nan=low) - low) / (high - low if high > low else 1.0)
    return 0.85 * np.clip(scaled, 0.0, 1.0)


def heatmap(scores: np.ndarray, title: str, row_label: str = "layer", column_label: str = "head") -> str:
    """An HTML table shading ``scores`` [rows, columns] (white → dark blue, min–max), values on hover."""
    scores = np.asarray(scores, dtype=float)
    low, high = np.nanmin(scores), np.nanmax(scores)
    scaled = (scores - low) / (high - low if high > low else 1.0)
    header = "".join(f"<th>{c}</th>" for c in range(scores.shape[1]))
    rows = []
    for r, row in enumerate(scaled):
        cells = "".join(
            f'<td style="background: rgba(31, 119, 180, {0.95 * v:.3f})" '
            f'title="{row_label} {r}, {column_label} {c}: {scores[r, c]:.4g}"></td>'
            for c, v in enumerate(np.nan_to_num(row))
        )
        rows.append(f"<tr><th>{r}</th>{cells}</tr>")
    meta = f"rows: {row_label}s, columns: {column_label}s; darker = higher (max {high:.3g}, min {low:.3g})"
    return (
        f'<div class="longprobe-view"><h2>{html.escape(title)}</h2><p class="meta">{html.escape(meta)}</p>'
        f'<table class="heatmap"><tr><th></th>{header}</tr>{"".join(rows)}</table></div>'
    )


def save_html(path: str | Path, fragment: str, title: str) -> Path:
    """Write ``fragment`` as a whole self-contained page, atomically."""
    return atomic_write(path, lambda tmp: tmp.write_text(page(title, fragment), encoding="utf-8"))
