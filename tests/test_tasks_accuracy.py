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
    saved = pd.read_csv(tmp_path / "task_accuracy.csv")
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
