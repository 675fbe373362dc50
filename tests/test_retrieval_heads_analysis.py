"""The retrieval-head analysis end to end on a tiny model saved like a real one."""

import json

import pandas as pd
import pytest

from analyses import retrieval_heads


def test_retrieval_heads_writes_scores_ablation_and_json(tiny_model_folder, tmp_path):
    argv = [
        "--models", str(tiny_model_folder), "--lengths", "160", "--depths", "0.5", "--needles", "1",
        "--ablation-tasks", "passkey", "--ablation-length", "160", "--ablation-samples", "2",
        "--ks", "0", "2", "--out", str(tmp_path),
    ]  # fmt: skip
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
    assert not list(tmp_path.glob(".*tmp*"))
    reused, _ = retrieval_heads.main([*argv, "--reuse", "--ks", "0"])  # detection read back, not re-run
    pd.testing.assert_frame_equal(reused, scores, check_dtype=False)


def test_bad_settings_are_refused(tiny_model_folder, tmp_path):
    argv = ["--models", str(tiny_model_folder), "--lengths", "9000", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        retrieval_heads.main(argv)
    assert "context" in str(exit_info.value)
    assert not list(tmp_path.iterdir())
