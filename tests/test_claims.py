"""The claims table: verdicts from intervals, rows from the studies' CSVs, RESULTS.md between markers."""

import json

import numpy as np
import pandas as pd
import pytest

from analyses import claims, length_ranking
from analyses.claims import Measured, verdict
from probe.stats import Estimate

PARTLY = "partly (smaller than the paper's)"


@pytest.mark.parametrize(
    "measured, expected",
    [
        (Measured(Estimate(0.2, 0.1, 0.3, 5), "s"), "reproduced"),
        (Measured(Estimate(0.2, 0.1, 0.3, 5), "s", magnitude=0.25), "reproduced"),
        (Measured(Estimate(0.2, 0.1, 0.3, 5), "s", magnitude=0.4), PARTLY),
        (Measured(Estimate(-0.2, -0.3, -0.1, 5), "s"), "not reproduced"),
        (Measured(Estimate(-0.7, -0.9, -0.5, 5), "s", direction=-1, magnitude=-0.96), PARTLY),
        (Measured(Estimate(0.1, -0.1, 0.3, 5), "s"), "inconclusive (interval covers no effect)"),
        (Measured(Estimate(3.0, 1.4, 5.5, 8), "s", null=1.0, magnitude=10.0), PARTLY),
        (Measured(Estimate(0.1, -0.1, 0.3, 5), "s", effect=False), "reproduced (no effect)"),
        (Measured(Estimate(-0.7, -0.9, -0.4, 5), "s", effect=False), "not reproduced (an effect)"),
        (Measured(Estimate(0.2, np.nan, np.nan, 2), "s"), "inconclusive (fewer than 3 units, no interval)"),
        (Measured(None, "needs a GPU"), "not testable"),
    ],
)  # fmt: skip
def test_verdicts_follow_the_interval(measured, expected):
    assert verdict(measured) == expected


def test_rows_come_from_the_csvs_and_the_results_table_is_replaced(tmp_path):
    figures = tmp_path / "figures"
    figures.mkdir()
    seeds = np.arange(5)
    gaps = [
        {"panel": "No PE", "setting": setting, "pair": "first vs last", "seed": s, "steps": 2000, "gap": g,
         "source": "ours"}
        for setting, values in (("depth 2", [0.05, 0.07, 0.06, 0.08, 0.09]),
                                ("depth 6", [0.0, 0.02, 0.01, 0.0, 0.03]))
        for s, g in zip(seeds, values, strict=True)
    ]  # fmt: skip
    pd.DataFrame(gaps).to_csv(figures / "position_bias_gaps.csv", index=False)
    readme = tmp_path / "RESULTS.md"
    readme.write_text(f"# x\n\n{claims.START}\nold table\n{claims.END}\n\nafter\n")
    table = claims.main(["--figures", str(figures), "--results", str(readme)]).set_index("claim")

    first = table.loc["nope_first"]
    assert first.ours == pytest.approx(0.07) and first.low < 0.07 < first.high and first.n == 5
    assert first.verdict == "reproduced" and "2,000 steps (paper 100,000), 5 seeds" in first.setting
    assert table.loc["nope_depth"].ours == pytest.approx(-0.058)  # depth 6 − depth 2, paired by seed
    assert table.loc["nope_depth"].verdict == "not reproduced"
    assert table.loc["decay_last"].verdict == "not run"  # no Decay rows in this CSV
    longppl = table.loc["longppl_r"]
    assert longppl.verdict == "not run" and "longppl_correlation.csv" in longppl.setting
    assert table.loc["cdt_scale"].verdict == "not testable"
    written = pd.read_csv(figures / "claims.csv").set_index("claim")
    pd.testing.assert_frame_equal(written, table.replace("", np.nan), check_dtype=False)
    text = readme.read_text()
    assert "old table" not in text and text.endswith(f"{claims.END}\n\nafter\n")
    assert text.count("| **") == len(claims.CLAIMS)


def test_an_empty_results_option_skips_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text(f"{claims.START}\nold table\n{claims.END}\n")
    claims.main(["--figures", str(tmp_path), "--results", ""])
    assert "old table" in (tmp_path / "README.md").read_text() and (tmp_path / "claims.csv").exists()


def test_a_results_file_without_markers_is_refused(tmp_path):
    (tmp_path / "README.md").write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        claims.update_results(tmp_path / "README.md", "| table |")


