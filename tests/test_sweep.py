"""Sweeps: one process or several under ``accelerate launch`` give the same rows; --resume skips
finished jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pandas as pd
import pytest
from conftest import closed

from analyses import objectives
from analyses.sweep import PEER_WAIT, finish, part_name, sweep

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


def test_a_finished_sweep_resumed_runs_nothing_and_a_fresh_run_leaves_no_stale_parts(tmp_path):
    """:func:`finish` keeps every job's tables in one file beside the settings: a ``--resume`` with the same
    settings runs no job and gives back the same tables. A run without ``--resume`` first forgets what an
    earlier run left (its finished file and its parts of the same jobs), so a resume after it is killed
    never mixes the earlier run's rows with its own."""
    runs, parts = [], tmp_path / "parts"

    def run(job, scale=1):
        runs.append(job)
        return {"rows": pd.DataFrame({"job": [job[0]], "value": [job[0] * scale]})}

    jobs = [(1,), (2,), (3,)]
    found = sweep(jobs, run, parts, settings={"scale": 1}, progress=False)
    (parts / "1.passes.jsonl").write_text("")  # a journal of a job under way
    finish(parts)
    assert sorted(path.name for path in parts.iterdir()) == ["finished.pkl", "settings.json"]
    again = sweep(jobs, run, parts, resume=True, settings={"scale": 1}, progress=False)
    assert runs == jobs and again["rows"].equals(found["rows"])

    def killed_at_3(job):
        if job == (3,):
            raise KeyboardInterrupt("killed")
        return run(job, scale=10)

    with pytest.raises(KeyboardInterrupt):  # settings of scale 10, killed before its last job
        sweep(jobs, killed_at_3, parts, settings={"scale": 10}, progress=False)
    resumed = sweep(
        jobs, lambda job: run(job, scale=10), parts, resume=True, settings={"scale": 10}, progress=False
    )
    assert resumed["rows"].value.tolist() == [10, 20, 30] and runs[-1] == (3,)


def test_a_job_may_leave_a_table_out_and_everywhere_returns_the_tables(tmp_path):
    def run(job):
        rows = {"rows": pd.DataFrame({"job": [job[0]]})}
        return rows if job[0] == "base" else rows | {"log": pd.DataFrame({"job": [job[0]], "step": [1]})}

    found = sweep([("base",), ("ce",), ("cdt",)], run, tmp_path / "parts", everywhere=True)
    assert found["rows"].job.tolist() == ["base", "ce", "cdt"] and found["log"].job.tolist() == ["ce", "cdt"]
    assert found["log"].step.dtype == "int64"  # no empty frame upcasts the columns


