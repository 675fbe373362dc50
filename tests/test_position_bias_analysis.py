"""``python -m analyses.position_bias --smoke`` end to end, without the real models."""

import pandas as pd
import pytest
from conftest import closed

from analyses import position_bias
from analyses.position_bias.controlled import Study, controlled_study
from analyses.position_bias.presets import PRESETS

FIGURES = ("gaps", "attention_maps", "sinks", "selector_depth", "theory")


def test_smoke_run_writes_every_figure(tmp_path):
    tables = position_bias.main(
        ["--smoke", "--parts", "study", "theory", "--no-progress", "--out", str(tmp_path)]
    )
    for name in FIGURES:
        assert (tmp_path / f"position_bias_{name}.png").stat().st_size > 0
        pd.testing.assert_frame_equal(
            pd.read_csv(tmp_path / f"position_bias_{name}.csv"),
            tables[name].reset_index(drop=True),
            check_dtype=False,
        )
    gaps = tables["gaps"]
    assert set(gaps.source) == {"ours", "paper"} and set(gaps.setting) == {"depth 2", "depth 2 + res"}
    paper = gaps[(gaps.source == "paper") & (gaps.panel == "No PE") & (gaps.setting == "depth 2")]
    assert paper.set_index("pair").gap["first vs last"] == 0.077  # Wu et al. Fig 4
    maps = tables["attention_maps"].pivot_table(index=["map", "query"], columns="key", values="value")
    assert maps.sum(axis=1).to_numpy() == pytest.approx(1, abs=1e-5)
    theory = tables["theory"].dropna(subset="closed_form")
    interior = theory[
        (theory.family == "Cesàro") | (theory.family.str.startswith("decay") & (theory.token >= 12))
    ]
    assert ((interior.numeric / interior.closed_form - 1).abs() < 0.01).all()


def test_options_override_the_preset():
    preset, _ = position_bias.parse_args(["--smoke", "--steps", "7", "--seeds", "1", "2", "--n-layers", "3"])
    assert (preset.steps, preset.seeds, preset.n_layers, preset.test_size) == (7, (1, 2), (3,), 200)
    assert position_bias.parse_args([])[0] == PRESETS["quick"]


def test_layer_options():
    preset, _ = position_bias.parse_args(["--n-layers", "3", "--residual-n-layers", "4", "5"])
    assert (preset.n_layers, preset.residual_n_layers) == ((3,), (4, 5))


def test_the_study_is_a_sweep_that_resumes_with_the_same_numbers(tmp_path):
    """Jobs (panel, size) are independent of the order they run in: a resumed run equals a fresh one."""
    argv = ["--smoke", "--parts", "study", "--no-progress", "--seeds", "0", "1"]
    fresh = position_bias.main([*argv, "--out", str(tmp_path / "fresh")])
    parts = tmp_path / "resumed" / ".position_bias_parts"
    study = Study(position_bias.parse_args(argv)[0])
    controlled_study(study, progress=False, parts=parts)  # a run killed after the sweep
    (parts / "RoPE__2__True.pkl").unlink()  # ... or before its last job
    resumed = position_bias.main([*argv, "--resume", "--out", str(tmp_path / "resumed")])
    for name in ("gaps", "sinks", "selector_depth", "attention_maps"):
        pd.testing.assert_frame_equal(fresh[name], resumed[name])
    assert set(fresh["gaps"].seed.dropna()) == {0, 1} and closed(parts)
