"""Sweeps over samples that run the same in one process and under ``accelerate launch``.

:func:`sweep` splits a list of jobs across the processes accelerate started (one process, and no
distributed setup, under plain ``python -m``), writes each finished job's tables atomically to
``{parts}/{job}.pkl``, and gathers every job's tables on the main process in job order, so the
outputs equal a single process's. With ``resume=True`` the jobs whose part exists are read back
instead of being run again: a killed sweep goes on where it stopped, and one that :func:`finish` closed
runs nothing again. With ``everywhere=True``
every process gets the gathered tables (the main process sends them), for a sweep whose results
the next sweep needs (the retrieval-head ranking that the ablation jobs use). Progress bars show
on the main process only.

    accelerate launch --multi_gpu --num_processes 2 -m analyses.detector_compare ...   # two CPU processes
    torchrun --nproc_per_node 2 -m analyses.detector_compare ...                        # the same
    accelerate launch --multi_gpu --num_processes 8 -m analyses.detector_compare ...   # eight GPUs

On a machine without a GPU the processes join over gloo (:func:`process_state`). accelerate's own
``--cpu`` flag is not the way to several CPU processes: without an MPI host file it starts one. With
GPUs each process puts its model on its own GPU (:func:`process_device`, the analyses' default
``--device``).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import warnings
from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from pathlib import Path

import pandas as pd
import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object, parse_flag_from_env
from tqdm.auto import tqdm

from probe.atomic import atomic_write

Tables = dict[str, pd.DataFrame]

PEER_WAIT = timedelta(days=7)
"""How long a process that finished its jobs waits for the others at the gather. torch's default of
30 minutes would end a sweep whose jobs differ by more (one 32K-token sample runs for hours on a CPU);
a process that dies ends the launch anyway, so the wait need not be short."""


FINISHED = "finished.pkl"
"""The file :func:`finish` leaves in a parts folder: every job's tables, by part name."""


def part_name(job: Sequence[Hashable]) -> str:
    """A job's file name: its fields joined by ``__`` (``("multihop-1", 3)`` → ``multihop-1__3``)."""
    return "__".join(str(field).replace("/", "-") for field in job)


def sweep(
    jobs: Sequence[Sequence[Hashable]],
    run: Callable[[Sequence[Hashable]], Tables],
    parts: Path,
    resume: bool = False,
    desc: str = "sweep",
    everywhere: bool = False,
    progress: bool = True,
    settings: dict | None = None,
) -> Tables | None:
    """Run ``run(job)`` for every job across accelerate's processes; the main process gets each table
    name's rows of all jobs concatenated in job order, the other processes ``None`` (the same tables
    as the main process with ``everywhere``).

    ``run`` returns named tables (``{"metrics": frame, ...}``); a job may leave out a table that it
    has no rows for (a base model has no training log), the others' are concatenated without it.
    """
    state = process_state()
    parts = Path(parts)
    if settings is not None:
        check_settings(parts, settings, resume, state.is_main_process)
    if not resume and state.is_main_process:  # another run's parts must not answer a later --resume
        for stale in [FINISHED, *(f"{part_name(job)}.pkl" for job in jobs)]:
            (parts / stale).unlink(missing_ok=True)
    if not resume and state.num_processes > 1:
        state.wait_for_everyone()
    done = finished_parts(parts) if resume else {}
    written = done.keys() | job_parts(parts) if resume else set()
    todo = [job for job in jobs if part_name(job) not in written]
    new = {}
    with state.split_between_processes(todo) as mine:
        for job in tqdm(mine, desc=desc, disable=not (progress and state.is_main_process)):
            new[part_name(job)] = tables = run(job)
            atomic_write(parts / f"{part_name(job)}.pkl", lambda tmp, t=tables: pd.to_pickle(t, tmp))
    if state.num_processes > 1:  # every process's tables to the main process (no shared disk needed)
        new = dict(gather_object(list(new.items())))
    found = None
    if state.is_main_process:
        per_job = [
            new.get(part_name(job))
            or done.get(part_name(job))
            or pd.read_pickle(parts / f"{part_name(job)}.pkl")
            for job in jobs
        ]
        found = {}
        for name in dict.fromkeys(name for tables in per_job for name in tables):  # in order of appearance
            found[name] = pd.concat([tables[name] for tables in per_job if name in tables], ignore_index=True)
    if everywhere and state.num_processes > 1:
        found = broadcast_object_list([found])[0]
    return found


