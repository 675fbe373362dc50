"""analyses.longppl end to end on a tiny model saved like a real one: outputs, --resume, presets."""

import functools
from collections import Counter

import numpy as np
import pandas as pd
import pytest
from conftest import closed
from scipy.stats import pearsonr

import probe.stats
from analyses import longppl, longppl_tables
from analyses.sweep import part_name

TASKS = ["passkey", "niah", "multihop-1"]
OUTPUTS = [
    "longppl_answer_tokens.csv",
    "longppl_answer_ppl.csv",
    "longppl_answer_lsd.csv",
    "longppl_correlation.csv",
    "longppl_correlation_table.csv",
    "longppl.md",
]


def tiny_argv(folder, out) -> list[str]:
    model = str(folder)
    return [
        *("--answer-models", model, "--answer-lengths", "320", "--answer-samples", "2"),
        *("--evaluator", model, "--variant-models", model, "--windows", "16", "full"),
        *("--rope-factors", "1", "0.1", "--length", "192", "--documents", "2", "--tasks", *TASKS),
        *("--task-samples", "2", "--K", "32", "--d", "16", "--out", str(out)),
        *("--alpha", "0", "--beta", "-100"),  # key tokens from a random model: its LCL is low everywhere
    ]


def counted(monkeypatch, calls: Counter, owner, name: str) -> None:
    """Count the calls of ``owner.name`` (still calling it)."""
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls[name] += 1
        return function(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)


def test_resume_reruns_only_the_missing_job_and_writes_the_same_outputs(
    tiny_model_folder, tmp_path, monkeypatch
):
    argv = tiny_argv(tiny_model_folder, tmp_path)
    with monkeypatch.context() as patch:  # keep the parts, as a run killed before writing would
        patch.setattr(longppl, "finish", lambda parts: None)
        first = longppl.main(argv)
    written = {name: (tmp_path / name).read_text() for name in OUTPUTS}
    parts = tmp_path / ".longppl_parts"
    assert len(list(parts.glob("*.pkl"))) == 2 + 3 * 2 + 3 * 3 * 2 + 2  # keys, documents, samples, answers

    variants = first["variants"]
    assert list(variants.variant) == [
        f"{tiny_model_folder.name} {s}" for s in ["W=16", "W=full", "W=full, RoPE base ×0.1"]
    ]
    assert {f"accuracy_{task}" for task in TASKS} < set(variants.columns)
    assert (variants.n_key_tokens > 0).all() and variants[list(longppl_tables.METRICS)].notna().all().all()
    assert variants.accuracy.equals(variants[[f"accuracy_{task}" for task in TASKS]].mean(axis=1))
    table = pd.read_csv(tmp_path / "longppl_correlation_table.csv")
    assert list(table.columns) == ["metric", "method", "r", "low", "high", "n"]
    assert table[["metric", "method"]].values.tolist() == [
        [m, k] for m in longppl_tables.METRICS for k in longppl_tables.METHODS
    ]

    (parts / f"{part_name(('task', str(tiny_model_folder), 16, 1.0, 'niah', 1))}.pkl").unlink()
    calls = Counter()
    counted(monkeypatch, calls, longppl, "sample_correct")
    counted(monkeypatch, calls, longppl, "answer_token_rows")
    counted(monkeypatch, calls, longppl.lsd, "find_key_tokens")
    counted(monkeypatch, calls, longppl.lsd, "longppl")
    longppl.main([*argv, "--resume"])
    assert calls == Counter(sample_correct=1)
    assert {name: (tmp_path / name).read_text() for name in OUTPUTS} == written
    assert closed(parts)  # closed once the outputs are written


def test_correlations_over_the_variants_where_a_measure_is_defined(monkeypatch):
    fewer = functools.partial(probe.stats.correlation, resamples=500)  # 10 000 take ~5 s each
    monkeypatch.setattr(probe.stats, "correlation", fewer)
    variants = pd.DataFrame(
        {
            "ppl": [10.0, 12.0, 11.0, 30.0, 25.0],
            "longppl": [2.0, 3.0, float("nan"), 9.0, 7.0],
            "longppl_soft": [5.0, 5.0, 5.0, 5.0, 5.0],
            "accuracy": [0.9, 0.7, 0.8, 0.1, 0.2],
        }
    )
    table = longppl.correlation_table(variants).set_index(["metric", "method"])
    assert table.loc[("ppl", "pearson"), "r"] == pytest.approx(
        pearsonr(np.log(variants.ppl), variants.accuracy)[0]
    )
    assert table.loc[("ppl", "spearman"), "r"] == pytest.approx(-1.0)
    assert table.loc[("longppl", "spearman"), ["r", "n"]].tolist() == [pytest.approx(-1.0), 4]
    assert table.loc["ppl", "low"].le(table.loc["ppl", "r"]).all()
    assert table.loc["longppl_soft"].r.isna().all()  # the same for every variant: no correlation


def test_presets_set_defaults_that_options_override():
    claims = longppl.parse_args(["--claims"])
    variants = longppl.variants_of(claims)
    assert len(variants) == 12 and {v.model for v in variants} == {"smollm2-135m", "gemma3-270m"}
    assert {v.window for v in variants} == {64, 256, 1024, None}
    assert {v.rope_factor for v in variants} == {1.0, 0.1, 0.01}
    assert claims.tasks == TASKS and claims.task_samples == 20 and claims.documents >= 8
    assert claims.length == 2048 and claims.k_ratio == 1 / 8
    assert longppl.short_windows(claims, 2048) == (256, 64)  # K = length / 8, d = K / 4
    cpu = longppl.parse_args(["--claims-cpu"])
    assert len(longppl.variants_of(cpu)) == 12 and cpu.tasks == TASKS and cpu.task_samples < 20
    assert longppl.parse_args(["--claims", "--task-samples", "8"]).task_samples == 8
    assert longppl.short_windows(longppl.parse_args([]), 768) == (128, 128)


@pytest.mark.parametrize(
    "argv",
    [
        ["--windows", "0", "full"],
        ["--rope-factors", "0"],
        ["--K-ratio", "0.5"],
        ["--windows", "full", "--variant-models", "a"],
        ["--claims", "--claims-cpu"],
    ],
)
def test_bad_settings_are_refused(argv):
    with pytest.raises(SystemExit):
        longppl.parse_args(argv)
