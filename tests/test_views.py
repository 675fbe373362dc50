"""HTML views: structure of the token view and the retrieval heatmap (no browser needed)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

import probe
from probe import tasks, views
from probe.models import converted_folder


class Elements(HTMLParser):
    """Every start tag with its attributes, and the text inside each token span."""

    def __init__(self, html: str):
        super().__init__()
        self.tags, self.tokens, self._in_token = [], [], False
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "span" and "tok" in attrs.get("class", "").split():
            self.tokens.append({"attrs": attrs, "text": ""})
            self._in_token = True

    def handle_endtag(self, tag):
        if tag == "span":
            self._in_token = False

    def handle_data(self, data):
        if self._in_token:
            self.tokens[-1]["text"] += data


@pytest.fixture(scope="module")
def found():
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    sample = tasks.make("multihop-2", tokenizer, 200, seed=1)
    model = probe.tiny_model("llama", vocab_size=len(tokenizer))
    return sample, probe.detect("information_flow", model, tokenizer, sample)


def _opacity(token) -> float:
    match = re.search(r"rgba\(214, 39, 40, ([0-9.]+)\)", token["attrs"]["style"])
    return float(match.group(1))


def test_the_token_view_shows_every_token_shaded_by_its_score(found):
    sample, detection = found
    page = detection._repr_html_()
    elements = Elements(page)
    assert len(elements.tokens) == len(sample.input_ids)
    assert "".join(t["text"] for t in elements.tokens) == sample.text[: int(sample.offsets[:, 1].max())]
    opacity = np.array([_opacity(t) for t in elements.tokens])[: sample.prompt_length]
    scores = detection.scores[: sample.prompt_length].numpy()
    assert opacity[scores.argmax()] == pytest.approx(0.85) and opacity[scores.argmin()] == 0
    assert (np.diff(opacity[np.argsort(scores, kind="stable")]) >= -1e-3).all()  # shade follows score
    assert all(t["attrs"]["title"].startswith(f"{i}: ") for i, t in enumerate(elements.tokens))


def test_spans_are_outlined_and_the_answer_marked(found):
    sample, detection = found
    tokens = Elements(detection._repr_html_()).tokens
    for category in ("supporting", "interference", "question"):
        for start, end in sample.spans[category]:
            assert all(views.COLOURS[category] in tokens[i]["attrs"]["style"] for i in range(start, end))
    answer = [i for i, t in enumerate(tokens) if "answer" in t["attrs"]["class"].split()]
    assert answer == list(range(*sample.spans["answer"][0]))
    legend = Elements(detection._repr_html_()).tags
    assert any(tag == "p" and attrs.get("class") == "legend" for tag, attrs in legend)


def test_pages_are_self_contained(found, tmp_path):
    sample, detection = found
    for path, write in (
        (tmp_path / "detection.html", detection.save_html),
        (tmp_path / "sample.html", sample.save_html),
    ):
        write(path)
        page = path.read_text()
        assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
        assert "<script" not in page and "http" not in page and "<link" not in page
    assert len(Elements(sample._repr_html_()).tokens) == len(sample.input_ids)
    assert "rgba(214, 39, 40" not in sample._repr_html_()  # no scores: no shading


def test_a_loaded_detection_needs_its_sample(found, tmp_path):
    sample, detection = found
    detection.save(tmp_path / "d.json")
    loaded = probe.Detection.load(tmp_path / "d.json")
    assert loaded.sample is None and loaded._repr_html_() is None
    with pytest.raises(ValueError, match=r"carries no sample .* show\(sample=...\)"):
        loaded.show()
    assert "longprobe-view" in loaded.show(sample).data


def test_scores_of_the_wrong_length_are_refused(found):
    sample, _ = found
    with pytest.raises(ValueError, match="one score per token"):
        views.token_view(sample, torch.zeros(3))


def test_the_retrieval_heatmap_has_one_cell_per_head(tmp_path):
    scores = torch.rand(4, 3, 5)
    trials = pd.DataFrame({"correct": [1, 1, 0, 1]})
    heads = probe.RetrievalScores(scores, trials, {"require_correct": True})
    elements = Elements(heads._repr_html_())
    cells = [attrs for tag, attrs in elements.tags if tag == "td"]
    assert len(cells) == 3 * 5
    mean = heads.mean()
    assert cells[7]["title"] == f"layer 1, head 2: {float(mean[1, 2]):.4g}"
    assert "3 counted of 4 trials" in heads._repr_html_()
    assert heads.save_html(tmp_path / "heads.html").read_text().startswith("<!DOCTYPE html>")