def run_module(module: str, argv: list[str], out: Path, processes: int = 1, path: Path = ROOT) -> None:
    """``python -m module argv --out out``, or the same on ``processes`` CPU processes (gloo) under
    ``accelerate launch``, as the README says to start them; ``path`` goes on the PYTHONPATH too."""
    pythonpath = os.pathsep.join(dict.fromkeys([str(ROOT), str(path)]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    command = [sys.executable, "-m", module]
    if processes > 1:
        launch = ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
        command = [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", module]
    command = [*command, *argv, "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


RECORDER = """
import argparse
from pathlib import Path

import pandas as pd

from analyses.sweep import process_state, sweep

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
out = parser.parse_args().out
found = sweep([(job,) for job in range(6)], lambda job: {"rows": pd.DataFrame(
    {"job": [job[0]], "process": [process_state().process_index]})}, out / ".parts")
if found is not None:
    found["rows"].to_csv(out / "rows.csv", index=False)
"""


def test_the_launch_command_really_starts_two_processes(tmp_path):
    """Each job records the process that ran it: both processes work, and the main one gathers all."""
    (tmp_path / "recorder.py").write_text(RECORDER)
    run_module("recorder", [], tmp_path / "two", processes=2, path=tmp_path)
    rows = pd.read_csv(tmp_path / "two" / "rows.csv")
    assert rows.job.tolist() == list(range(6)) and rows.process.tolist() == [0, 0, 0, 1, 1, 1]


def test_two_processes_write_exactly_the_rows_of_one(tiny_model_folder, tmp_path):
    """The main job on two CPU processes (gloo) under ``accelerate launch``, against one process."""
    argv = ["--model", str(tiny_model_folder), "--length", "160", "--samples", "2", "--masks", "4",
            "--batch-size", "1", "--detectors", "attention", "information_flow", "recency"]  # fmt: skip
    run_module("analyses.detector_compare", argv, tmp_path / "one")
    run_module("analyses.detector_compare", argv, tmp_path / "two", processes=2)
    tag = f"{tiny_model_folder.name}-160"
    for name in ("metrics.csv", "faithfulness.csv", "layers.csv", "ranks.csv"):
        # every column but the measured seconds a detector took
        one, two = (
            pd.read_csv(tmp_path / out / f"detector_{tag}_{name}").drop(columns="seconds", errors="ignore")
            for out in ("one", "two")
        )
        pd.testing.assert_frame_equal(one, two)
    assert [closed(parts) for parts in (tmp_path / "two").glob(".*parts")] == [True]


def test_two_processes_fine_tune_exactly_as_one(tiny_model_folder, tmp_path):
    """The objectives sweep (base model + 2 objectives x 2 seeds) split over two processes."""
    argv = ["--model", str(tiny_model_folder), "--length", "128", "--train-samples", "4", "--steps", "1",
            "--batch", "2", "--eval-samples", "1", "--objectives", "ce", "logo",
            "--seeds", "0", "1"]  # fmt: skip
    objectives.main([*argv, "--out", str(tmp_path / "one")])  # in this process: no second start-up
    run_module("analyses.objectives", argv, tmp_path / "two", processes=2)
    for name in ("objectives.csv", "objectives_training.csv"):
        one, two = (pd.read_csv(tmp_path / out / name).drop(columns="wall_s") for out in ("one", "two"))
        pd.testing.assert_frame_equal(one, two)
    assert [closed(parts) for parts in (tmp_path / "two").glob(".*parts")] == [True]


def test_a_resume_with_other_settings_is_refused_naming_the_difference(tmp_path):
    def run(job):
        return {"rows": pd.DataFrame({"job": [job[0]]})}

    sweep([(1,), (2,)], run, tmp_path, settings={"masks": 32, "ks": [1, 2]}, progress=False)
    again = sweep(
        [(1,), (2,)], run, tmp_path, resume=True, settings={"masks": 32, "ks": [1, 2]}, progress=False
    )
    assert again["rows"].job.tolist() == [1, 2]
    with pytest.raises(SystemExit, match=r"masks: 32 then, 16 now"):
        sweep([(1,), (2,)], run, tmp_path, resume=True, settings={"masks": 16, "ks": [1, 2]}, progress=False)


WAITER = """
import argparse
from pathlib import Path

import torch
import torch.distributed as dist

from analyses.sweep import PEER_WAIT, process_state

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
out = parser.parse_args().out
process_state()
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
assert backend.options._timeout == PEER_WAIT, backend.options._timeout
out.mkdir(exist_ok=True)
(out / f"waits_{dist.get_rank()}").touch()
"""


def test_the_processes_of_a_sweep_wait_for_each_other_as_long_as_a_long_sample_takes(tmp_path):
    """torch's default of 30 minutes at the gather would end a sweep whose jobs take hours."""
    (tmp_path / "waiter.py").write_text(WAITER)
    run_module("waiter", [], tmp_path / "two", processes=2, path=tmp_path)
    assert sorted(path.name for path in (tmp_path / "two").iterdir()) == ["waits_0", "waits_1"]
    assert timedelta(hours=12) <= PEER_WAIT
