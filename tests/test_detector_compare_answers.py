"""The detector comparison's answers: the greedy answer behind the correct / wrong split, the model's own
answer explained (``--explain own``), ``--rejudge`` and the saved passes another run reads (``--known``)."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import run_argv

import probe
from analyses import comparison, detector_compare, study_files
from probe import tasks
from probe.errors import InvalidValueError


def test_the_answer_judged_correct_or_wrong_is_never_cut_short(tiny_model_folder, monkeypatch):
    """By default the greedy answer behind the correct / wrong split runs to the gold answer's tokens
    + 4, so a kv UUID (more than 8 tokens) is judged whole, not cut after a fixed 8."""
    model, tokenizer = probe.load_model(str(tiny_model_folder))
    sample = tasks.make("kv", tokenizer, 192, seed=0)
    asked, generate = [], model.generate
    monkeypatch.setattr(
        model, "generate", lambda *a, **k: asked.append(k["max_new_tokens"]) or generate(*a, **k)
    )
    default = detector_compare.parse_args([]).max_new_tokens
    comparison.explained(model, tokenizer, sample, None, default)
    assert asked == [len(sample.target_positions) + 4] and asked[0] > 8


def test_own_answers_are_explained_teacher_forced_with_their_correctness_beside_them(
    tiny_model_folder, tmp_path
):
    """``--explain own``: every row explains the model's own greedy answer (its tokens are the sample's
    target, so the full-context log-probability is that answer's) and records it, with ``correct``,
    ``exact_match`` and ``f1`` against the gold answer; the verdicts have a table per answer group."""
    argv = [*run_argv(tiny_model_folder), "--tasks", "kv", "--detectors", "random", "leave_one_out"]
    detector_compare.main([*argv, "--explain", "own", "--out", str(tmp_path)])
    model, tokenizer = probe.load_model(str(tiny_model_folder))
    tag = f"{tiny_model_folder.name}-192"
    metrics = pd.read_csv(tmp_path / f"detector_{tag}_metrics.csv", keep_default_na=False)
    faithful = pd.read_csv(tmp_path / f"detector_{tag}_faithfulness.csv", keep_default_na=False)
    row = metrics.iloc[0]
    gold = tasks.make("kv", tokenizer, 192, 0, model=model)
    reply = probe.answer(model, tokenizer, gold)
    given = probe.given_answer(gold, reply)
    assert (row.generated, row.given, row.explained) == (reply, given, "own")
    assert (
        row.correct == bool(gold.score(given)) and row.exact_match == gold.answer_match(given)["exact_match"]
    )
    own = gold.with_answer(given, tokenizer)

    def logprob(sample: tasks.Sample) -> float:  # the obvious way: one forward, full log-softmax
        with torch.no_grad():
            logits = model(sample.input_ids[None]).logits[0].log_softmax(-1)
        positions = sample.target_positions
        return logits[positions - 1, sample.input_ids[positions]].sum().item()

    assert faithful.full_logprob.iloc[0] == pytest.approx(logprob(own), abs=1e-3)
    assert faithful.full_logprob.iloc[0] != pytest.approx(logprob(gold), abs=1e-2)
    verdicts = (tmp_path / f"detector_{tag}_verdicts.md").read_text()
    assert "### All answers (1 sample)" in verdicts and ("### Answered wrongly" in verdicts) != bool(
        row.correct
    )


def rejudge_argv(folder: Path, out: Path) -> list[str]:
    """The ``run`` fixture's settings, rejudged in ``out``."""
    return [*run_argv(folder), "--out", str(out), "--rejudge"]


