"""Which context tokens does the model really use, and which detector finds them? (the main job)

For each sample the model first answers greedily (scored against the gold answer); then, with
the gold answer teacher-forced, every chosen detector from the registry scores every token,
and :func:`probe.metrics.evaluate` compares the scores with the sample's exact spans. Writes,
with the CSV behind each figure (``{tag}`` = model and length):

- ``detector_{tag}_categories``: share of each detector's top-k tokens per category (CDT Fig. 7);
- ``detector_{tag}_layers``: per layer, how much more attention / information flow from the
  answer rows each category's tokens get than the average context token, correct vs wrong
  answers (CDT Fig. 3);
- ``detector_{tag}_scores``: AUROC, precision, recall and fact hit rate per detector;
- ``detector_{tag}_metrics.csv``: every metric per detector and sample.

    python -m analyses.detector_compare                               # quick default, SmolLM2, ~1K tokens
    python -m analyses.detector_compare --model gemma3-270m --length 2048
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from tqdm.auto import tqdm

import probe
from analyses.output import atomic_write, save_figure
from probe import detectors, metrics, tasks
from probe.generation import answer

QUICK_DETECTORS = [name for name in detectors.names() if name != "integrated_gradients"]
LAYER_CATEGORIES = ("supporting", "interference", "noise", "low_frequency", "other")
SCORE_COLUMNS = {
    "auroc": "AUROC (supporting)",
    "precision_supporting": "precision (supporting)",
    "recall_supporting": "recall (supporting)",
    "precision_critical": "precision (sup.+interf.)",
    "recall_critical": "recall (sup.+interf.)",
    "fact_hit_rate": "fact hit rate (top-k)",
}


def layer_enrichment(per_layer: torch.Tensor, sample: tasks.Sample) -> pd.DataFrame:
    """Per layer and category: mean score per token of the category / mean score per context token.

    ``per_layer`` is [layers, seq]. 1 means a category gets its size's worth of the measure;
    noise covers most of the context, so raw shares would mostly show category sizes.
    """
    context = sample.prompt_length
    frame = pd.DataFrame(per_layer[:, :context].T.numpy())
    labels = sample.categories[:context]
    frame["category"] = [label if label in LAYER_CATEGORIES else "other" for label in labels]
    enrichment = frame.groupby("category").mean() / frame.drop(columns="category").mean()
    enrichment = enrichment.reindex(LAYER_CATEGORIES).dropna()
    return (
        enrichment.rename_axis("category")
        .reset_index()
        .melt("category", var_name="layer", value_name="enrichment")
    )


def compare_sample(
    model,
    tokenizer,
    sample: tasks.Sample,
    names: list[str],
    top_k: int,
    max_new_tokens: int,
    options: dict[str, dict] | None = None,
):
    """(metric rows, per-layer rows) of every detector in ``names`` (with ``options[name]``) on one sample."""
    generated = answer(model, tokenizer, sample, max_new_tokens)
    about = {
        "task": sample.task,
        "seed": sample.seed,
        "generated": generated,
        "correct": bool(sample.score(generated)),
    }
    rows, layers = [], []
    for name in names:
        detection = probe.detect(name, model, tokenizer, sample, **(options or {}).get(name, {}))
        rows.append(
            {
                "detector": name,
                **about,
                **metrics.evaluate(detection, sample, top_k),
                **_diagnostics(detection),
            }
        )
        if name in ("attention", "information_flow"):
            layers.append(
                layer_enrichment(detection.details["per_layer"], sample).assign(measure=name, **about)
            )
    return rows, layers


def _diagnostics(detection: detectors.Detection) -> dict:
    return {key: value for key, value in detection.details.items() if isinstance(value, float)}


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
    data = layers.assign(answer=layers.correct.map({True: "correct", False: "wrong"}))
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m", help="model name or local HF folder")
    parser.add_argument("--tasks", nargs="+", default=["multihop-1", "multihop-2"], choices=tasks.names())
    parser.add_argument("--length", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--samples", type=int, default=8, help="samples per task")
    parser.add_argument("--detectors", nargs="+", default=QUICK_DETECTORS, choices=detectors.names())
    parser.add_argument("--top-k", type=int, default=30, help="k of the top-k sets (CDT uses 30)")
    parser.add_argument(
        "--lsd-k", type=int, default=None, help="short context K of lsd (default: length / 4)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.length < 64:
        parser.error("--length must be at least 64 tokens")
    return args


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    model, tokenizer = probe.load_model(args.model)
    context = model.config.get_text_config().max_position_embeddings
    if args.length + args.max_new_tokens > context:
        raise SystemExit(
            f"--length {args.length} (+ the answer) exceeds {args.model}'s context of {context} tokens"
        )

    lsd_k = args.lsd_k or args.length // 4
    options = {"lsd": {"K": lsd_k, "d": max(lsd_k // 2, 1)}}
    options |= {name: {"top_k": args.top_k} for name in args.detectors if "top_k" in detectors.options(name)}
    rows, layers = [], []
    jobs = [(task, args.seed + i) for task in args.tasks for i in range(args.samples)]
    for task, seed in tqdm(jobs, desc=f"detector_compare {args.model}"):
        sample = tasks.make(task, tokenizer, args.length, seed=seed)
        sample_rows, sample_layers = compare_sample(
            model, tokenizer, sample, args.detectors, args.top_k, args.max_new_tokens, options
        )
        rows += sample_rows
        layers += sample_layers

    table = pd.DataFrame(rows).assign(model=args.model, length=args.length)
    tag = f"{Path(args.model).name}-{args.length}"
    atomic_write(args.out / f"detector_{tag}_metrics.csv", lambda tmp: table.to_csv(tmp, index=False))
    fig, shares = plot_categories(table)
    save_figure(fig, shares, args.out, f"detector_{tag}_categories")
    fig, summary = plot_scores(table)
    save_figure(fig, summary, args.out, f"detector_{tag}_scores")
    if layers:
        layer_table = pd.concat(layers, ignore_index=True)
        save_figure(plot_layers(layer_table), layer_table, args.out, f"detector_{tag}_layers")
    accuracy = table.drop_duplicates(["task", "seed"]).groupby("task").correct.mean()
    print(f"accuracy by task:\n{accuracy.to_string()}\n\n{summary.round(3).to_string(index=False)}")
    return table


if __name__ == "__main__":
    main()
