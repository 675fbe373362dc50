"""The cost split of ``leave_few_out`` (``bench/leave_few_out_cost.py``) adds up: its parts are the
detector's passes, each in forward passes of the same sample."""

import math

from bench.leave_few_out_cost import split
from probe import detectors


def test_the_split_names_every_pass_of_the_detector(model, tokenizer, sample):
    row = split(model, tokenizer, sample)
    measured = int(detectors.detect("leave_few_out", model, tokenizer, sample).details["measured"].sum())
    assert row["measured"] == measured
    assert math.isclose(row["parts"], row["weighted"] + row["removals"] + row["head_check"])
    assert 0 < row["suffix"] <= measured
    assert all(
        row[name] > 0 for name in ("forward_backward", "weighted", "removals", "head_check", "leave_few_out")
    )


def test_the_benchmark_runs_over_samples_and_writes_its_table(tiny_model_folder, tmp_path):
    from bench import leave_few_out_cost

    csv = tmp_path / "cost.csv"
    argv = ["--model", str(tiny_model_folder), "--tasks", "kv", "--length", "256", "--seeds", "7001", "7002"]
    table = leave_few_out_cost.main([*argv, "--csv", str(csv)])
    assert list(table.seed) == [7001, 7002] and set(leave_few_out_cost.SHOWN) <= set(table.columns)
    assert csv.exists()
