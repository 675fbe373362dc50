"""The detector comparison's outputs (:mod:`analyses.detector_compare`): every figure with the CSV behind
it, the ranks and verdicts, each figure captioned with the run it shows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from probe import metrics

from .comparison import (
    ANSWERS,
    LOO_RANKER,
    REFERENCES,
    answer_label,
    deletion_curves,
    faithfulness_intervals,
    faithfulness_summary,
    rank_table,
    ranks_markdown,
    verdicts_markdown,
)
from .output import atomic_write, save_figure
from .study_files import length_of

SCORE_COLUMNS = {
    "auroc": "AUROC (supporting)",
    "precision_supporting": "precision (supporting)",
    "recall_supporting": "recall (supporting)",
    "precision_critical": "precision (sup.+interf.)",
    "recall_critical": "recall (sup.+interf.)",
    "fact_hit_rate": "fact hit rate (top-k)",
}


def plot_categories(table: pd.DataFrame):
    shares = table.melt(
        id_vars=["detector", "correct"],
        value_vars=[f"share_top_k_{c}" for c in metrics.SHARE_CATEGORIES],
        var_name="category",
        value_name="share",
    )
    shares["category"] = shares.category.str.removeprefix("share_top_k_")
    fig, ax = plt.subplots(figsize=(10, 4))
    sns.barplot(data=shares, x="detector", y="share", hue="category", errorbar=None, ax=ax)
    ax.set(ylabel="share of the top-k tokens", xlabel="", title="Where each detector's top-k tokens fall")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(title="category", bbox_to_anchor=(1.01, 1), loc="upper left")
    return fig, shares.groupby(["detector", "category"], as_index=False).share.mean()


def plot_layers(layers: pd.DataFrame):
    data = layers.assign(answer=answer_label(layers.correct))
    grid = sns.relplot(
        data=data[data.category != "other"],
        x="layer",
        y="enrichment",
        hue="category",
        style="answer",
        style_order=["correct", "wrong"],
        col="measure",
        kind="line",
        errorbar=None,
        height=3.4,
        aspect=1.3,
    )
    grid.set(yscale="log")
    for ax in grid.axes.flat:
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    grid.set_axis_labels("layer", "per-token share ÷ context average")
    grid.set_titles("{col_name} from the answer rows")
    return grid.figure


def plot_scores(table: pd.DataFrame):
    summary = table.groupby("detector")[list(SCORE_COLUMNS)].mean().rename(columns=SCORE_COLUMNS)
    summary = summary.sort_values(SCORE_COLUMNS["auroc"], ascending=False)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(summary) + 1.5))
    sns.heatmap(summary, annot=True, fmt=".2f", vmin=0, vmax=1, cmap="viridis", ax=ax, cbar=False)
    ax.set(xlabel="", ylabel="", title="Detectors against the ground-truth spans (mean over samples)")
    ax.tick_params(axis="x", rotation=25)
    return fig, summary.reset_index()


def plot_deletion(faithful: pd.DataFrame) -> plt.Figure:
    """Mean log-prob drop of the gold answer vs k sources removed, one line per scorer (references
    dashed), one panel per answer group (correct / wrong, with its number of samples)."""
    curves = deletion_curves(faithful)
    counts = answer_label(faithful.drop_duplicates(["task", "seed"]).correct).value_counts()
    curves["answer"] = [f"{ANSWERS[a]} (n = {counts[a]})" for a in curves.answer]
    names = list(dict.fromkeys(faithful.scorer[faithful.kind == "detector"]))
    colors = [c for i, c in enumerate(sns.color_palette("tab20")) if i not in (14, 15)]  # greys: references
    colors = colors[::2] + colors[1::2]  # the strong shades first
    palette = {name: colors[i % len(colors)] for i, name in enumerate(names)}
    palette |= {"ground_truth": "black", "random_sources": "grey", "additive_ceiling": "darkred"}
    grid = sns.relplot(
        data=curves,
        x="k",
        y="drop",
        hue="scorer",
        hue_order=[*names, *REFERENCES],
        palette=palette,
        style="kind",
        style_order=["detector", "reference"],
        dashes={"detector": "", "reference": (4, 2)},
        markers={"detector": "o", "reference": "X"},
        col="answer",
        col_order=sorted(curves.answer.unique()),
        kind="line",
        errorbar=None,
        height=3.6,
        aspect=1.1,
    )
    ks = sorted(curves.k.unique())
    grid.set(xscale="log", xticks=ks, xticklabels=[str(k) for k in ks])
    for ax in grid.axes.flat:
        ax.axhline(0.0, color="grey", linewidth=0.8, linestyle=":")
        ax.minorticks_off()
    grid.set_axis_labels("top-k sources removed (key-masked)", "drop of the gold answer's log-prob (nats)")
    grid.set_titles("{col_name}")
    grid.figure.suptitle("Deletion curves: removing each scorer's top sources", y=1.03)
    return grid.figure


def plot_intervals(intervals: pd.DataFrame) -> plt.Figure:
    """Each scorer's mean AOPC of comprehensiveness and LDS over all samples with 95 % intervals,
    and its difference from ``leave_one_out`` (the exact ablation), sorted by LDS."""
    data = intervals[intervals.answer == "all"]
    panels = [("aopc_comprehensiveness", "", "AOPC of comprehensiveness (nats)"), ("lds", "", "LDS")]
    if "leave_one_out" in set(data.versus):
        panels.append(("lds", "leave_one_out", "LDS − leave_one_out's"))
    order = data[(data.metric == "lds") & (data.versus == "")].sort_values("value", ascending=False).scorer
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.2 * len(panels), 0.35 * len(order) + 1.6), sharey=True
    )
    for ax, (metric, versus, label) in zip(np.atleast_1d(axes), panels, strict=True):
        part = data[(data.metric == metric) & (data.versus == versus)].set_index("scorer").reindex(order)
        y = np.arange(len(order))
        ax.errorbar(part.value, y, xerr=[part.value - part.low, part.high - part.value], fmt="o", capsize=3)
        ax.axvline(0, color="grey", linewidth=0.8, linestyle=":")
        labels = [f"{name} (ref.)" if name in REFERENCES else name for name in order]
        ax.set(xlabel=label, yticks=y, yticklabels=labels)
    n = int(data.samples.max())
    fig.suptitle(f"Faithfulness per scorer, mean over {n} samples with 95 % bootstrap intervals", y=1.02)
    axes[0].invert_yaxis()
    return fig


def caption(args: argparse.Namespace, samples: int, with_loo: bool) -> str:
    """What every figure of a run says about it: model, length, samples, tasks, which leave-one-out."""
    rankers = " and of ".join(args.loo_rank_by or [LOO_RANKER])
    pruned = f"pruned: exact on the top {args.loo_top_m} of {rankers} a sample"
    loo = f"; leave_one_out {'exhaustive' if args.loo_top_m is None else pruned}" if with_loo else ""
    length = "natural length" if args.length is None else f"{args.length} tokens"
    explains = {"own": "; explaining the model's own answers", "gold": "; explaining the gold answers"}
    about = (
        f"{args.model}, {length}, {samples} samples ({', '.join(args.tasks)}){explains.get(args.explain, '')}"
    )
    return f"{about}{loo}; (ref.): a reference row"


def captioned(fig: plt.Figure, about: str) -> plt.Figure:
    """``fig`` with ``about`` written under it."""
    fig.text(0.01, -0.01, about, fontsize=8, color="dimgrey", ha="left", va="top")
    return fig


def write_outputs(
    found: dict[str, pd.DataFrame], args, out: Path, tag: str, names: list[str]
) -> pd.DataFrame:
    """Every table and figure of the study from its tables ``found``; its metrics table."""
    settings = {"model": args.model, "length": length_of(args)}
    table = found["metrics"].assign(**settings)
    faithful = found["faithfulness"].assign(**settings)
    layers = [found["layers"]] if "layers" in found and not found["layers"].empty else []
    atomic_write(out / f"detector_{tag}_metrics.csv", lambda tmp: table.to_csv(tmp, index=False))
    if "ablations" in found:  # every masked pass, for judging other scores on these samples later
        passes = found["ablations"].assign(**settings, dtype=args.dtype or "")
        atomic_write(
            out / f"detector_{tag}_ablations.csv.gz",
            lambda tmp: passes.to_csv(tmp, index=False, compression="gzip"),
        )
    about = caption(args, table.drop_duplicates(["task", "seed"]).shape[0], "leave_one_out" in names)
    fig, shares = plot_categories(table)
    save_figure(captioned(fig, about), shares, out, f"detector_{tag}_categories")
    fig, summary = plot_scores(table)
    save_figure(captioned(fig, about), summary, out, f"detector_{tag}_scores")
    if layers:
        layer_table = layers[0]
        save_figure(captioned(plot_layers(layer_table), about), layer_table, out, f"detector_{tag}_layers")
    save_figure(captioned(plot_deletion(faithful), about), faithful, out, f"detector_{tag}_faithfulness")
    intervals = faithfulness_intervals(faithful)
    save_figure(captioned(plot_intervals(intervals), about), intervals, out, f"detector_{tag}_intervals")
    ranks = rank_table(table, faithful)
    markdown = ranks_markdown(ranks, intervals)
    atomic_write(out / f"detector_{tag}_ranks.csv", lambda tmp: ranks.to_csv(tmp, index=False))
    atomic_write(out / f"detector_{tag}_ranks.md", lambda tmp: tmp.write_text(markdown))
    if "leave_one_out" in names:  # the held-out protocol's verdicts against the ablation reference
        verdicts = verdicts_markdown(faithful, intervals)
        atomic_write(out / f"detector_{tag}_verdicts.md", lambda tmp: tmp.write_text(verdicts))
    accuracy = table.drop_duplicates(["task", "seed"]).groupby("task").correct.mean()
    print(f"accuracy by task:\n{accuracy.to_string()}\n\n{summary.round(3).to_string(index=False)}")
    print(f"\nfaithfulness:\n{faithfulness_summary(faithful).round(3).to_string(index=False)}")
    print(f"\n{markdown}")
    return table
