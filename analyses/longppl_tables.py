"""The LongPPL study's tables and figures (:mod:`analyses.longppl`), from its rows: answer tokens
classified by LSD / LSD + LCL, accuracy against the PPL of answer and other tokens, and the correlation of
each perplexity measure with accuracy across model variants; the markdown for RESULTS.md.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from sklearn.metrics import accuracy_score, balanced_accuracy_score

from probe import stats

METRICS = ("ppl", "longppl", "longppl_soft")


METHODS = ("pearson", "spearman")


def answer_points(tokens: pd.DataFrame) -> pd.DataFrame:
    """Per (model, length): accuracy and the PPL of answer / non-answer tokens (Fig. 2b–c)."""
    correct = tokens[tokens.kind == "answer"].groupby(["model", "length", "seed"]).greedy.all()
    nll = tokens.assign(nll=-tokens.lcl).pivot_table(index=["model", "length"], columns="kind", values="nll")
    points = correct.groupby(["model", "length"]).mean().rename("accuracy").to_frame()
    points["ppl_answer"] = np.exp(nll["answer"])
    points["ppl_non_answer"] = np.exp(nll["non-answer"])
    return points.reset_index()


def classification(tokens: pd.DataFrame, alpha: float, beta: float) -> pd.DataFrame:
    """Accuracy of LSD > α and of LSD > α ∧ LCL > β at telling answer tokens from the others (Fig. 4b)."""
    rows = []
    for model, group in tokens.dropna(subset=["lsd"]).groupby("model"):
        truth = group.kind == "answer"
        rules = {"LSD only": group.lsd > alpha, "LSD + LCL": (group.lsd > alpha) & (group.lcl > beta)}
        for rule, predicted in rules.items():
            rows.append(
                dict(
                    model=model,
                    rule=rule,
                    accuracy=accuracy_score(truth, predicted),
                    balanced_accuracy=balanced_accuracy_score(truth, predicted),
                    answer_tokens=int(truth.sum()),
                    other_tokens=int((~truth).sum()),
                )
            )
    return pd.DataFrame(rows)


def plot_answer_ppl(points: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for ax, column, title in zip(
        axes, ["ppl_answer", "ppl_non_answer"], ["answer tokens", "non-answer tokens"], strict=True
    ):
        sns.scatterplot(points, x=column, y="accuracy", hue="model", size="length", ax=ax)
        ax.set(xscale="log", xlabel=f"PPL on {title}", title=title)
    fig.suptitle("LongEval lines: accuracy vs perplexity (each point: a model at one prompt length)")
    fig.tight_layout()
    return fig


def plot_answer_lsd(tokens: pd.DataFrame, alpha: float, beta: float) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    scored = tokens.dropna(subset=["lsd"])
    sns.histplot(scored, x="lsd", hue="kind", stat="density", common_norm=False, bins=40, ax=axes[0])
    axes[0].axvline(alpha, color="k", ls="--", lw=1)
    axes[0].set(xlabel="LSD (nats)", title="LSD of answer vs non-answer tokens")
    sns.scatterplot(scored, x="lsd", y="lcl", hue="kind", style="model", s=14, alpha=0.6, ax=axes[1])
    axes[1].axvline(alpha, color="k", ls="--", lw=1)
    axes[1].axhline(beta, color="k", ls="--", lw=1)
    axes[1].set(xlabel="LSD (nats)", ylabel="LCL = log P(x | long)", title="key tokens: upper right")
    fig.tight_layout()
    return fig


def correlation_table(variants: pd.DataFrame) -> pd.DataFrame:
    """Pearson and Spearman r of log PPL, LongPPL, LongPPL-soft (mean NLLs: the perplexities of our
    variants span orders of magnitude) with the mean accuracy, over the variants where both are
    defined, with 95 % bootstrap intervals (NaN with fewer than 3 such variants, or when either is
    the same for all)."""
    rows = []
    for metric in METRICS:
        pairs = variants[[metric, "accuracy"]].dropna()
        for method in METHODS:
            row = dict(metric=metric, method=method, r=np.nan, low=np.nan, high=np.nan, n=len(pairs))
            if len(pairs) >= 3 and (pairs.nunique() > 1).all():
                estimate = stats.correlation(np.log(pairs[metric]), pairs["accuracy"], method)
                row |= dict(r=estimate.value, low=estimate.low, high=estimate.high)
            rows.append(row)
    return pd.DataFrame(rows)


def plot_correlation(variants: pd.DataFrame, table: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, len(METRICS), figsize=(13, 4), sharey=True)
    r = table.set_index(["metric", "method"]).r
    for ax, metric in zip(axes, METRICS, strict=True):
        sns.scatterplot(variants, x=metric, y="accuracy", hue="model", style="setting", s=60, ax=ax)
        ax.set(title=f"{metric}: Pearson {r[metric, 'pearson']:.2f}, Spearman {r[metric, 'spearman']:.2f}")
        ax.set_xscale("log")
        if ax is not axes[-1] and ax.get_legend() is not None:  # no legend when every value is NaN
            ax.get_legend().remove()
    fig.suptitle("Model variants (attention window W, RoPE base factor): accuracy vs perplexity measures")
    fig.tight_layout()
    return fig


def markdown(
    settings: str, classes: pd.DataFrame, points: pd.DataFrame, table: pd.DataFrame, variants: pd.DataFrame
) -> str:
    def md(frame: pd.DataFrame) -> str:
        cells = frame.map(lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
        lines = [" | ".join(frame.columns), " | ".join("---" for _ in frame.columns)]
        return "\n".join(f"| {line} |" for line in lines + [" | ".join(row) for row in cells.values])

    return "\n\n".join(
        [
            settings,
            "### Answer tokens: classification by LSD / LSD + LCL\n\n" + md(classes),
            "### Accuracy vs PPL on answer / non-answer tokens\n\n" + md(points),
            "### Correlation with mean accuracy across variants (Pearson of the log; 95 % bootstrap "
            "interval over variants)\n\n" + md(table),
            "### Variants\n\n" + md(variants.drop(columns="setting")),
        ]
    )
