"""The HotpotQA study's report quotes its files: per model the answers' exact match and F1, per scorer LDS
and its paired difference from leave-one-out, written between RESULTS.md's markers."""

import numpy as np
import pandas as pd
import pytest

from analyses import hotpotqa_report


def test_the_report_is_computed_from_the_study_files(tmp_path):
    folder = hotpotqa_report.study_folder_of("m", tmp_path / "figures")
    folder.mkdir(parents=True)
    other = folder.with_name("detector_m-natural_00000000")  # another study of HotpotQA: not the report's
    other.mkdir()
    rng = np.random.default_rng(0)
    scorers = ["leave_one_out", "context_cite", "lexical_overlap"]
    faithful = pd.DataFrame(
        [{"model": "m", "task": "hotpotqa", "seed": s, "scorer": name, "lds": rng.uniform(-1, 1),
          "aopc_comprehensiveness": rng.uniform()} for s in range(4) for name in scorers]
    )  # fmt: skip
    metrics = pd.DataFrame(
        [{"model": "m", "task": "hotpotqa", "seed": s, "detector": name, "exact_match": float(s == 0),
          "f1": 0.25 * s, "source_auroc": 0.5, "recall_top2_sources": 0.5 * (s % 2)}
         for s in range(4) for name in scorers]
    )  # fmt: skip
    faithful.to_csv(folder / "detector_m-natural_faithfulness.csv", index=False)
    metrics.to_csv(folder / "detector_m-natural_metrics.csv", index=False)
    faithful.assign(lds=9.0).to_csv(other / "detector_m-natural_faithfulness.csv", index=False)
    metrics.to_csv(other / "detector_m-natural_metrics.csv", index=False)
    peers = tmp_path / "peers"  # a peers run on the study's questions: its public package joins the scorers
    (peers / "hotpotqa-m").mkdir(parents=True)
    public = pd.DataFrame(
        [{"sample": f"hotpotqa-None-{s}", "scorer": scorer, "source": source, "lds": rng.uniform(-1, 1),
          "aopc_comprehensiveness": 0.0} for s in range(4)
         for scorer, source in ((hotpotqa_report.PUBLIC, "peer"), ("context_cite", "longprobe"))]
    )  # fmt: skip
    public.to_csv(peers / "hotpotqa-m" / "peers.csv", index=False)
    results = tmp_path / "RESULTS.md"
    start, end = hotpotqa_report.MARKERS
    first, last = hotpotqa_report.ANSWER_MARKERS
    opens, closes = hotpotqa_report.ACCURACY_MARKERS
    results.write_text(f"before\n{first}\n{last}\n{start}\nPREVIOUS TABLE\n{end}\n{opens}\n{closes}\nafter\n")
    argv = ["--figures", str(tmp_path / "figures"), "--results", str(results), "--models", "m"]
    table = hotpotqa_report.main([*argv, "--peers", str(peers)])
    row = table.set_index("scorer").loc["context_cite"]
    wide = faithful.pivot_table(index="seed", columns="scorer", values="lds")
    assert row.lds_minus_loo == pytest.approx((wide.context_cite - wide.leave_one_out).mean())
    peer = table.set_index("scorer").loc[hotpotqa_report.PUBLIC]  # the study's own context_cite row stays
    by_seed = public[public.source == "peer"].lds.to_numpy()
    assert peer.lds_minus_loo == pytest.approx((by_seed - wide.leave_one_out.to_numpy()).mean())
    assert np.isnan(peer.recall_top2) and (peer.questions, peer.correct_n) == (4, 1)
    assert (row.questions, row.exact_match, row.f1) == (4, 0.25, pytest.approx(0.375))
    difference = wide.context_cite - wide.leave_one_out  # question 0 answered correctly, 1-3 wrongly
    assert (row.correct_n, row.wrong_n) == (1, 3) and row.correct == pytest.approx(difference[0])
    assert row.wrong == pytest.approx(difference[1:].mean()) and row.wrong_low <= row.wrong <= row.wrong_high
    assert np.isnan(row.correct_low)  # one question: a value without an interval
    text = results.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "PREVIOUS TABLE" not in text
    assert f"| m | 4 (4) | 0.25 / 0.38 | `leave_one_out` | {wide.leave_one_out.mean():.2f} | – |" in text
    assert f"| m (1 / 3) | `context_cite` | {difference[0]:+.2f} | {row.wrong:+.2f} [" in text
    assert f"| `{hotpotqa_report.PUBLIC}` | {peer.lds:.2f} | {peer.lds_minus_loo:.2f} [" in text
    assert f"{peer.high:.2f}] | – |" in text  # no plausibility: the peers run scores no tokens
    assert (tmp_path / "figures" / "studies" / "hotpotqa_summary.csv").exists()