def test_a_rejudge_changes_only_the_greedy_answers_and_redraws_the_rest(
    compare_run, tiny_model_folder, tmp_path
):
    """``--rejudge`` on a finished study: the same answer length gives back every table byte for byte;
    another gives each sample's new greedy answer and its correct / wrong, and nothing else moves."""
    _, out, tag = compare_run
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    tables = sorted(path.name for path in out.glob("*.csv")) + sorted(path.name for path in out.glob("*.md"))
    detector_compare.main(rejudge_argv(tiny_model_folder, tmp_path))
    assert [(tmp_path / name).read_bytes() == (out / name).read_bytes() for name in tables] == [True] * len(
        tables
    )

    detector_compare.main([*rejudge_argv(tiny_model_folder, tmp_path), "--max-new-tokens", "1"])
    model, tokenizer = probe.load_model(str(tiny_model_folder))
    for name in ("metrics", "faithfulness", "layers"):
        before = pd.read_csv(out / f"detector_{tag}_{name}.csv", keep_default_na=False)
        after = pd.read_csv(tmp_path / f"detector_{tag}_{name}.csv", keep_default_na=False)
        answered = list(comparison.ANSWER_COLUMNS)
        pd.testing.assert_frame_equal(after.drop(columns=answered), before.drop(columns=answered))
        for (task, seed), rows in after.groupby(["task", "seed"]):
            sample = tasks.make(task, tokenizer, 192, seed, model=model)
            generated = probe.answer(model, tokenizer, sample, 1)
            given = probe.given_answer(sample, generated)
            assert set(rows.generated) == {generated} and set(rows.correct) == {bool(sample.score(given))}
            assert set(rows.given) == {given} and set(rows.explained) == {"gold"}


def test_a_rejudge_of_another_study_is_refused_before_any_model_work(
    compare_run, tiny_model_folder, tmp_path, monkeypatch, capsys
):
    _, out, _ = compare_run
    monkeypatch.setattr(detector_compare, "load", lambda args: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit, match="no finished study"):
        detector_compare.main(rejudge_argv(tiny_model_folder, tmp_path))
    with pytest.raises(SystemExit, match=r"another study .*samples \(task, seed\)"):
        detector_compare.main([*rejudge_argv(tiny_model_folder, out), "--samples", "2"])
    with pytest.raises(SystemExit, match="another study .*detectors"):
        detector_compare.main([*rejudge_argv(tiny_model_folder, out), "--detectors", "attention"])
    with pytest.raises(SystemExit):
        detector_compare.main([*rejudge_argv(tiny_model_folder, out), "--resume"])
    assert "give one" in capsys.readouterr().err


def test_a_resume_of_a_finished_study_runs_nothing_and_one_with_other_settings_is_refused(
    compare_run, tiny_model_folder, tmp_path, monkeypatch
):
    """``--resume`` where the same study has finished (outputs written, its parts folder closed by
    :func:`analyses.sweep.finish`) runs no sample again and gives back the same metrics, so a chain of
    resumed studies does not run a finished one again; other settings (here more samples) in the same
    folder are refused, naming the difference."""
    table, out, tag = compare_run
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    parts = tmp_path / f".detector_{tag}_parts"
    assert sorted(path.name for path in parts.iterdir()) == ["finished.pkl", "settings.json"]
    written = pd.read_csv(tmp_path / f"detector_{tag}_ablations.csv.gz")
    assert len(study_files.saved_passes(tmp_path)) == len(written)  # the CSV's passes, none twice
    monkeypatch.setattr(detector_compare, "compare_samples", lambda *a, **k: pytest.fail("a sample ran"))
    argv = [*run_argv(tiny_model_folder), "--out", str(tmp_path), "--resume"]
    again = detector_compare.main(argv)
    pd.testing.assert_frame_equal(again, table)
    with pytest.raises(SystemExit, match=r"samples: 1 then, 2 now"):
        detector_compare.main([*argv, "--samples", "2"])