def finish(parts: Path) -> None:
    """Close a sweep whose outputs are all written: its job parts become one file, ``{parts}/finished.pkl``,
    beside its ``settings.json``, and everything else in the folder (the journals of jobs under way) goes.
    A ``--resume`` with the same settings then reads every job from it and runs none again; without it, a
    finished sweep resumed in a chain of runs would start over."""
    parts = Path(parts)
    if not parts.is_dir():
        return
    tables = finished_parts(parts) | {
        name: pd.read_pickle(parts / f"{name}.pkl") for name in job_parts(parts)
    }
    atomic_write(parts / FINISHED, lambda tmp: pd.to_pickle(tables, tmp))
    for path in parts.iterdir():
        if path.name not in {FINISHED, "settings.json"}:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def finished_parts(parts: Path) -> dict[str, Tables]:
    """The tables of the jobs a finished sweep in ``parts`` ran (:func:`finish`), by part name, or ``{}``."""
    path = Path(parts) / FINISHED
    return pd.read_pickle(path) if path.exists() else {}


def job_parts(parts: Path) -> set[str]:
    """The part names of the jobs whose tables are written in ``parts``, one file each."""
    return {path.stem for path in Path(parts).glob("*.pkl") if path.name != FINISHED}


def check_settings(parts: Path, settings: dict, resume: bool, main: bool) -> None:
    """Keep the settings a sweep's parts were made with in ``{parts}/settings.json`` and refuse to
    resume with other ones (the rows of both would mix in one table), naming what differs.

    A resume that finds no parts runs every job, and says so, naming the runs beside it (other
    outputs' ``parts`` folders of the same name) that wait with other settings: a study whose
    folder is named by its settings starts a new folder when one option is mistyped."""
    path = parts / "settings.json"
    wanted = json.loads(json.dumps(settings, default=str))
    if resume and path.exists():
        changes = settings_difference(json.loads(path.read_text()), wanted)
        if changes:
            raise SystemExit(
                f"--resume with other settings than the parts in {parts} were made with ({changes}): "
                "run without --resume to start over, or with the same settings"
            )
        return
    if resume and main:
        others = set(parts.parent.parent.glob(f"*/{parts.name}/settings.json")) - {path}
        beside = sorted(other for other in others if not (other.parent / FINISHED).exists())
        differences = [settings_difference(json.loads(other.read_text()), wanted) for other in beside]
        waiting = "".join(
            f"\n  {other.parent} ({difference or 'the same settings'})"
            for other, difference in zip(beside, differences, strict=True)
        )
        warnings.warn(
            f"--resume: no parts in {parts}, every job runs"
            + (f"; parts of other runs wait in:{waiting}" if waiting else ""),
            stacklevel=3,
        )
    if main:
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(wanted, indent=1, sort_keys=True)))


def settings_difference(then: dict, now: dict) -> str:
    """What differs between the settings of two runs: ``"key: <then> then, <now> now; ..."``, or ``""``."""
    differ = sorted(key for key in then.keys() | now.keys() if then.get(key) != now.get(key))
    return "; ".join(f"{key}: {then.get(key)!r} then, {now.get(key)!r} now" for key in differ)


def process_state() -> PartialState:
    """This process's place among the processes ``accelerate launch`` / ``torchrun`` started.

    Without a GPU (or with ``ACCELERATE_USE_CPU``) the processes join over gloo on the CPU: a plain
    ``PartialState()`` would ignore the launcher there and leave every process alone, each running
    every job. A process that joined leaves the group when it exits: a gloo group left to the
    interpreter's shutdown can abort the process ("terminate called without an active exception").
    The processes wait for each other up to :data:`PEER_WAIT`.
    """
    cpu = parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu, timeout=PEER_WAIT)
    if state.num_processes > 1:
        _leave_group_at_exit()
    return state


def process_device() -> torch.device:
    """This process's device: its own GPU under ``accelerate launch`` / ``torchrun`` with GPUs
    (``cuda:LOCAL_RANK``, made the current CUDA device), the GPU of a single process on a GPU
    machine, else the CPU."""
    return process_state().device


@functools.cache
def _leave_group_at_exit() -> None:
    atexit.register(PartialState().destroy_process_group)


def is_main_process() -> bool:
    """Whether this process writes the outputs (always, without ``accelerate launch``)."""
    return process_state().is_main_process
