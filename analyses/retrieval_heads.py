"""Retrieval heads of the real models, and whether they are causal for retrieval (Wu et al. 2024).

1. Detection: greedy decoding on needle-in-a-haystack samples over a grid of lengths and depths;
   :func:`probe.retrieval_scores` scores every (layer, query head) on the correctly answered trials.
2. Ablation: with the top-k retrieval heads zeroed (:func:`probe.ablate_heads`) versus k random
   heads from outside the top set, greedy accuracy on held-out passkey / NIAH samples
   (other seeds, random depths).

Writes, per run, with the CSV behind each figure:

- ``retrieval_heads_{model}.json``: the scores in Wu et al.'s layout ``{"layer-head": [per trial]}``,
  and ``retrieval_heads_{model}_trials.csv``: every detection trial (answer, generation, correct),
  both written as soon as the model's detection ends (``--reuse`` reads them back);
- ``retrieval_heads_scores``: layer x head heatmaps of the mean score, one panel per model;
- ``retrieval_heads_ablation``: accuracy against the number of heads ablated, top vs random.

    python -m analyses.retrieval_heads                     # both models (~30 min on 2 CPU cores)
    python -m analyses.retrieval_heads --quick             # a few minutes
    python -m analyses.retrieval_heads --models gemma3-270m --lengths 1024 2048
    python -m analyses.retrieval_heads --reuse --ks 0 2 5     # new ablation, saved detections
    accelerate launch --multi_gpu --num_processes 2 -m analyses.retrieval_heads --quick   # two processes

Runs unchanged under ``accelerate launch`` (:mod:`analyses.sweep`), model by model, in two sweeps:
one job per detection trial (length, depth, needle seed), whose scores every process receives for
the ranking, then one job per ablation sample (task, seed) running every ablated head set on it.
Each finished job is kept as a part (``OUT/.retrieval_heads_parts``), all of them in one file once
the outputs are written (:func:`analyses.sweep.finish`); ``--resume`` runs only the jobs no part
holds. The outputs equal a single process's.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

import probe
from probe import answer, tasks
from probe.checks import model_context
from probe.results import write_json

from .arguments import add_device_arguments, check_device_arguments, check_out, load, resume_settings
from .output import atomic_write, save_figure
from .sweep import Tables, finish, is_main_process, sweep

NAME = "retrieval_heads"
ABLATION_SEED = 1000  # ablation samples use seeds from here on: never the detection samples
ACCURACY_KEYS = ["task", "ablated", "k", "draw", "heads"]  # one accuracy per ablated head set and task

#: An ablated head set: (``"none" | "retrieval heads" | "random heads"``, k, random draw,
#: the (layer, head) pairs zeroed).
Condition = tuple[str, int, int, list[tuple[int, int]]]


def detection_trial(model, tokenizer, args: argparse.Namespace, job: tuple) -> Tables:
    """One detection job ``("detection", model label, length, depth, needle seed)``: the trial's
    :class:`probe.RetrievalScores` (scores Tensor[1, layers, heads]) in a one-cell ``result`` table;
    :meth:`probe.RetrievalScores.concat` joins the trials again."""
    _, _, length, depth, seed = job
    sample = tasks.make(args.task, tokenizer, length, seed=seed, depth=depth)
    return {"result": pd.DataFrame({"result": [probe.retrieval_scores(model, tokenizer, [sample])]})}


def conditions(
    ranked: list[tuple[int, int]], ks: list[int], random_draws: int = 1, seed: int = 0
) -> list[Condition]:
    """The ablated head sets: none, then for each k > 0 the top k of ``ranked`` and ``random_draws``
    sets of k random heads from outside the top max(ks) (drawn in that order from ``seed``): Wu et
    al.'s (2024) comparison of masking retrieval heads against masking random heads.

    ``ranked``: (layer, head) pairs, best retrieval score first.
    """
    top, others = ranked[: max(ks)], ranked[max(ks) :]
    rng = np.random.default_rng(seed)
    chosen: list[Condition] = [("none", 0, 0, [])]
    for k in (k for k in ks if k > 0):
        chosen.append(("retrieval heads", k, 0, top[:k]))
        for draw in range(random_draws):
            picked = rng.choice(len(others), size=min(k, len(others)), replace=False)
            chosen.append(("random heads", k, draw, [others[i] for i in picked]))
    return chosen


def ablate_sample(model, tokenizer, sample: tasks.Sample, ablated: list[Condition]) -> pd.DataFrame:
    """Greedy correctness of ``sample`` with each head set of ``ablated`` zeroed: one row per set
    (task, seed, ablated, k, draw, heads as ``"layer-head ..."``, correct 0/1)."""
    rows = []
    for name, k, draw, heads in ablated:
        with probe.ablate_heads(model, heads):
            correct = sample.score(answer(model, tokenizer, sample))
        labels = " ".join(f"{layer}-{head}" for layer, head in heads)
        setting = dict(ablated=name, k=k, draw=draw, heads=labels)
        rows.append(dict(task=sample.task, seed=sample.seed, **setting, correct=correct))
    return pd.DataFrame(rows)


def ablation_sample(
    model, tokenizer, args: argparse.Namespace, ablated: list[Condition], job: tuple
) -> Tables:
    """One ablation job ``("ablation", model label, task, seed)``: :func:`ablate_sample` on that sample."""
    _, _, task, seed = job
    sample = tasks.make(task, tokenizer, args.ablation_length, seed=seed, model=model)
    return {"rows": ablate_sample(model, tokenizer, sample, ablated)}


def accuracy(rows: pd.DataFrame) -> pd.DataFrame:
    """Greedy accuracy per task and ablated head set (mean of :func:`ablate_sample`'s ``correct``
    over the samples), in the order the rows first name them."""
    return rows.groupby(ACCURACY_KEYS, sort=False).correct.mean().rename("accuracy").reset_index()


def ablation(
    model,
    tokenizer,
    ranked: list[tuple[int, int]],
    task_names: list[str],
    length: int,
    n_samples: int,
    ks: list[int],
    random_draws: int = 1,
    seed: int = 0,
) -> pd.DataFrame:
    """Greedy accuracy with the top-k heads of ``ranked`` ablated vs k random heads outside the top max(ks).

    ``ranked``: (layer, head) pairs, best retrieval score first. Samples use seeds from
    ``ABLATION_SEED`` on, at random depths. One row per (task, ablated set, k, draw), in one
    process (``main`` spreads the same samples over a sweep).
    """
    ablated = conditions(ranked, ks, random_draws, seed)
    samples = [
        tasks.make(task, tokenizer, length, seed=ABLATION_SEED + i, model=model)
        for task in task_names
        for i in range(n_samples)
    ]
    rows = [ablate_sample(model, tokenizer, sample, ablated) for sample in samples]
    return accuracy(pd.concat(rows, ignore_index=True))


def plot_scores(scores: pd.DataFrame) -> plt.Figure:
    """Layer x head heatmaps of the mean retrieval score, one panel per model."""
    models = list(scores.model.unique())
    fig, axes = plt.subplots(1, len(models), figsize=(3 + 2.6 * len(models), 7), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        grid = scores[scores.model == model].pivot(index="layer", columns="head", values="score")
        sns.heatmap(
            grid,
            ax=ax,
            vmin=0,
            vmax=max(scores.score.max(), 0.1),
            cmap="rocket_r",
            cbar_kws={"label": "retrieval score"},
        )
        ax.set(title=model, xlabel="query head", ylabel="layer")
        ax.tick_params(axis="y", rotation=0)
    fig.suptitle("Retrieval score per head (Wu et al.): share of the needle copied via its argmax")
    fig.tight_layout()
    return fig


def plot_ablation(table: pd.DataFrame) -> plt.Figure:
    """Accuracy vs number of heads ablated: retrieval heads vs random heads (mean and range over the
    random draws), per model and task."""
    baseline = table[table.ablated == "none"]
    frame = pd.concat(
        [table[table.ablated != "none"]]
        + [baseline.assign(ablated=name) for name in ("retrieval heads", "random heads")]
    )
    grid = sns.relplot(
        frame,
        x="k",
        y="accuracy",
        hue="ablated",
        style="ablated",
        col="model",
        row="task",
        kind="line",
        marker="o",
        errorbar=("pi", 100),
        height=3,
        aspect=1.3,
        facet_kws={"margin_titles": True},
    )
    grid.set_axis_labels("heads ablated (k)", "greedy accuracy")
    grid.set(ylim=(-0.05, 1.05))
    title = "Ablating the top-k retrieval heads vs k random heads (band: range over random draws)"
    grid.figure.suptitle(title, y=1.03)
    return grid.figure


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--task", default="niah", choices=["niah", "passkey", "multivalue-niah"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 1024])
    parser.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--needles", type=int, default=2, help="samples (seeds) per length and depth")
    parser.add_argument("--ablation-tasks", nargs="+", default=["passkey", "niah"])
    parser.add_argument("--ablation-length", type=int, default=512)
    parser.add_argument("--ablation-samples", type=int, default=8)
    parser.add_argument("--ks", nargs="+", type=int, default=[0, 5, 10, 20], help="numbers of heads ablated")
    parser.add_argument("--random-draws", type=int, default=1, help="random head sets per k")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random head draws")
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--reuse", action="store_true", help="read detections already in --out")
    parser.add_argument("--resume", action="store_true", help="keep the jobs a killed run finished")
    parser.add_argument("--quick", action="store_true", help="512 tokens, 3 depths, 6 ablation samples")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.depths, args.needles = [512], [0.2, 0.5, 0.8], 1
        args.ablation_tasks, args.ablation_length = ["passkey"], 512
        args.ablation_samples, args.ks = 6, [0, 5, 10]
    if min(args.needles, args.ablation_samples, args.random_draws) < 1:
        parser.error("--needles, --ablation-samples and --random-draws must be at least 1")
    if min(args.ks) < 0 or min(args.lengths) < 64 or args.ablation_length < 64:
        parser.error("--ks must be numbers of heads >= 0, --lengths and --ablation-length at least 64 tokens")
    if not all(0 <= depth <= 1 for depth in args.depths):
        parser.error("--depths are fractions of the context, between 0 and 1")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


def detected(
    model, tokenizer, label: str, args: argparse.Namespace, parts: Path
) -> tuple[probe.RetrievalScores, pd.DataFrame]:
    """Detection for one model, on every process: one sweep job per trial of the grid lengths x
    depths x needles (seeds) of ``args.task``. The main process writes the JSON and the trials CSV
    as soon as it is done; with ``--reuse`` both are read back from ``--out`` instead when there."""
    scores_file, trials_file = args.out / f"{NAME}_{label}.json", args.out / f"{NAME}_{label}_trials.csv"
    if args.reuse and scores_file.exists() and trials_file.exists():
        return probe.RetrievalScores.load(scores_file), pd.read_csv(trials_file)
    jobs = [
        ("detection", label, length, depth, seed)
        for length in args.lengths
        for depth in args.depths
        for seed in range(args.needles)
    ]
    run = functools.partial(detection_trial, model, tokenizer, args)
    found = sweep(
        jobs,
        run,
        parts,
        args.resume,
        desc=f"detection {label}",
        everywhere=True,
        settings=resume_settings(args),
    )
    result = probe.RetrievalScores.concat(list(found["result"].result))
    trials = result.trials.assign(model=label)
    if is_main_process():
        write_json(scores_file, result.to_json())
        atomic_write(trials_file, lambda tmp: trials.to_csv(tmp, index=False))
    return result, trials


def main(argv: list[str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Run detection and ablation for every model; returns (scores, ablation) tables (empty ones on
    the processes of an ``accelerate launch`` other than the main one)."""
    args = parse_args(argv)
    parts = args.out / f".{NAME}_parts"
    scores, ablations = [], []
    for name in args.models:
        model, tokenizer = load(args, name)
        context = model_context(model)
        if max(args.lengths + [args.ablation_length]) > context:
            raise SystemExit(f"--lengths / --ablation-length exceed {name}'s context of {context} tokens")
        label = Path(name).name
        result, trials = detected(model, tokenizer, label, args, parts)
        scores.append(result.to_frame().assign(model=label))
        if is_main_process():
            top = result.top(5).round(3).to_string(index=False)
            print(
                f"{label}: {trials.correct.mean():.0%} of {len(trials)} trials correct; LOGO retrieval "
                f"score {result.logo_score():.3f}; top heads\n{top}"
            )
        ranked = list(result.to_frame()[["layer", "head"]].itertuples(index=False, name=None))
        ablated = conditions(ranked, args.ks, args.random_draws, args.seed)
        jobs = [
            ("ablation", label, task, ABLATION_SEED + i)
            for task in args.ablation_tasks
            for i in range(args.ablation_samples)
        ]
        run = functools.partial(ablation_sample, model, tokenizer, args, ablated)
        found = sweep(jobs, run, parts, args.resume, desc=f"ablation {label}", settings=resume_settings(args))
        if found is not None:  # None: not the main process of an accelerate launch
            ablations.append(accuracy(found["rows"]).assign(model=label))

    if not is_main_process():  # the main process writes the outputs
        return pd.DataFrame(), pd.DataFrame()
    scores, ablations = pd.concat(scores, ignore_index=True), pd.concat(ablations, ignore_index=True)
    save_figure(plot_scores(scores), scores, args.out, f"{NAME}_scores")
    save_figure(plot_ablation(ablations), ablations, args.out, f"{NAME}_ablation")
    finish(parts)  # every output is written: a --resume now runs nothing
    print(ablations.drop(columns="heads").to_string(index=False))
    return scores, ablations


if __name__ == "__main__":
    main()
