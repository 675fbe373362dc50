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
    results = tmp_path / "RESULTS.md"
    start, end = hotpotqa_report.MARKERS
    results.write_text(f"before\n{start}\nPREVIOUS TABLE\n{end}\nafter\n")
    argv = ["--figures", str(tmp_path / "figures"), "--results", str(results), "--models", "m"]
    table = hotpotqa_report.main(argv)
    row = table.set_index("scorer").loc["context_cite"]
    wide = faithful.pivot_table(index="seed", columns="scorer", values="lds")
    assert row.lds_minus_loo == pytest.approx((wide.context_cite - wide.leave_one_out).mean())
    assert (row.questions, row.exact_match, row.f1) == (4, 0.25, pytest.approx(0.375))
    text = results.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "PREVIOUS TABLE" not in text
    assert f"| m | 4 (4) | 0.25 / 0.38 | `leave_one_out` | {wide.leave_one_out.mean():.2f} | – |" in text
    assert (tmp_path / "figures" / "studies" / "hotpotqa_summary.csv").exists()
