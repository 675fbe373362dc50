"""The detector comparison end to end on a tiny model saved like a real one, and its refusals."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import closed, run_argv
from transformers import AutoTokenizer

from analyses import comparison, detector_compare
from probe import detectors, faithfulness, tasks
from probe.detectors import registry

KS = detector_compare.parse_args([]).ks  # the main job's


@pytest.fixture(scope="module")
def names():
    """The main job's detectors."""
    return comparison.DEFAULT_DETECTORS


def test_detector_compare_writes_every_figure_and_csv(compare_run, names):
    table, out, tag = compare_run
    for name in ("categories", "scores", "layers", "faithfulness", "intervals"):
        assert (out / f"detector_{tag}_{name}.png").stat().st_size > 0
        assert not pd.read_csv(out / f"detector_{tag}_{name}.csv").empty
    metrics = pd.read_csv(out / f"detector_{tag}_metrics.csv")
    assert set(metrics.detector) == set(names)
    pages = sorted(out.glob(f"detector_{tag}_view_*.html"))  # one token view per detector, first sample
    assert [p.stem.split("_view_")[1] for p in pages] == sorted(names)
    assert all("longprobe-view" in p.read_text() for p in pages)
    assert len(metrics) == len(table) == 2 * len(names)  # 2 tasks × 1 sample
    assert metrics.auroc.between(0, 1).all()
    assert (metrics.seconds > 0).all() or set(metrics.detector[metrics.seconds == 0]) <= {"recency"}
    passes = metrics.groupby("detector").passes.first()
    assert passes["attention"] == passes["key_removal_grad"] == passes["key_removal_banzhaf"] == 1
    assert passes["leave_one_out"] == 1 + min(8, faithful_sources(out, tag))  # pruned to the top 8
    assert not list(out.glob(".*tmp*"))  # no half-written files left behind


def test_detector_compare_runs_in_bfloat16(tiny_model_folder, tmp_path, names):
    """``--dtype bfloat16`` end to end (it once failed writing the token views of bf16 scores)."""
    argv = ["--model", str(tiny_model_folder), "--length", "192", "--samples", "1", "--masks", "4"]
    table = detector_compare.main(
        [*argv, "--tasks", "multihop-1", "--dtype", "bfloat16", "--out", str(tmp_path)]
    )
    assert set(table.detector) == set(names) and table.auroc.between(0, 1).all()
    faithful = pd.read_csv(tmp_path / f"detector_{tiny_model_folder.name}-192_faithfulness.csv")
    assert faithful.lds.notna().any() and len(list(tmp_path.glob("*_view_*.html"))) == len(names)


def faithful_sources(out: Path, tag: str) -> int:
    """The fewest sources of the run's samples."""
    return int(pd.read_csv(out / f"detector_{tag}_faithfulness.csv").n_sources.min())


def test_the_main_job_judges_the_papers_detectors_the_key_removal_gradients_and_leave_one_out(names):
    assert set(names) == {
        "attention",
        "information_flow",
        "embedding_grad",
        "lsd",
        "key_removal_grad",
        "key_removal_banzhaf",
        "leave_one_out",
    }
    assert detector_compare.study_folder(detector_compare.parse_args([])) == Path("figures")
    args = detector_compare.parse_args([])
    assert (args.ks, args.masks, args.loo_top_m) == ([1, 4], 16, 8)  # the studies' protocol at 4K and 8K
    assert detector_compare.parse_args(["--loo-top-m", "all"]).loo_top_m is None


@pytest.mark.parametrize("value", ["0", "-2", "some"])
def test_a_bad_leave_one_out_budget_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        detector_compare.parse_args(["--loo-top-m", value])
    assert "positive number of sources or 'all'" in capsys.readouterr().err


