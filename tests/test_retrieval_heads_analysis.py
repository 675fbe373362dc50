"""The retrieval-head analysis end to end on a tiny model saved like a real one, and --resume."""

import json

import pandas as pd
import pytest
from conftest import closed

import probe
from analyses import retrieval_heads
from analyses.sweep import part_name

OUTPUTS = ["retrieval_heads_scores.csv", "retrieval_heads_ablation.csv"]


def tiny_argv(folder, out) -> list[str]:
    return [
        "--models", str(folder), "--lengths", "160", "--depths", "0.5", "--needles", "1",
        "--ablation-tasks", "passkey", "--ablation-length", "160", "--ablation-samples", "2",
        "--ks", "0", "2", "--out", str(out),
    ]  # fmt: skip


def test_retrieval_heads_writes_scores_ablation_and_json(tiny_model_folder, tmp_path):
    argv = tiny_argv(tiny_model_folder, tmp_path)
    scores, ablation = retrieval_heads.main(argv)
    assert len(scores) == 3 * 4  # tiny Llama: 3 layers x 4 query heads
    assert set(ablation.ablated) == {"none", "retrieval heads", "random heads"}
    assert ablation.accuracy.between(0, 1).all()
    for name in ("scores", "ablation"):
        assert (tmp_path / f"retrieval_heads_{name}.png").stat().st_size > 0
        assert not pd.read_csv(tmp_path / f"retrieval_heads_{name}.csv").empty
    record = json.loads((tmp_path / f"retrieval_heads_{tiny_model_folder.name}.json").read_text())
    assert sorted(record) == sorted(f"{layer}-{head}" for layer in range(3) for head in range(4))
    assert len(pd.read_csv(tmp_path / f"retrieval_heads_{tiny_model_folder.name}_trials.csv")) == 1
    assert not list(tmp_path.glob(".*tmp*"))  # nothing half-written left behind
    assert [closed(parts) for parts in tmp_path.glob(".*parts")] == [True]
    reused, _ = retrieval_heads.main([*argv, "--reuse", "--ks", "0"])  # detection read back, not re-run
    pd.testing.assert_frame_equal(reused, scores, check_dtype=False)


def test_the_sweep_ablation_equals_the_one_process_ablation(tiny_model_folder, tmp_path):
    """main's ablation (one job per sample) and ``ablation`` (the notebook's, one loop) agree."""
    argv = tiny_argv(tiny_model_folder, tmp_path)
    scores, table = retrieval_heads.main(argv)
    model, tokenizer = probe.load_model(str(tiny_model_folder))
    ranked = list(scores[["layer", "head"]].itertuples(index=False, name=None))
    again = retrieval_heads.ablation(model, tokenizer, ranked, ["passkey"], 160, 2, [0, 2])
    pd.testing.assert_frame_equal(again, table.drop(columns="model"))
    assert list(again.ablated) == ["none", "retrieval heads", "random heads"]


def test_resume_reruns_only_the_missing_jobs(tiny_model_folder, tmp_path, monkeypatch):
    """Killed in the last ablation job, then one detection part deleted: --resume runs exactly those
    two jobs and writes the files of an uninterrupted run."""

    def argv(out):  # 2 detection trials, 2 ablation samples
        return [*tiny_argv(tiny_model_folder, out), "--depths", "0.3", "0.7", "--ks", "0", "2", "3"]

    retrieval_heads.main(argv(tmp_path / "whole"))
    label, ran = tiny_model_folder.name, []
    kill = [("ablation", label, "passkey", retrieval_heads.ABLATION_SEED + 1)]

    def counted(run):
        def wrapper(*arguments):
            ran.append(arguments[-1])
            if arguments[-1] in kill:
                kill.clear()
                raise KeyboardInterrupt
            return run(*arguments)

        return wrapper

    monkeypatch.setattr(retrieval_heads, "detection_trial", counted(retrieval_heads.detection_trial))
    monkeypatch.setattr(retrieval_heads, "ablation_sample", counted(retrieval_heads.ablation_sample))
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        retrieval_heads.main(argv(out))
    assert len(ran) == 4 and not kill
    (out / ".retrieval_heads_parts" / f"{part_name(('detection', label, 160, 0.7, 0))}.pkl").unlink()
    retrieval_heads.main([*argv(out), "--resume"])
    assert ran[4:] == [("detection", label, 160, 0.7, 0), ("ablation", label, "passkey", 1001)]
    for name in [*OUTPUTS, f"retrieval_heads_{label}.json", f"retrieval_heads_{label}_trials.csv"]:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    assert closed(out / ".retrieval_heads_parts")


def test_bad_settings_are_refused(tiny_model_folder, tmp_path):
    argv = ["--models", str(tiny_model_folder), "--lengths", "9000", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        retrieval_heads.main(argv)
    assert "context" in str(exit_info.value)
    assert not list(tmp_path.iterdir())
