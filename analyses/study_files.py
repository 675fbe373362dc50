"""A detector-comparison study's files (:mod:`analyses.detector_compare`): the tables of a finished study
or of the finished parts of one still running, every masked pass it saved, and a finished study's samples
answered again (``--rejudge``).
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from probe import tasks
from probe.errors import InvalidValueError

from .comparison import ANSWER_COLUMNS, explained
from .sweep import job_parts


def options_of(task: str, given: list[tuple[str, float]]) -> dict[str, float]:
    """The ``--task-options`` that ``task`` takes."""
    accepted = inspect.signature(tasks.TASKS[task]).parameters
    return {key: value for key, value in given if key in accepted}


def length_of(args: argparse.Namespace) -> int | str:
    """The study's length as its files record it: a number of tokens, or ``"natural"``."""
    return args.length or "natural"


def finished_study(args, out: Path, tag: str, names: list[str]) -> dict[str, pd.DataFrame]:
    """The tables of the finished study in ``out`` (``metrics``, ``faithfulness`` and, where it has one,
    ``layers``), after checking that they are the study ``args`` describe: its model, length, tasks,
    samples and detectors. Raises SystemExit, before any model work, where they are not."""
    files = {name: out / f"detector_{tag}_{name}.csv" for name in ("metrics", "faithfulness", "layers")}
    missing = [str(path) for name, path in files.items() if name != "layers" and not path.exists()]
    if missing:
        raise SystemExit(
            f"--rejudge: no finished study at {', '.join(missing)}; give the study's folder with --out "
            "and its settings as it ran"
        )
    found = {name: read_table(path) for name, path in files.items() if path.exists()}
    wrong = study_differences(found["metrics"], args, names)
    if wrong:
        raise SystemExit(
            f"--rejudge: {out} holds another study than the arguments describe; " + "; ".join(wrong)
        )
    return found


def study_differences(table: pd.DataFrame, args, names: list[str]) -> list[str]:
    """How the study of the metrics ``table`` differs from the one ``args`` describe (model, length,
    samples, detectors), one phrase each; empty where it is that study."""
    samples = {(task, args.seed + i) for task in args.tasks for i in range(args.samples)}
    recorded = {
        "model": (set(table.model), {args.model}),
        "length": (set(table.length), {length_of(args)}),
        "samples (task, seed)": (set(zip(table.task, table.seed, strict=True)), samples),
        "detectors": (set(table.detector), set(names)),
    }
    return [f"{what}: the study has {sorted(has)}, the arguments say {sorted(said)}"
            for what, (has, said) in recorded.items() if has != said]  # fmt: skip


def read_table(path: Path) -> pd.DataFrame:
    """A study's CSV table, empty strings as missing values and nothing else (a model's answer "NA"
    stays a string)."""
    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def rejudged(found: dict[str, pd.DataFrame], args, model, tokenizer) -> dict[str, pd.DataFrame]:
    """``found`` with each sample's ``generated`` and ``correct`` columns from a new greedy answer under
    ``args.max_new_tokens`` (:func:`analyses.comparison.explained`; the columns of
    :data:`~analyses.comparison.ANSWER_COLUMNS`); nothing else changes."""
    answers = {}
    samples = found["metrics"][["task", "seed"]].drop_duplicates().itertuples(index=False)
    for task, seed in tqdm(list(samples), desc=f"detector_compare {args.model} (greedy answers)"):
        sample = tasks.make(
            task, tokenizer, args.length, seed, model=model, **options_of(task, args.task_options)
        )
        answers[task, seed] = explained(model, tokenizer, sample, "gold", args.max_new_tokens)[1]
    tables = {}
    for name, frame in found.items():
        keys = list(zip(frame.task, frame.seed, strict=True))
        columns = {column: [answers[key][column] for key in keys] for column in ANSWER_COLUMNS}
        tables[name] = frame.assign(**columns)
    return tables


def saved_passes(
    path: Path, model: str | None = None, length: int | None = None, dtype: str | None = None
) -> pd.DataFrame:
    """Every masked pass a study saved (:meth:`probe.faithfulness.Ablations.to_frame` rows with
    ``model``, ``length`` and ``dtype``, its ``--dtype``, "" for the model's own): its
    ``detector_*_ablations.csv.gz`` or, for ``path`` a study folder, that and the finished parts of a run
    still going. With ``model`` / ``length`` / ``dtype``: refused unless the passes were run with that
    model at that length in that dtype. Each sample's are told apart by digest (``sample``)."""
    files = sorted(path.glob("detector_*_ablations.csv.gz")) if path.is_dir() else [path]
    frames = [pd.read_csv(file, dtype={"removed": str, "dtype": str}) for file in files]
    for parts in sorted(path.glob(".detector_*_parts")) if path.is_dir() else []:
        running = running_tables(parts, ("ablations",))[1]["ablations"]
        frames += [running] if not running.empty else []
    columns = ["sample", "removed", "logprob", "correct", "model", "length", "dtype"]
    saved = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
    saved["dtype"] = saved.get("dtype", pd.Series(index=saved.index, dtype=str)).fillna(
        ""
    )  # before dtypes: ""
    wrong = {
        "model": model is not None and set(saved.model) - {model},
        "length": length is not None and set(saved.length) - {length},
        "dtype": dtype is not None and set(saved.dtype) - {dtype},
    }
    if any(wrong.values()):
        held = ", ".join(f"{key} {sorted(set(saved[key]))}" for key in wrong)
        asked = ", ".join(
            f"{key} {value!r}" for key, value in zip(wrong, (model, length, dtype), strict=True)
        )
        raise InvalidValueError(
            f"{path} holds passes of {held}, not of {asked}: pass that study's file or none"
        )
    return saved


def running_tables(parts: Path, names: tuple[str, ...]) -> tuple[dict, dict[str, pd.DataFrame]]:
    """A running study's recorded settings and, for each table of ``names``, the rows of its finished
    parts (``parts``: its ``.detector_*_parts`` folder) with ``model``, ``length`` and ``dtype`` ("" for
    the model's own) as its finished outputs get them; a table no part holds is empty, as every table of a
    study that has finished (its rows are in its CSVs)."""
    recorded = json.loads((parts / "settings.json").read_text())
    about = {"model": recorded["model"], "length": recorded["length"], "dtype": recorded.get("dtype") or ""}
    tables = [pd.read_pickle(parts / f"{name}.pkl") for name in sorted(job_parts(parts))]
    found = {name: [table[name] for table in tables if name in table] for name in names}
    return recorded, {
        name: pd.concat(rows, ignore_index=True).assign(**about) if rows else pd.DataFrame()
        for name, rows in found.items()
    }


def folder_rows(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """(metrics rows, faithfulness rows, samples planned) of one study folder, finished or running (its
    finished parts); empty tables where it has none."""
    finished = sorted(folder.glob("detector_*_faithfulness.csv"))
    if finished:
        faithful = pd.read_csv(finished[0])
        metrics = pd.read_csv(str(finished[0]).replace("_faithfulness", "_metrics"))
        return metrics, faithful, faithful[["task", "seed"]].drop_duplicates().shape[0]
    for parts in folder.glob(".detector_*_parts"):
        recorded, found = running_tables(parts, ("metrics", "faithfulness"))
        return found["metrics"], found["faithfulness"], recorded["samples"] * len(recorded["tasks"])
    return pd.DataFrame(), pd.DataFrame(), 0