def test_intervals_give_each_scorer_and_its_differences_from_the_baselines(compare_run):
    _, out, tag = compare_run
    intervals = pd.read_csv(out / f"detector_{tag}_intervals.csv", keep_default_na=False)
    faithful = pd.read_csv(out / f"detector_{tag}_faithfulness.csv")
    own = intervals[(intervals.versus == "") & (intervals.answer == "all") & (intervals.metric == "lds")]
    lds = faithful.groupby("scorer").lds.mean()
    for row in own.itertuples():
        assert row.value == pytest.approx(lds[row.scorer])
    versus = intervals[(intervals.versus == "leave_one_out") & (intervals.answer == "all")]
    versus = versus[versus.metric == "aopc_comprehensiveness"].set_index("scorer").value
    by_scorer = faithful.groupby("scorer").aopc_comprehensiveness.mean()
    assert versus["attention"] == pytest.approx(by_scorer["attention"] - by_scorer["leave_one_out"])
    assert set(intervals.versus) == {"", "attention", "leave_one_out"}


def test_verdicts_pair_each_scorer_with_leave_one_out_in_the_protocols_words(compare_run, names):
    """``detector_{tag}_verdicts.md``: a row per scorer, its LDS − leave-one-out the intervals' paired
    difference, "above" / "below" only where that interval excludes 0."""
    _, out, tag = compare_run
    intervals = pd.read_csv(out / f"detector_{tag}_intervals.csv")
    paired = intervals[(intervals.answer == "all") & (intervals.versus == "leave_one_out")]
    paired = paired[paired.metric == "lds"].set_index("scorer")
    every = (out / f"detector_{tag}_verdicts.md").read_text().split("### ")[1]  # all answers, first
    assert every.startswith("All answers (2 samples)")
    rows = {
        cells[0].strip("`*"): cells
        for line in every.strip().splitlines()[4:]
        for cells in [[cell.strip() for cell in line.strip("|").split("|")]]
    }
    assert set(rows) == {*names, "ground_truth", "random_sources"}
    assert rows["leave_one_out"][2] == "–"
    for scorer, row in paired.iterrows():  # two samples: no interval, so no verdict
        assert np.isnan(row.low) and rows[scorer][2] == f"{row.value:.2f}, no interval"


def test_a_verdict_word_follows_the_paired_interval_and_needs_one():
    """Six samples: a scorer 0.2 above leave-one-out in LDS is "above", one 0.3 below "below", one within
    noise "matches"; the two samples answered correctly have no interval, so no word."""
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(6):
        reference = rng.uniform(0.4, 0.6)
        for scorer, shift in (("leave_one_out", 0.0), ("up", 0.2), ("down", -0.3), ("same", 0.0)):
            noise = 0.0 if scorer == "leave_one_out" else rng.normal(0, 0.01)
            rows.append({"task": "kv", "seed": seed, "scorer": scorer, "correct": seed < 2,
                         "kind": "detector", "lds": reference + shift + noise,
                         "aopc_comprehensiveness": 1.0, "aopc_sufficiency": 0.5})  # fmt: skip
    faithful = pd.DataFrame(rows)
    text = comparison.verdicts_markdown(faithful, comparison.faithfulness_intervals(faithful))
    every, correct = (part for part in text.split("### ")[1:3])
    cells = {line.split("|")[1].strip(" `"): line.split("|")[3].strip() for line in every.splitlines()[4:-1]}
    assert cells["up"].endswith(" above") and cells["down"].endswith(" below")
    assert cells["same"].endswith(" matches") and cells["leave_one_out"] == "–"
    assert correct.startswith("Answered correctly (2 samples)") and "no interval" in correct


