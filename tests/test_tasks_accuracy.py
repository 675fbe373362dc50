"""analyses.task_accuracy end to end at a tiny setting."""

from __future__ import annotations

import pandas as pd
import pytest
from transformers import AutoTokenizer

import probe
from analyses import task_accuracy
from probe.models import converted_folder


def test_task_accuracy_writes_csv_png_and_table(tmp_path, monkeypatch):
    """A tiny random model with SmolLM2's tokenizer, one sample per task at 256 tokens."""
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    model = probe.tiny_model(vocab_size=len(tokenizer), max_position_embeddings=1024)
    argv = ["--lengths", "256", "--samples", "1", "--tasks", "passkey", "kv", "--out", str(tmp_path)]
    results = task_accuracy.main(argv, models={"tiny": (model, tokenizer)})
    assert len(results) == 2 and set(results.correct) <= {0.0, 1.0}
    saved = task_accuracy.read_results(tmp_path / "task_accuracy.csv")
    assert list(saved.task) == ["kv", "passkey"] and (saved.prompt_tokens - 256).abs().max() < 40
    assert (tmp_path / "task_accuracy.png").stat().st_size > 0
    table = (tmp_path / "task_accuracy.md").read_text()
    assert "| task | tiny @ 256 |" in table and "| passkey |" in table

    monkeypatch.setattr(task_accuracy, "evaluate", None)  # --resume has nothing left to evaluate
    resumed = task_accuracy.main(argv + ["--resume"], models={"tiny": (model, tokenizer)})
    assert resumed[task_accuracy.KEYS].equals(saved[task_accuracy.KEYS])


@pytest.mark.real
def test_task_accuracy_real_model(tmp_path):
    argv = ["--models", "smollm2-135m", "--tasks", "passkey", "--lengths", "256", "--samples", "1"]
    results = task_accuracy.main(argv + ["--out", str(tmp_path)])
    assert results.loc[0, "generated"] != "" and results.loc[0, "model"] == "smollm2-135m"


def test_real_questions_run_at_their_natural_length_with_exact_match_and_f1(tmp_path, monkeypatch):
    """``--lengths natural`` (hotpotqa): the row's length is ``natural``, its answer scored as the
    detector studies score it (the answer the reply gives, exact match, token F1), and a resume reads
    the label back and runs nothing."""
    tokenizer = AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))
    model = probe.tiny_model(vocab_size=len(tokenizer), max_position_embeddings=4096)
    argv = ["--lengths", "natural", "--samples", "2", "--tasks", "hotpotqa", "--out", str(tmp_path)]
    results = task_accuracy.main(argv, models={"tiny": (model, tokenizer)})
    assert list(results.length) == ["natural", "natural"] and list(results.seed) == [0, 1]
    for row in results.itertuples():
        sample = probe.tasks.make("hotpotqa", tokenizer, None, row.seed)
        match = sample.answer_match(row.given)
        assert (row.exact_match, row.f1) == (match["exact_match"], match["f1"])
        assert row.correct == match["exact_match"] and row.answer == sample.answer
        assert row.prompt_tokens == len(sample.prompt_ids)
    table = (tmp_path / "task_accuracy.md").read_text()
    assert "| task | tiny @ natural |" in table and f"tiny @ natural {results.f1.mean():.2f}" in table

    monkeypatch.setattr(task_accuracy, "evaluate", None)
    resumed = task_accuracy.main(argv + ["--resume"], models={"tiny": (model, tokenizer)})
    assert list(resumed.length) == ["natural", "natural"]


def test_lengths_are_ordered_by_tokens_with_natural_last():
    rows = pd.DataFrame(
        {"model": "m", "task": "kv", "length": ["512", "2048", "1024"], "seed": 0, "correct": [1.0, 0.0, 0.5]}
    )
    columns = task_accuracy.accuracy_table(rows).columns
    assert list(columns.get_level_values("length")) == ["512", "1024", "2048"]
    assert sorted(["natural", "2048", "512"], key=task_accuracy.length_order) == ["512", "2048", "natural"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "kv", "--lengths", "natural"], "--lengths natural is for tasks with a natural length"),
        (["--lengths", "natural", "512"], "--lengths natural is for tasks with a natural length"),
        (["--tasks", "kv", "--lengths", "32"], "--lengths at least 64"),
    ],
)
def test_lengths_that_do_not_fit_the_tasks_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        task_accuracy.parse_args(argv)
    assert message in capsys.readouterr().err
