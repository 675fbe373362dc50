"""Greedy accuracy of the real models on every text task of ``probe.tasks``, by prompt length.

Each sample is answered with ``model.generate`` (greedy, at most the gold answer's token count + 4
new tokens; a real question's reply to its end of turn) from ``sample.prompt_ids`` — the prompt already
ends with the task's answer prefix ("The pass key is") — and scored as the detector studies score it
(:func:`analyses.comparison.greedy_answer`): the answer the reply gives, ``correct`` by the task's own
check (``sample.score``), ``exact_match`` and token ``f1`` against the gold answer. Depth is random per
sample (``depth=None``). A length is a number of tokens or ``natural``, a real question's own length
(``hotpotqa``: the questions of the HotpotQA study are its seeds 0–31).

    python -m analyses.task_accuracy                       # bundled models, all tasks, 512/1K/2K, 20 samples
    python -m analyses.task_accuracy --quick               # 2 samples at 512 tokens
    python -m analyses.task_accuracy --models gemma3-270m --tasks passkey kv --lengths 4096
    python -m analyses.task_accuracy --tasks hotpotqa --lengths natural --samples 32 \
        --out figures/studies/hotpotqa_accuracy     # the four models' own answers to the study's questions

Writes ``task_accuracy.csv`` (one row per sample: settings, gold answer, generated text, correct),
``task_accuracy.png`` (accuracy heatmap, task x length, one panel per model) and
``task_accuracy.md`` (the accuracy table for RESULTS.md). Each finished sample is kept as a part
(``OUT/.task_accuracy_parts``) until the outputs are written; ``--resume`` keeps the samples already
in the CSV and in the parts and runs only the missing ones (``--resume --samples 0`` just redraws
the figure and table from the CSV). Runs unchanged under ``accelerate launch`` (:mod:`analyses.sweep`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from probe import stats, tasks
from probe.atomic import atomic_write
from probe.models import REAL_MODELS

from .arguments import (
    add_device_arguments,
    check_device_arguments,
    check_out,
    length_setting,
    load,
    resume_settings,
)
from .comparison import greedy_answer
from .output import save_figure
from .sweep import sweep

NAME = "task_accuracy"
KEYS = ["model", "task", "length", "seed"]


def length_label(length: int | None) -> str:
    """A length as the CSV and the tables name it: ``"1024"``, or ``"natural"`` for None."""
    return "natural" if length is None else str(length)


def length_order(label: str) -> float:
    """Sort key of a length label: by tokens, ``natural`` last."""
    return float("inf") if label == "natural" else float(label)


def evaluate(model, tokenizer, model_name: str, task: str, length: int | None, seed: int) -> dict:
    """One sample's row: settings, prompt tokens, gold answer, the reply and the answer it gives,
    correct (0/1, the task's own check), exact_match and f1."""
    sample = tasks.make(task, tokenizer, length, seed=seed, model=model)
    replied = greedy_answer(model, tokenizer, sample, None)
    return dict(
        model=model_name,
        task=task,
        length=length_label(length),
        seed=seed,
        prompt_tokens=len(sample.prompt_ids),
        answer=sample.answer,
        generated=replied["generated"],
        given=replied["given"],
        correct=float(replied["correct"]),
        exact_match=replied["exact_match"],
        f1=replied["f1"],
    )


def read_results(csv: Path) -> pd.DataFrame:
    """A written ``task_accuracy.csv``, its lengths as labels (:func:`length_label`)."""
    return pd.read_csv(csv, dtype={"length": str})


def accuracy_table(results: pd.DataFrame) -> pd.DataFrame:
    """Mean accuracy, rows = task (in ``tasks.names()`` order), columns = (model, length)."""
    table = results.pivot_table(index="task", columns=["model", "length"], values="correct", aggfunc="mean")
    models = list(results.model.unique())
    table = table[sorted(table.columns, key=lambda cell: (models.index(cell[0]), length_order(cell[1])))]
    return table.reindex([t for t in tasks.names() if t in table.index])


def markdown(results: pd.DataFrame) -> str:
    """The accuracy table as GitHub markdown, with the number of samples per cell."""
    table = accuracy_table(results)
    counts = results.groupby(["model", "task", "length"])["seed"].nunique()
    header = ["task"] + [f"{model} @ {length}" for model, length in table.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for task, row in table.iterrows():
        cells = [stats.number_text(value) for value in row]
        lines.append("| " + " | ".join([task, *cells]) + " |")
    n = counts.min() if counts.min() == counts.max() else f"{counts.min()}-{counts.max()}"
    depth = ", random depth" if (results.length != "natural").any() else ""
    note = f"\n\nGreedy accuracy, {n} samples per cell (– = not run){depth}.\n"
    real = results[results.task.isin(tasks.NATURAL_LENGTH)]
    if real.empty:
        return "\n".join(lines) + note
    f1 = real.groupby(["task", "model", "length"], sort=False).f1.mean()
    scores = ", ".join(f"{model} @ {length} {value:.2f}" for (task, model, length), value in f1.items())
    return "\n".join(lines) + note + f"Real questions score exact match; their mean token F1: {scores}.\n"


def plot(results: pd.DataFrame) -> plt.Figure:
    """Accuracy heatmaps (task x prompt length), one panel per model."""
    table = accuracy_table(results)
    models = table.columns.get_level_values("model").unique()
    size = (2.5 + 1.3 * table.shape[1], 0.5 * len(table) + 1.5)
    fig, axes = plt.subplots(1, len(models), figsize=size, sharey=True, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        last = model == models[-1]
        sns.heatmap(table[model], ax=ax, vmin=0, vmax=1, annot=True, fmt=".2f", cmap="viridis", cbar=last)
        ax.set(title=model, xlabel="prompt length (tokens)", ylabel="")
        ax.tick_params(axis="y", rotation=0)
    fig.suptitle("Greedy accuracy of each model on the tasks, by prompt length")
    fig.tight_layout()
    return fig


def write(results: pd.DataFrame, out: Path) -> None:
    """CSV + PNG + markdown table, each written atomically."""
    results = results.sort_values(
        KEYS, key=lambda column: column.map(length_order) if column.name == "length" else column
    ).reset_index(drop=True)
    save_figure(plot(results), results, out, NAME)
    atomic_write(out / f"{NAME}.md", lambda tmp: tmp.write_text(markdown(results)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(REAL_MODELS))
    parser.add_argument("--tasks", nargs="+", default=tasks.names(), choices=tasks.names())
    parser.add_argument(
        "--lengths", nargs="+", type=length_setting, default=[512, 1024, 2048],
        help="prompt lengths in tokens, or 'natural' (a real question's own length: tasks with one only)",
    )  # fmt: skip
    parser.add_argument("--samples", type=int, default=20, help="samples (seeds 0..n-1) per cell")
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--quick", action="store_true", help="2 samples at 512 tokens")
    parser.add_argument("--resume", action="store_true", help="keep samples already in the CSV")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.lengths = 2, [512]
    tokens = [length for length in args.lengths if length is not None]
    if args.samples < 0 or (tokens and min(tokens) < 64):
        parser.error("--samples must be >= 0 (0 with --resume redraws the CSV), --lengths at least 64")
    natural = [task for task in args.tasks if task in tasks.NATURAL_LENGTH]
    if None in args.lengths and len(natural) < len(args.tasks):
        parser.error(
            f"--lengths natural is for tasks with a natural length ({', '.join(tasks.NATURAL_LENGTH)}): "
            "run the others at a number of tokens, in a run of their own"
        )
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


# each row names its cell and seed, so a resume may add or drop models, tasks, lengths and samples
CELL_SETTINGS = ("models", "tasks", "lengths", "samples", "quick")


def main(argv: list[str] | None = None, models: dict | None = None) -> pd.DataFrame:
    """Run the table; ``models`` maps names to already-loaded ``(model, tokenizer)`` pairs (tests).

    Seeds are the outer loop, so an interrupted run leaves every cell with about as many samples;
    ``--resume`` then goes on where it stopped.
    """
    args = parse_args(argv)
    csv = args.out / f"{NAME}.csv"
    done = read_results(csv) if args.resume and csv.exists() else pd.DataFrame(columns=KEYS)
    finished = set(done[KEYS].itertuples(index=False, name=None))
    names = list(models) if models else args.models
    cells = [(n, t, length) for n in names for t in args.tasks for length in args.lengths]
    todo = [
        (*cell, seed)
        for seed in range(args.samples)
        for cell in cells
        if (*cell[:2], length_label(cell[2]), seed) not in finished
    ]
    loaded = dict(models or {})

    def run(job: tuple) -> dict[str, pd.DataFrame]:
        name, task, length, seed = job
        if name not in loaded:
            loaded[name] = load(args, name)
        return {"rows": pd.DataFrame([evaluate(*loaded[name], name, task, length, seed)])}

    parts = args.out / f".{NAME}_parts"
    found = (
        sweep(todo, run, parts, args.resume, desc=NAME, settings=resume_settings(args, *CELL_SETTINGS))
        if todo
        else {"rows": done.iloc[:0]}
    )
    if found is None:  # not the main process of an accelerate launch: it writes the outputs
        return pd.DataFrame()
    results = pd.concat([done, found["rows"]]).astype({"length": str, "seed": int, "correct": float})
    write(results, args.out)
    shutil.rmtree(parts, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
