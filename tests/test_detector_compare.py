"""The detector comparison end to end on a tiny model saved like a real one, and its refusals."""

import pandas as pd
import pytest

from analyses import detector_compare


def test_detector_compare_writes_every_figure_and_csv(tiny_model_folder, tmp_path):
    argv = ["--model", str(tiny_model_folder), "--length", "192", "--samples", "1", "--out", str(tmp_path)]
    table = detector_compare.main(argv)
    tag = f"{tiny_model_folder.name}-192"
    for name in ("categories", "scores", "layers"):
        assert (tmp_path / f"detector_{tag}_{name}.png").stat().st_size > 0
        assert not pd.read_csv(tmp_path / f"detector_{tag}_{name}.csv").empty
    metrics = pd.read_csv(tmp_path / f"detector_{tag}_metrics.csv")
    assert set(metrics.detector) == set(detector_compare.QUICK_DETECTORS)
    assert len(metrics) == len(table) == 2 * len(detector_compare.QUICK_DETECTORS)  # 2 tasks × 1 sample
    assert metrics.auroc.between(0, 1).all()
    assert not list(tmp_path.glob(".*tmp*"))  # no half-written files left behind


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--samples", "0"], "at least 1"),
        (["--detectors", "nope"], "invalid choice"),
        (["--length", "9000"], "context"),
    ],
)
def test_bad_settings_are_refused(tiny_model_folder, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        detector_compare.main(["--model", str(tiny_model_folder), "--out", str(tmp_path), *argv])
    assert message in str(exit_info.value) + capsys.readouterr().err
    assert not list(tmp_path.iterdir())
