"""Sweeps: one process or several under ``accelerate launch`` give the same rows; --resume skips
finished jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from analyses.sweep import part_name, sweep

ROOT = Path(__file__).resolve().parents[1]


def test_a_single_process_sweep_keeps_job_order_and_resumes(tmp_path):
    runs = []

    def run(job):
        runs.append(job)
        return {"rows": pd.DataFrame({"task": [job[0]], "seed": [job[1]]}), "empty": pd.DataFrame()}

    jobs = [("b", 1), ("a", 0), ("a", 2)]
    found = sweep(jobs, run, tmp_path / "parts")
    assert found["rows"].values.tolist() == [["b", 1], ["a", 0], ["a", 2]] and runs == jobs
    (tmp_path / "parts" / f"{part_name(('a', 0))}.pkl").unlink()  # as if killed before this job
    again = sweep(jobs, run, tmp_path / "parts", resume=True)
    assert runs[3:] == [("a", 0)] and again["rows"].equals(found["rows"])


def test_two_processes_write_exactly_the_rows_of_one(tiny_model_folder, tmp_path):
    """The main job on two CPU processes (gloo) under ``accelerate launch``, against one process."""
    argv = ["--model", str(tiny_model_folder), "--length", "160", "--samples", "2", "--masks", "4",
            "--batch-size", "1", "--detectors", "attention", "information_flow", "recency"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launch = ["--num_processes", "2", "--num_machines", "1", "--cpu", "--mixed_precision", "no",
              "--dynamo_backend", "no"]  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", *launch]
    for command, out in (
        ([sys.executable, "-m", "analyses.detector_compare"], tmp_path / "one"),
        ([*launch, "-m", "analyses.detector_compare"], tmp_path / "two"),
    ):
        done = subprocess.run(
            [*command, *argv, "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
    tag = f"{tiny_model_folder.name}-160"
    for name in ("metrics.csv", "faithfulness.csv", "layers.csv", "ranks.csv"):
        one = pd.read_csv(tmp_path / "one" / f"detector_{tag}_{name}")
        two = pd.read_csv(tmp_path / "two" / f"detector_{tag}_{name}")
        pd.testing.assert_frame_equal(one, two)
    assert not list((tmp_path / "two").glob(".*parts"))  # parts removed once the outputs are written