def test_a_run_reads_another_studys_saved_passes_and_gets_the_same_numbers(
    compare_run, tiny_model_folder, tmp_path
):
    """``--known``: the pruned leave-one-out reference beside the ``compare_run`` fixture's study reads the
    masks that study ran (its LDS masks, the references' and the shared detectors' top-k masks) and runs only
    the rest; every number equals the same run's without ``--known``. Another model's passes are refused
    before any model work."""
    _, study, tag = compare_run
    argv = [*run_argv(tiny_model_folder), "--detectors", "key_removal_grad", "leave_one_out",
            "--loo-top-m", "2"]  # fmt: skip
    detector_compare.main([*argv, "--out", str(tmp_path / "alone")])
    detector_compare.main([*argv, "--out", str(tmp_path / "lent"), "--known", str(study)])
    read = {
        name: pd.read_csv(tmp_path / name / f"detector_{tag}_faithfulness.csv") for name in ("alone", "lent")
    }
    pd.testing.assert_frame_equal(read["lent"].drop(columns="seconds"), read["alone"].drop(columns="seconds"))
    ran = {
        name: pd.read_csv(tmp_path / name / f"detector_{tag}_ablations.csv.gz", dtype={"removed": str})
        for name in ("alone", "lent")
    }
    lent = study / f"detector_{tag}_ablations.csv.gz"
    known = set(zip(*pd.read_csv(lent, dtype={"removed": str})[["sample", "removed"]].T.values, strict=True))
    # the judgement ran only masks the study had not; leave_one_out's own passes (none or one source
    # removed) the detector runs itself, and they are recorded as before
    needed = set(zip(ran["alone"]["sample"], ran["alone"].removed, strict=True))
    lent_ran = set(zip(ran["lent"]["sample"], ran["lent"].removed, strict=True))
    assert needed - known <= lent_ran < needed
    assert all(removed.count("1") <= 1 for _, removed in lent_ran & known)  # leave_one_out's own
    assert len(needed - lent_ran) >= 8 * 2  # at least the LDS masks of both samples were read
    with pytest.raises(SystemExit, match="not of model 'other-model'"):
        detector_compare.main(["--model", "other-model", "--known", str(study), "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="dtype 'bfloat16'"):  # float32 passes lent to a bfloat16 run
        detector_compare.main(
            [*argv, "--dtype", "bfloat16", "--known", str(study), "--out", str(tmp_path / "x")]
        )
    assert not any((tmp_path / "x").iterdir())  # nothing written


def test_a_study_in_progress_lends_its_finished_parts_passes_and_another_models_are_refused(tmp_path):
    """``saved_passes`` reads a finished study's passes and a running one's finished parts (the peers'
    judgement and ``analyses.ceiling_masks`` read them), and refuses passes of another model."""
    passes = pd.DataFrame({"sample": ["s1"], "removed": ["0010"], "logprob": [-1.5], "correct": [True]})
    parts = tmp_path / ".detector_m-1024_parts"
    parts.mkdir()
    (parts / "settings.json").write_text(json.dumps({"model": "m", "length": 1024}))
    pd.to_pickle({"metrics": pd.DataFrame(), "ablations": passes}, parts / "kv__1.pkl")
    pd.to_pickle({"metrics": pd.DataFrame()}, parts / "kv__0.pkl")  # a part from before passes were kept
    done = passes.assign(sample="s2", model="m", length=1024)
    done.to_csv(tmp_path / "detector_m-1024_ablations.csv.gz", index=False, compression="gzip")
    saved = study_files.saved_passes(tmp_path, "m", 1024)
    assert sorted(saved["sample"]) == ["s1", "s2"] and set(saved.removed) == {"0010"}
    assert set(saved.dtype) == {""}  # the model's own: a part's recorded --dtype, a file from before dtypes
    assert study_files.saved_passes(tmp_path).equals(saved)
    with pytest.raises(InvalidValueError, match="not of model 'other'"):
        study_files.saved_passes(tmp_path, "other", 1024)
    with pytest.raises(InvalidValueError, match="dtype 'bfloat16'"):
        study_files.saved_passes(tmp_path, "m", 1024, "bfloat16")