def test_faithfulness_csv_has_one_row_per_sample_and_scorer(compare_run, names):
    _, out, tag = compare_run
    faithful = pd.read_csv(out / f"detector_{tag}_faithfulness.csv")
    scorers = [*names, "ground_truth", "random_sources"]  # no additive_ceiling without --ceiling-masks
    assert len(faithful) == 2 * len(scorers) and set(faithful.scorer) == set(scorers)
    expected = {"task", "seed", "correct", "scorer", "kind", "full_logprob", "lds", "n_sources"}
    expected |= {f"{metric}_k{k}" for metric in ("comprehensiveness", "sufficiency") for k in KS}
    expected |= {"aopc_comprehensiveness", "aopc_sufficiency", "source_reduce", "n_masks", "model", "length"}
    expected |= {"seconds", "ablation"}
    assert expected <= set(faithful.columns)
    assert set(faithful.kind[faithful.scorer.isin(comparison.REFERENCES)]) == {"reference"}
    assert (faithful.source_reduce == "mean").all() and (faithful.n_masks == 8).all()
    assert faithful.groupby(["task", "seed"]).full_logprob.nunique().eq(1).all()  # one unmasked pass a sample
    aopc = faithful[[f"comprehensiveness_k{k}" for k in KS]].mean(axis=1)
    assert (aopc - faithful.aopc_comprehensiveness).abs().max() < 1e-9


def test_rank_table_sets_plausibility_beside_faithfulness(compare_run, names):
    _, out, tag = compare_run
    ranks = pd.read_csv(out / f"detector_{tag}_ranks.csv")
    expected = {"answer", "detector", "auroc", "aopc_comprehensiveness", "lds", "samples"}
    expected |= {"rank_plausibility", "rank_comprehensiveness", "rank_LDS"}
    assert expected <= set(ranks.columns)
    assert set(ranks.detector) == set(names)  # detectors only, no references
    assert "all" in set(ranks.answer) and set(ranks.answer) <= set(comparison.ANSWERS)
    for _, group in ranks.groupby("answer"):
        for column in ("rank_plausibility", "rank_comprehensiveness", "rank_LDS"):
            assert group[column].between(1, len(group)).all()
        assert group.loc[group.auroc.idxmax(), "rank_plausibility"] == 1
    markdown = (out / f"detector_{tag}_ranks.md").read_text()
    assert "### All answers (2 samples)" in markdown and "| `attention` |" in markdown


