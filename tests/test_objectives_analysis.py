"""The objectives experiment end to end on a tiny model saved like a real one, and its refusals."""

import pandas as pd
import pytest

from analyses import objectives

TINY = ["--length", "128", "--train-samples", "2", "--steps", "1", "--batch", "2", "--eval-samples", "1"]


def test_objectives_writes_figure_csv_and_training_log(tiny_model_folder, tmp_path):
    table = objectives.main(["--model", str(tiny_model_folder), *TINY, "--out", str(tmp_path)])
    assert (tmp_path / "objectives.png").stat().st_size > 0
    results = pd.read_csv(tmp_path / "objectives.csv")
    assert len(results) == len(table) == 4  # base model + 3 objectives, 1 held-out sample each
    assert list(results.objective) == ["none", "ce", "longce", "cdt"]
    assert (results.seed == objectives.EVAL_SEED_OFFSET).all()
    assert results[["attention_supporting", "attention_interference"]].gt(0).all().all()
    assert results.attention_supporting.lt(1).all()
    assert (results[["length", "steps", "batch", "longce_k"]].iloc[0] == [128, 1, 2, 32]).all()
    assert (results.cdt_lr == results.lr).all()  # CDT's eq. 2 uses the training learning rate
    # every objective changed its own copy of the model, and the base model was left as it was
    base_nll = results.answer_nll.iloc[0]
    assert (results.answer_nll.iloc[1:] != base_nll).all()

    training = pd.read_csv(tmp_path / "objectives_training.csv")
    assert len(training) == 3 * 2  # 3 objectives × 1 step × 2 samples
    assert list(training.seed[training.objective == "ce"]) == [0, 1]
    cdt = training[training.objective == "cdt"]
    assert cdt.critical_share.between(0, 1, inclusive="neither").all()
    assert cdt.relative_shift.gt(0).all() and cdt.relative_shift.lt(1e-2).all()
    assert not list(tmp_path.glob(".*tmp*"))  # no half-written files left behind


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "at least 1"),
        (["--objectives", "nope"], "invalid choice"),
        (["--length", "32"], "at least 64"),
        (["--length", "4000"], "context"),
    ],
)
def test_bad_settings_are_refused(tiny_model_folder, tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        objectives.main(["--model", str(tiny_model_folder), "--out", str(tmp_path), *argv])
    assert message in str(exit_info.value) + capsys.readouterr().err
    assert not list(tmp_path.iterdir())
