"""Sweeps over samples that run the same in one process and under ``accelerate launch``.

:func:`sweep` splits a list of jobs across the processes accelerate started (one process, and no
distributed setup, under plain ``python -m``), writes each finished job's tables atomically to
``{parts}/{job}.pkl``, and gathers every job's tables on the main process in job order, so the
outputs equal a single process's. With ``resume=True`` the jobs whose part exists are read back
instead of being run again: a killed sweep goes on where it stopped. Progress bars show on the
main process only.

    accelerate launch --num_processes 2 --cpu -m analyses.detector_compare --samples 8   # two CPU processes
    accelerate launch --multi_gpu --num_processes 8 -m analyses.detector_compare ...     # eight GPUs
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import pandas as pd
from accelerate import PartialState
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from probe.results import atomic_write

Tables = dict[str, pd.DataFrame]


def part_name(job: Sequence[Hashable]) -> str:
    """A job's file name: its fields joined by ``__`` (``("multihop-1", 3)`` → ``multihop-1__3``)."""
    return "__".join(str(field).replace("/", "-") for field in job)


def sweep(
    jobs: Sequence[Sequence[Hashable]],
    run: Callable[[Sequence[Hashable]], Tables],
    parts: Path,
    resume: bool = False,
    desc: str = "sweep",
) -> Tables | None:
    """Run ``run(job)`` for every job across accelerate's processes; the main process gets each table
    name's rows of all jobs concatenated in job order, the other processes ``None``.

    ``run`` returns named tables (``{"metrics": frame, ...}``), the same names for every job.
    """
    state = PartialState()
    parts = Path(parts)
    todo = [job for job in jobs if not (resume and (parts / f"{part_name(job)}.pkl").exists())]
    new = {}
    with state.split_between_processes(todo) as mine:
        for job in tqdm(mine, desc=desc, disable=not state.is_main_process):
            new[part_name(job)] = tables = run(job)
            atomic_write(parts / f"{part_name(job)}.pkl", lambda tmp, t=tables: pd.to_pickle(t, tmp))
    if state.num_processes > 1:  # every process's tables to the main process (no shared disk needed)
        new = dict(gather_object(list(new.items())))
    if not state.is_main_process:
        return None
    per_job = [new.get(part_name(job)) or pd.read_pickle(parts / f"{part_name(job)}.pkl") for job in jobs]
    return {name: pd.concat([tables[name] for tables in per_job], ignore_index=True) for name in per_job[0]}


def is_main_process() -> bool:
    """Whether this process writes the outputs (always, without ``accelerate launch``)."""
    return PartialState().is_main_process