def test_detector_rows_and_the_ranking_are_per_length_and_task_set(tmp_path):
    """Each length's claim rows use only its own samples, and a held-out study (more samples, same model
    and length) is filed apart from the multi-hop one; the ranking table has one column per study."""
    figures, rng = tmp_path / "figures", np.random.default_rng(0)
    for name in ("long", "held"):
        (figures / "studies" / name).mkdir(parents=True)
    for folder, model, length, gap, task, seeds in (
        (figures, "m", 1024, 1.0, "multihop-1", 6),
        (figures / "studies" / "long", "g", 4096, -1.0, "multihop-1", 6),
        (figures / "studies" / "held", "m", 1024, 3.0, "kv", 8),
    ):
        rows = [
            dict(model=model, length=length, task=task, seed=seed, scorer=scorer,
                 aopc_comprehensiveness=base + rng.normal(0, 0.1), lds=lds + rng.normal(0, 0.05))
            for seed in range(seeds)
            for scorer, base, lds in (("information_flow", gap, 0.7), ("attention", 0, 0.3), ("lsd", 0, 0))
        ]  # fmt: skip
        pd.DataFrame(rows).to_csv(folder / f"detector_{model}-{length}_faithfulness.csv", index=False)
    keys = ["flow_vs_attention", "flow_vs_attention_4k", "flow_vs_attention_1k_held-out"]
    short = claims.evaluate(figures, keys).set_index("claim")
    assert short.loc["flow_vs_attention"].ours == pytest.approx(1.0, abs=0.1)
    held_out = short.loc["flow_vs_attention_1k_held-out"]
    assert (
        held_out.ours == pytest.approx(3.0, abs=0.1)
        and held_out.n == 8
        and "8 held-out samples" in held_out.setting
    )
    assert "6 multi-hop samples" in short.loc["flow_vs_attention"].setting
    assert short.loc["flow_vs_attention_4k"].ours == pytest.approx(-1.0, abs=0.1)
    assert short.loc["flow_vs_attention_4k"].verdict == "not reproduced"
    assert "at 4K" in short.loc["flow_vs_attention_4k"].setting and short.loc["flow_vs_attention"].n == 6
    results = tmp_path / "RESULTS.md"
    results.write_text(f"{claims.START}\n{claims.END}\n{claims.LENGTHS[0]}\nold\n{claims.LENGTHS[1]}\n")
    claims.main(["--figures", str(figures), "--results", str(results)])
    ranking = pd.read_csv(figures / "detector_by_length.csv")
    studies = {("multi-hop", "m", 1024, 6), ("multi-hop", "g", 4096, 6), ("held-out", "m", 1024, 8)}
    assert set(zip(ranking.tasks, ranking.model, ranking.length, ranking.n, strict=True)) == studies
    first = ranking[ranking["rank"] == 1]
    assert set(first.scorer) == {"information_flow"} and len(first) == 3
    text = results.read_text()
    heads = "| scorer | m 1K multi-hop (n = 6) | g 4K multi-hop (n = 6) | m 1K held-out (n = 8) |"
    assert "\nold\n" not in text and heads in text
    assert "#1" in text.split("`information_flow`")[1].split("\n")[0]


def test_a_study_still_running_is_ranked_on_the_samples_its_finished_parts_hold(tmp_path):
    """A long run's finished parts (``.detector_*_parts/*.pkl``) enter the length table with the samples
    they hold, the samples planned and its reference; its column says it is still running, and below 3
    samples it gives means without interval or rank."""
    parts = tmp_path / "studies" / "long" / ".detector_m-4096_parts"
    parts.mkdir(parents=True)
    settings = {"model": "m", "length": 4096, "tasks": ["kv", "multihop-4"], "samples": 3}
    (parts / "settings.json").write_text(json.dumps(settings))
    for seed in (5000, 5001):
        faithful = pd.DataFrame(
            dict(task="kv", seed=seed, scorer=["leave_one_out", "attention", "information_flow"],
                 lds=[0.8, 0.2 + seed % 2 / 10, 0.5], aopc_comprehensiveness=[2.0, 0.5, 1.0], n_sources=3)
        )  # fmt: skip
        metrics = pd.DataFrame(
            dict(detector=["leave_one_out", "attention"], task="kv", seed=seed, passes=[4, 1])
        )
        pd.to_pickle({"faithfulness": faithful, "metrics": metrics}, parts / f"kv__{seed}.pkl")
    ranking = length_ranking.ranking_by_length(tmp_path)
    assert set(ranking.n) == {2} and set(ranking.planned) == {6} and ranking.running.all()
    assert set(ranking.loo_reference) == {"exhaustive"}
    assert ranking.set_index("scorer").lds["attention"] == pytest.approx(0.25)
    table = length_ranking.ranking_markdown(ranking)
    assert "m 4K held-out (n = 2 of 6, running; exhaustive leave-one-out)" in table
    assert "| `attention` | 0.25 (no interval) |" in table and "#" not in table  # 2 samples: no rank
    (claim,) = claims.evaluate(tmp_path, ["flow_vs_attention_4k_held-out"]).itertuples()
    assert claim.ours == pytest.approx(0.5) and "(m still running, 6 samples planned)" in claim.setting


@pytest.mark.parametrize("passes, expected", [([5, 5], "exhaustive"), ([5, 3], "pruned"), (None, "none")])
def test_each_study_says_how_its_leave_one_out_reference_ran(tmp_path, passes, expected):
    """A pass per source on every sample is exhaustive; fewer anywhere is pruned; no leave-one-out rows
    (or no metrics file) is none."""
    faithful = pd.DataFrame({"task": ["t", "t"], "seed": [0, 1], "n_sources": [4, 4], "scorer": ["x", "x"]})
    metrics = pd.DataFrame(
        {"detector": "leave_one_out", "task": "t", "seed": [0, 1], "passes": passes or [0, 0]}
    )
    metrics = metrics if passes is not None else metrics.iloc[:0]
    assert length_ranking.loo_reference(metrics, faithful) == expected


@pytest.mark.parametrize(
    "names, expected",
    [
        (["multihop-2", "multihop-1"], "multi-hop"),
        (["key-token", "kv"], "held-out"),
        (["kv", "multihop-1"], "kv+multihop-1"),
    ],
)
def test_a_study_is_filed_under_the_task_set_that_holds_all_its_tasks(names, expected):
    assert length_ranking.task_set(names) == expected