def test_gold_against_own_answers_pairs_the_same_questions(tmp_path, monkeypatch):
    """The verdict shift: each scorer's LDS − leave-one-out's on planted text (the held-out folder), on
    real questions with the gold answer and with the model's own, and own − gold paired by question."""
    rng = np.random.default_rng(1)
    figures = tmp_path / "figures"
    monkeypatch.setitem(hotpotqa_report.HELD_OUT, "m", "detector_m-1024_held")
    folders = {
        "planted": (figures / "studies" / "detector_m-1024_held", "multihop-4", range(5000, 5006)),
        "gold": (hotpotqa_report.study_folder_of("m", figures, hotpotqa_report.GOLD), "hotpotqa", range(8)),
        "own": (hotpotqa_report.study_folder_of("m", figures), "hotpotqa", range(10)),
    }
    tables = {}
    for name, (folder, task, seeds) in folders.items():
        folder.mkdir(parents=True)
        tables[name] = pd.DataFrame(
            [{"model": "m", "task": task, "seed": s, "scorer": scorer, "lds": rng.uniform(-1, 1)}
             for s in seeds for scorer in ("leave_one_out", "context_cite")]
        )  # fmt: skip
        tables[name].to_csv(folder / "detector_m-x_faithfulness.csv", index=False)
        tables[name].drop(columns="lds").to_csv(folder / "detector_m-x_metrics.csv", index=False)
    table = hotpotqa_report.answers_and_text(figures, "m")
    found = table.set_index("scorer").loc["context_cite"]

    def difference(table):
        wide = table.pivot_table(index="seed", columns="scorer", values="lds")
        return wide.context_cite - wide.leave_one_out

    shift = (difference(tables["own"]) - difference(tables["gold"])).dropna()
    assert found.own_minus_gold == pytest.approx(shift.mean()) and found.own_minus_gold_n == 8
    assert found.planted_gold == pytest.approx(difference(tables["planted"]).mean())
    assert (found.real_gold_n, found.real_own_n, found.planted_gold_n) == (8, 10, 6)
    assert found.own_minus_gold_low <= found.own_minus_gold <= found.own_minus_gold_high
    assert f"| `context_cite` | {found.planted_gold:+.2f} [" in hotpotqa_report.answers_markdown(table)


def test_the_models_answers_to_every_question_beside_the_study_s(tmp_path):
    """All 32 questions' answers per model (task_accuracy's CSV, other tasks and lengths ignored), and on how
    many of the questions the study has done its explained answer scores the same."""
    figures = tmp_path / "figures"
    (figures / hotpotqa_report.ACCURACY).parent.mkdir(parents=True)
    answers = pd.DataFrame(
        [{"model": m, "task": "hotpotqa", "length": "natural", "seed": s, "exact_match": float(s % 2),
          "f1": 0.5 * (s % 2) + 0.1} for m in ("a", "b") for s in range(4)]
        + [{"model": "a", "task": "kv", "length": "512", "seed": 0, "exact_match": 1.0, "f1": 1.0}]
    )  # fmt: skip
    answers.to_csv(figures / hotpotqa_report.ACCURACY, index=False)
    study = pd.DataFrame(
        [{"model": "a", "seed": s, "detector": name, "exact_match": float(s % 2), "f1": 0.5 * (s % 2) + 0.1}
         for s in range(3) for name in ("x", "y")]
    )  # fmt: skip
    study.loc[study.seed == 2, "f1"] = 0.9  # the study's answer to question 2 is another one
    table = hotpotqa_report.answer_accuracy(figures, study).set_index("model")
    assert table.loc["a", ["questions", "exact_match", "done", "agree"]].tolist() == [4, 0.5, 3, 2]
    assert table.loc["a", "f1"] == pytest.approx(0.35) and table.loc["b", "done"] == 0
    text = hotpotqa_report.accuracy_markdown(table.reset_index())
    assert "| a | 4 | 0.50 | 0.35 | 2 of 3 |" in text and "| b | 4 | 0.50 | 0.35 | – |" in text
    assert hotpotqa_report.answer_accuracy(tmp_path / "none", study).empty


def test_a_model_that_answered_nothing_correctly_has_no_correct_group():
    faithful = pd.DataFrame(
        [{"model": "m", "seed": s, "scorer": name, "lds": 0.1 * s + (name == "context_cite"),
          "aopc_comprehensiveness": 0.0} for s in range(4) for name in ("leave_one_out", "context_cite")]
    )  # fmt: skip
    metrics = faithful.rename(columns={"scorer": "detector"}).assign(
        exact_match=0.0, f1=0.2, source_auroc=0.5, recall_top2_sources=0.5
    )
    row = hotpotqa_report.summary(metrics, faithful).set_index("scorer").loc["context_cite"]
    assert (row.correct_n, row.wrong_n, row.wrong) == (0, 4, pytest.approx(1.0)) and np.isnan(row.correct)
    text = hotpotqa_report.split_markdown(hotpotqa_report.summary(metrics, faithful))
    assert "| m (0 / 4) | `context_cite` | – | +1.00 [+1.00, +1.00] |" in text
