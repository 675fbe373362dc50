"""analyses.noise_restraint end to end on a tiny model saved like a real one."""

import pandas as pd
import pytest

from analyses import noise_restraint


def test_noise_restraint_writes_figure_and_csv(tiny_model_folder, tmp_path):
    argv = ["--models", str(tiny_model_folder), "--length", "192", "--samples", "2", "--out", str(tmp_path)]
    table = noise_restraint.main([*argv, "--steps", "0", "0.1"])
    assert (tmp_path / "noise_restraint.png").stat().st_size > 0
    saved = pd.read_csv(tmp_path / "noise_restraint.csv")
    assert len(saved) == len(table) > 0
    assert set(saved.seed) == {0, 1} and set(saved.step) == {0.0, 0.1}
    unchanged = saved[saved.step == 0]
    assert (unchanged.after - unchanged.before).abs().max() < 1e-6
    masses = saved.groupby(["seed", "step", "layer"]).after.sum()
    assert (masses - 1).abs().max() < 1e-4  # every row's attention sums to 1 over the categories
    assert not list(tmp_path.glob(".*tmp*"))  # no half-written files left behind
    summary = noise_restraint.summary(table)
    assert list(summary.step) == [0.0, 0.1] and (summary.samples == 2).all()


def test_quick_and_bad_settings(capsys):
    quick = noise_restraint.parse_args(["--quick"])
    assert quick.samples == 2 and quick.steps == [0.01, 0.1, 1.0, 10.0]
    with pytest.raises(SystemExit):
        noise_restraint.parse_args(["--samples", "0"])
    assert "at least 1" in capsys.readouterr().err


def test_a_resume_with_other_settings_is_refused(tiny_model_folder, tmp_path, monkeypatch):
    """Killed after its first sample, the run is resumed with other steps: the rows would mix."""
    argv = ["--models", str(tiny_model_folder), "--length", "192", "--samples", "2", "--out", str(tmp_path)]
    restrain = noise_restraint.restrain_sample

    def killed_at_seed_1(model, tokenizer, args, seed):
        if seed == 1:
            raise KeyboardInterrupt
        return restrain(model, tokenizer, args, seed)

    monkeypatch.setattr(noise_restraint, "restrain_sample", killed_at_seed_1)
    with pytest.raises(KeyboardInterrupt):
        noise_restraint.main([*argv, "--steps", "0", "0.1"])
    monkeypatch.setattr(noise_restraint, "restrain_sample", restrain)
    with pytest.raises(SystemExit, match=r"steps: \[0.0, 0.1\] then, \[0.0, 0.2\] now"):
        noise_restraint.main([*argv, "--steps", "0", "0.2", "--resume"])
    assert len(noise_restraint.main([*argv, "--steps", "0", "0.1", "--resume"])) > 0
