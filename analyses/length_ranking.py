"""The detector comparisons across studies: every study's faithfulness rows (finished, or the finished
parts of one still running), one study per model, length and task set, and each scorer's LDS rank there
(RESULTS.md's table by length, written by ``python -m analyses.claims``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from probe import tasks
from probe.stats import bootstrap

from .study_files import running_tables

#: The task sets a detector-comparison study is filed under: the stories the detectors were developed
#: on, and the held-out study's tasks. A study with tasks from neither is filed under their names.
TASK_SETS = {"multi-hop": tasks.DEVELOPMENT_TASKS, "held-out": tasks.HELD_OUT_TASKS}


def task_set(names: Iterable[str]) -> str:
    """The :data:`TASK_SETS` name that holds every task of ``names``, else the names joined by "+"."""
    names = set(names)
    return next(
        (name for name, members in TASK_SETS.items() if names <= set(members)), "+".join(sorted(names))
    )


def faithfulness_studies(figures: Path) -> list[pd.DataFrame]:
    """Every detector-comparison study's faithfulness rows under ``figures``, one frame per study, each
    with its ablation reference (:func:`loo_reference`), its ``tasks`` (:func:`task_set`), the samples
    it ``planned`` and whether it is still ``running``: the finished studies' CSVs and, for a study still
    running, the samples its finished parts hold (``.detector_*_parts/``, :func:`analyses.sweep.sweep`),
    so that a long run reports what it reached."""
    studies = []
    for path in sorted(figures.glob("**/detector_*_faithfulness.csv")):
        faithful = pd.read_csv(path)
        metrics = path.with_name(path.name.replace("_faithfulness.csv", "_metrics.csv"))
        metrics = pd.read_csv(metrics) if metrics.exists() else pd.DataFrame(columns=["detector"])
        studies.append((faithful, metrics, len(faithful[["task", "seed"]].drop_duplicates()), False))
    for settings in sorted(figures.glob("**/.detector_*_parts/settings.json")):
        recorded, found = running_tables(settings.parent, ("faithfulness", "metrics"))
        if not found["faithfulness"].empty:
            planned = len(recorded["tasks"]) * recorded["samples"]
            studies.append((found["faithfulness"], found["metrics"], planned, True))
    if not studies:
        raise FileNotFoundError(
            f"no detector_*_faithfulness.csv under {figures}: run analyses.detector_compare"
        )
    return [
        faithful.assign(
            loo_reference=loo_reference(metrics, faithful),
            tasks=task_set(faithful.task),
            planned=planned,
            running=running,
        )
        for faithful, metrics, planned, running in studies
    ]


def loo_reference(metrics: pd.DataFrame, faithful: pd.DataFrame) -> str:
    """How a study's ``leave_one_out`` reference was run, from its ``metrics`` and ``faithful`` rows:
    ``exhaustive`` (a pass per source on every sample), ``pruned`` (fewer on some) or ``none``."""
    loo = metrics[metrics.detector == "leave_one_out"]
    if loo.empty:
        return "none"
    sources = faithful.groupby(["task", "seed"]).n_sources.first()
    passes = loo.set_index(["task", "seed"]).passes
    return "exhaustive" if (passes >= sources.reindex(passes.index)).all() else "pruned"


def faithfulness_rows(figures: Path) -> pd.DataFrame:
    """The faithfulness rows of one detector-comparison study per model, length and task set: the one
    with the most samples, then the most scorers (its own protocol, not mixed with another study's).
    Studies at a length in tokens only: a natural-length study (real questions) has its own report."""
    chosen: dict[tuple, tuple[tuple[int, int], pd.DataFrame]] = {}
    for study in faithfulness_studies(figures):
        lengths = pd.to_numeric(study.length, errors="coerce")
        study = study[lengths.notna()].assign(length=lengths.dropna().astype(int))
        for key, rows in study.groupby(["model", "length", "tasks"]):
            size = (len(rows[["task", "seed"]].drop_duplicates()), rows.scorer.nunique())
            if key not in chosen or size > chosen[key][0]:
                chosen[key] = (size, rows)
    return pd.concat([rows for _, rows in chosen.values()], ignore_index=True)


def ranking_by_length(figures: Path) -> pd.DataFrame:
    """Each detector-comparison study's scorers (:func:`faithfulness_rows`: one study per model, length
    and task set): mean LDS and AOPC of comprehensiveness with 95 % bootstrap intervals over samples,
    and the LDS rank within the study (1 = most faithful).

    One row per (tasks, model, length, scorer): ``n`` samples, ``lds``, ``lds_low``, ``lds_high``,
    ``aopc``, ``aopc_low``, ``aopc_high``, ``rank``, the study's ``loo_reference``, the samples it
    ``planned`` and whether it is still ``running``.
    """
    rows = faithfulness_rows(figures)
    records = []
    for (on, model, length, scorer, reference, planned, running), group in rows.groupby(
        ["tasks", "model", "length", "scorer", "loo_reference", "planned", "running"]
    ):
        lds = bootstrap(group.lds, over="samples")
        aopc = bootstrap(group.aopc_comprehensiveness, over="samples")
        records.append(
            dict(tasks=on, model=model, length=length, scorer=scorer, n=lds.n, lds=lds.value, lds_low=lds.low,
                 lds_high=lds.high, aopc=aopc.value, aopc_low=aopc.low, aopc_high=aopc.high,
                 loo_reference=reference, planned=planned, running=running)
        )  # fmt: skip
    table = pd.DataFrame(records)
    study = ["tasks", "model", "length"]
    table["rank"] = table.groupby(study).lds.rank(ascending=False, method="min").astype(int)
    return table.sort_values([*study, "rank"], ignore_index=True)


def ranking_markdown(table: pd.DataFrame) -> str:
    """One column per study (model at length on a task set): each scorer's LDS [95 % CI] and its rank
    there; a study still running says how many of its planned samples it reached."""
    study = ["tasks", "model", "length"]
    studies = table[[*study, "n", "planned", "running", "loo_reference"]].drop_duplicates(study)
    listed = {name: i for i, name in enumerate(TASK_SETS)}  # the named task sets first, in their order
    studies = studies.assign(listed=studies.tasks.map(listed).fillna(len(listed)))
    studies = studies.sort_values(["listed", "tasks", "length", "model"])
    reference = {"none": ""} | {kind: f"; {kind} leave-one-out" for kind in ("exhaustive", "pruned")}
    heads = [
        f"{row.model} {row.length // 1024}K {row.tasks} (n = {row.n}"
        f"{f' of {row.planned}, running' if row.running else ''}{reference[row.loo_reference]})"
        for row in studies.itertuples()
    ]
    order = table.groupby("scorer").lds.mean().sort_values(ascending=False).index
    lines = ["| scorer | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for scorer in order:
        cells = []
        for study in studies.itertuples():
            row = table[
                (table.tasks == study.tasks)
                & (table.model == study.model)
                & (table.length == study.length)
                & (table.scorer == scorer)
            ]
            if row.empty:
                cells.append("–")
            elif np.isnan(row.lds_low.iloc[0]):  # too few samples for an interval, so no rank either
                cells.append(f"{row.lds.iloc[0]:.2f} (no interval)")
            else:
                cells.append(
                    f"{row.lds.iloc[0]:.2f} [{row.lds_low.iloc[0]:.2f}, "
                    f"{row.lds_high.iloc[0]:.2f}] #{row['rank'].iloc[0]}"
                )
        lines.append(f"| `{scorer}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)