def test_source_scorers_use_an_ablation_detectors_own_source_scores(tiny_model_folder):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder)
    sample = tasks.make("multihop-1", tokenizer, 192, seed=0)
    n_sources = len(sample.sources)
    scores = torch.rand(len(sample.input_ids))
    own = torch.arange(n_sources, dtype=torch.float32)
    found = {
        "tokens": detectors.Detection(scores, scores > 0.5, {}),
        "ablation": detectors.Detection(scores, scores > 0.5, {}, details={"source_scores": own}),
    }
    scorers = comparison.source_scorers(found, sample, reduce="max")
    assert list(scorers) == ["tokens", "ablation", "ground_truth", "random_sources"]
    assert torch.equal(scorers["tokens"], faithfulness.source_scores(scores, sample.sources, "max"))
    assert torch.equal(scorers["ablation"], own)
    assert torch.equal(scorers["ground_truth"], faithfulness.ground_truth_scores(sample))
    again = comparison.source_scorers(found, sample)["random_sources"]
    assert torch.equal(scorers["random_sources"], again) and again.shape == (n_sources,)  # seeded


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--samples", "0"], "at least 1"),
        (["--masks", "1"], "at least 2"),
        (["--source-reduce", "median"], "invalid choice"),
        (["--detectors", "nope"], "invalid choice"),
        (["--length", "9000"], "context"),
        (["--known", "/no/such/study"], "does not exist"),
        (["--known", "/", "--rejudge"], "give one"),
    ],
)
def test_bad_settings_are_refused(tiny_model_folder, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        detector_compare.main(["--model", str(tiny_model_folder), "--out", str(tmp_path), *argv])
    assert message in str(exit_info.value) + capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_other_settings_write_to_a_study_folder_of_their_own():
    default = detector_compare.parse_args([])
    assert detector_compare.study_folder(default) == Path("figures")
    assert detector_compare.study_folder(
        detector_compare.parse_args(["--model", "gemma3-270m", "--length", "4096"])
    ) == Path("figures")
    study = detector_compare.study_folder(detector_compare.parse_args(["--samples", "3"]))
    other = detector_compare.study_folder(detector_compare.parse_args(["--samples", "3", "--ks", "1", "2"]))
    assert study.parent == other.parent == Path("figures/studies") and study != other


def test_a_pruned_reference_ranked_by_several_detectors_is_a_study_of_its_own():
    """``--loo-rank-by`` reaches leave_one_out's ``rank_by`` and names a new folder; left out, the
    folders of the studies run before it keep their names (here the committed 4K pruned reference)."""
    pruned = ["--model", "qwen2.5-coder-0.5b", "--length", "4096", "--tasks", "multihop-4", "kv",
              "document-2", "key-token", "--samples", "3", "--seed", "5000", "--detectors",
              "key_removal_grad", "leave_one_out", "--loo-top-m", "8", "--ks", "1", "2", "4", "8",
              "--masks", "32", "--ceiling-masks", "0"]  # fmt: skip
    committed = detector_compare.study_folder(detector_compare.parse_args(pruned))
    assert committed.name == "detector_qwen2.5-coder-0.5b-4096_71b8e04d"
    ranked = detector_compare.parse_args([*pruned, "--loo-rank-by", "key_removal_grad", "attn_lrp"])
    assert detector_compare.study_folder(ranked) != committed
    options = detector_compare.detector_options(
        ranked.detectors, 4096, 5000, ranked.loo_top_m, loo_rank_by=ranked.loo_rank_by
    )
    assert options["leave_one_out"] == {"top_m": 8, "rank_by": ["key_removal_grad", "attn_lrp"]}
    assert (
        "rank_by" not in detector_compare.detector_options(ranked.detectors, 4096, 5000, 8)["leave_one_out"]
    )


@pytest.mark.parametrize("wrong", [["--loo-top-m", "all"], ["--loo-rank-by", "leave_one_out"]])
def test_a_ranking_for_no_pruned_leave_one_out_is_refused(wrong, capsys):
    with pytest.raises(SystemExit):
        detector_compare.parse_args(["--loo-rank-by", "attn_lrp", *wrong])
    assert "--loo-rank-by ranks for a pruned leave_one_out" in capsys.readouterr().err


def killed_in_the_second_task(monkeypatch) -> None:
    """``compare_samples`` from now on stops the run (as a kill would) when it reaches ``multihop-2``."""
    compare = detector_compare.compare_samples

    def killed(model, tokenizer, samples, *args, **kwargs):
        if samples[0].task == "multihop-2":
            raise KeyboardInterrupt
        return compare(model, tokenizer, samples, *args, **kwargs)

    monkeypatch.setattr(detector_compare, "compare_samples", killed)


def test_a_run_killed_mid_sample_resumes_from_its_journal(tiny_model_folder, tmp_path, passes, monkeypatch):
    """Every detection and masked pass is journaled as it finishes: a run killed 3 passes before the end
    of its second sample goes on with ``--resume``, running no detector again and only those 3 passes,
    and writes an unbroken run's numbers (to fp32 rounding: the prefix cache of the passes left to run
    is built in other steps). A finished sample's journal is cleared once its part is
    written; a run without ``--resume`` reads no journal."""
    argv = [*run_argv(tiny_model_folder), "--tasks", "multihop-1", "multihop-2", "--samples", "1"]
    argv += ["--detectors", "key_removal_grad", "leave_one_out", "--ceiling-masks", "8"]
    detector_compare.main([*argv, "--out", str(tmp_path / "unbroken")])
    total = passes.calls
    passes.kill_after(total - 3)
    with pytest.raises(KeyboardInterrupt):
        detector_compare.main([*argv, "--out", str(tmp_path / "killed")])
    (parts,) = (tmp_path / "killed").glob(".detector_*_parts")
    assert (parts / "multihop-1__0.pkl").exists() and not (parts / "multihop-2__0.pkl").exists()
    assert {path.name for path in parts.glob("multihop-*__0.*")} == {
        "multihop-1__0.pkl", "multihop-2__0.passes.jsonl", "multihop-2__0.detections"
    }  # fmt: skip
    assert len(list((parts / "multihop-2__0.detections").iterdir())) == 2  # both detectors ran
    passes.kill_after(None)
    shared_passes = []
    run_pass = registry.run_pass
    monkeypatch.setattr(registry, "run_pass", lambda *args: shared_passes.append(1) or run_pass(*args))
    detector_compare.main([*argv, "--out", str(tmp_path / "killed"), "--resume"])
    assert passes.calls == 3 and not shared_passes
    tag = f"{tiny_model_folder.name}-192"
    read = {
        name: pd.read_csv(tmp_path / name / f"detector_{tag}_faithfulness.csv").drop(columns="seconds")
        for name in ("unbroken", "killed")
    }
    pd.testing.assert_frame_equal(read["killed"], read["unbroken"], atol=1e-5)
    assert closed(parts)  # finished: the parts and journals are gone
    passes.kill_after(total - 3)
    with pytest.raises(KeyboardInterrupt):
        detector_compare.main([*argv, "--out", str(tmp_path / "again")])
    passes.kill_after(None)
    detector_compare.main([*argv, "--out", str(tmp_path / "again")])  # no --resume: every pass runs
    assert passes.calls == total


def test_a_resume_after_the_default_detectors_changed_is_refused(tiny_model_folder, tmp_path, monkeypatch):
    """The parts record the detectors that ran, not "the default": a resume under another default set
    would add rows of other detectors to some samples only."""
    argv = ["--model", str(tiny_model_folder), "--length", "192", "--samples", "1", "--masks", "4"]
    argv += ["--ks", "1", "--tasks", "multihop-1", "multihop-2", "--out", str(tmp_path)]
    monkeypatch.setattr(detector_compare, "DEFAULT_DETECTORS", ["attention", "recency"])
    with monkeypatch.context() as killing:
        killed_in_the_second_task(killing)
        with pytest.raises(KeyboardInterrupt):
            detector_compare.main(argv)
    monkeypatch.setattr(detector_compare, "DEFAULT_DETECTORS", ["attention", "recency", "lexical_overlap"])
    with pytest.raises(SystemExit, match=r"detectors: \['attention', 'recency'\] then"):
        detector_compare.main([*argv, "--resume"])


def test_a_resume_whose_settings_name_another_study_folder_says_where_the_parts_wait(
    tiny_model_folder, tmp_path, monkeypatch
):
    """A study's folder is named by its settings: a resume with one detector left out finds no parts
    in its own folder, runs every sample, and says which folder holds the killed run and what differs."""
    monkeypatch.chdir(tmp_path)
    argv = ["--model", str(tiny_model_folder), "--length", "192", "--samples", "1", "--masks", "4"]
    argv += ["--ks", "1", "--tasks", "multihop-1", "multihop-2", "--resume", "--detectors", "attention"]
    killed_in_the_second_task(monkeypatch)
    with pytest.warns(UserWarning, match="every job runs$"), pytest.raises(KeyboardInterrupt):
        detector_compare.main([*argv, "recency"])  # nothing to resume, and nothing beside it
    (killed,) = Path("figures/studies").iterdir()
    with pytest.warns(UserWarning, match="every job runs") as warned, pytest.raises(KeyboardInterrupt):
        detector_compare.main(argv)
    message = str(warned[0].message)
    assert str(killed) in message
    assert "detectors: ['attention', 'recency'] then, ['attention'] now" in message


def test_the_held_out_settings_run_end_to_end_with_the_ceiling(tiny_model_folder, tmp_path):
    """The held-out study's tasks (planted chains in essays, a key token found by LSD on the model
    itself, nothing planted) and its additive_ceiling reference row, at tiny settings."""
    argv = ["--model", str(tiny_model_folder), "--length", "256", "--samples", "1", "--masks", "8",
            "--tasks", "document-2", "key-token", "--ceiling-masks", "24", "--ks", "1", "2",
            "--detectors", "attention", "key_removal_banzhaf", "leave_one_out", "--loo-top-m", "all",
            "--task-options", "alpha=-inf", "beta=-inf"]  # fmt: skip
    detector_compare.main([*argv, "--out", str(tmp_path)])
    faithful = pd.read_csv(tmp_path / f"detector_{tiny_model_folder.name}-256_faithfulness.csv")
    assert set(faithful.task) == {"document-2", "key-token"}
    ceiling = faithful[faithful.scorer == "additive_ceiling"]
    assert len(ceiling) == 2 and set(ceiling.kind) == {"reference"} and (ceiling.lds_share == 1).all()
    for _, rows in faithful.groupby("task"):
        top = rows.set_index("scorer")
        assert top.lds_share.drop("additive_ceiling").tolist() == pytest.approx(
            (top.lds / top.lds["additive_ceiling"]).drop("additive_ceiling").tolist(), nan_ok=True
        )
    # every masked pass is saved, to judge other scores on these samples later without running them
    passes = pd.read_csv(
        tmp_path / f"detector_{tiny_model_folder.name}-256_ablations.csv.gz", dtype={"removed": str}
    )
    assert set(passes.columns) >= {
        "sample",
        "removed",
        "logprob",
        "correct",
        "task",
        "seed",
        "model",
        "length",
    }
    for (task, seed), rows in passes.groupby(["task", "seed"]):
        judged = faithful[(faithful.task == task) & (faithful.seed == seed)]
        assert rows["sample"].nunique() == 1 and not rows.duplicated("removed").any()
        assert len(rows) >= 8 + 24 and rows.removed.str.len().eq(judged.n_sources.iloc[0]).all()
        full = rows[~rows.removed.str.contains("1")]
        assert full.logprob.item() == pytest.approx(judged.full_logprob.iloc[0], abs=1e-6)


def test_time_forward_gives_every_row_the_unit_of_cost_and_keeps_the_folders_of_earlier_studies(
    tiny_model_folder, tmp_path
):
    """``--time-forward``: each sample's rows carry one plain forward pass's seconds, the same for every
    detector of the sample; without it there is no such column, and a study folder named before the
    option existed keeps its name (the option at its default is not part of the settings' hash)."""
    argv = ["--model", str(tiny_model_folder), "--length", "192", "--samples", "2", "--masks", "4"]
    argv += ["--tasks", "multihop-1", "--detectors", "attention", "recency"]
    timed = detector_compare.main([*argv, "--time-forward", "--out", str(tmp_path / "timed")])
    assert (timed.forward_seconds > 0).all()
    assert (timed.groupby("seed").forward_seconds.nunique() == 1).all()
    plain = detector_compare.main([*argv, "--out", str(tmp_path / "plain")])
    assert "forward_seconds" not in plain
    hotpotqa_study = "--tasks hotpotqa --length natural --samples 32 --seed 0 --loo-top-m all --ks 1 2 4 8 "
    hotpotqa_study += "--masks 32 --detectors attention fr embedding_grad information_flow grad_times_input "
    hotpotqa_study += "key_removal_grad key_removal_banzhaf at2 attn_lrp integrated_gradients lsd random "
    hotpotqa_study += "recency lexical_overlap leave_one_out context_cite"
    folder = detector_compare.study_folder(detector_compare.parse_args(hotpotqa_study.split()))
    assert folder.name == "detector_smollm2-135m-natural_65515704"  # figures/studies/, begun 2026-12-06
