"""The judged run's report quotes its files: paired differences from leave-one-out, the top source found
(the same top-1 removal), the cost in forward passes, and the protocol's win rule."""

import numpy as np
import pandas as pd
import pytest

from analyses import faithful_default_report as report
from analyses.detector_compare import command_folder


def write_study(
    figures, command: str, model: str, lds_shift: float, top_same: list[bool], cost: float = 4.0
) -> pd.DataFrame:
    """A finished study of ``leave_few_out`` and ``leave_one_out`` on one sample a ``top_same`` entry; the
    judged detector's LDS is leave-one-out's plus ``lds_shift`` plus noise, its top-1 removal leave-one-out's
    where ``top_same``, its cost ``cost`` forward passes (NaN: not measured, a resumed sample)."""
    rng = np.random.default_rng(0)
    folder = command_folder(model, command, figures)
    folder.mkdir(parents=True)
    rows, metrics = [], []
    for seed, same in enumerate(top_same):
        reference = {"lds": rng.uniform(0.5, 0.9), "comprehensiveness_k1": rng.uniform(1, 2),
                     "aopc_comprehensiveness": 1.0, "aopc_sufficiency": 0.5}  # fmt: skip
        mine = {"lds": reference["lds"] + lds_shift + rng.normal(0, 0.001),
                "comprehensiveness_k1": reference["comprehensiveness_k1"] - (0 if same else 0.3),
                "aopc_comprehensiveness": 1.0, "aopc_sufficiency": 0.5}  # fmt: skip
        for scorer, values in (("leave_one_out", reference), ("leave_few_out", mine)):
            rows.append({"task": "kv", "seed": seed, "scorer": scorer, **values})
            metrics.append({"task": "kv", "seed": seed, "detector": scorer, "seconds": 1.5 * cost if scorer ==
                            "leave_few_out" else 30.0, "forward_seconds": 1.5})  # fmt: skip
    pd.DataFrame(rows).to_csv(folder / f"detector_{model}_faithfulness.csv", index=False)
    pd.DataFrame(metrics).to_csv(folder / f"detector_{model}_metrics.csv", index=False)
    return pd.DataFrame(rows)


def test_the_judged_report_is_computed_from_the_run_files(tmp_path):
    figures = tmp_path / "figures"
    (part, _, command), (_, _, hotpotqa) = report.RUNS[0], report.RUNS[1]
    write_study(figures, command, "smollm2-135m", -0.01, [True] * 4)
    write_study(figures, hotpotqa, "smollm2-135m", -0.2, [True, False, True, True])
    write_study(figures, command, "qwen2.5-coder-1.5b", 0.02, [True], cost=float("nan"))  # one, resumed
    results = tmp_path / "RESULTS.md"
    results.write_text(f"{report.MARKERS[0]}\nold\n{report.MARKERS[1]}\n")
    peers = tmp_path / "peers" / "judged-smollm2-135m-1024"
    peers.mkdir(parents=True)
    pd.DataFrame(
        [{"method": m, "samples": 24, "lds": 0.8, "lds_low": 0.7, "lds_high": 0.9, "forwards": f}
         for m, f in (("context-cite 0.0.4", 44.0), ("leave_few_out", 5.5), ("inseq 0.7.1 saliency", 9.0))]
    ).to_csv(peers / "summary.csv", index=False)  # fmt: skip
    argv = ["--figures", str(figures), "--results", str(results), "--peers", str(tmp_path / "peers")]
    table = report.main(argv).query("model == 'smollm2-135m'").set_index(["part", "scorer"])
    held_out = table.loc[(part, "leave_few_out")]
    assert held_out.lds == pytest.approx(-0.01, abs=0.002) and held_out.samples == 4
    assert held_out.top_source_found == 1.0 and held_out.cost == pytest.approx(4.0)
    assert held_out.wins  # −0.01, AOPCs equal, 4 of 4 top sources, 4 forward passes ≤ 6
    real = table.loc[("1K HotpotQA (own answers)", "leave_few_out")]
    assert real.top_source_found == 0.75 and not real.wins
    pooled = table.loc[("1K pooled", "leave_few_out")]
    assert pooled.samples == 8 and pooled.lds == pytest.approx(-0.105, abs=0.002) and not pooled.wins
    assert table.loc[(part, "leave_one_out")].lds == 0
    text = results.read_text()
    assert "old" not in text and "| smollm2-135m | 1K held-out tasks (4) | -0.01 [" in text
    assert (figures / "studies" / "faithful_default_judged.csv").exists()
    assert "| smollm2-135m (24) | 0.80 [0.70, 0.90], 44.0 | 0.80 [0.70, 0.90], 5.5 | – | – |" in text
    assert "inseq" not in text
    one = "| qwen2.5-coder-1.5b | 1K held-out tasks (1) | +0.02 | +0.00 / +0.00 | 100% | – |"
    assert one in text  # one sample: no interval; its cost not measured: none
    written = pd.read_csv(figures / "studies" / "faithful_default_judged_peers.csv")
    assert set(written.method) == {"context-cite 0.0.4", "leave_few_out"}
