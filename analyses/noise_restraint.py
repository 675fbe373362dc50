"""Context-noise restraint (CDT §3.2, Fig. 4): does moving the noise embeddings against their
gradient (E' = E − lr·β·∇E, CDT eq. 2) raise the attention of the answer rows on the supporting facts?

For each multi-hop sample the model first answers greedily (scored against the gold answer); then,
with the gold answer teacher-forced, :func:`probe.probes.noise_restraint.noise_restraint` moves the chosen
tokens'
embeddings by a sweep of step sizes lr·β and measures, per layer, the attention mass from the answer
rows on each token category before and after, and the answer loss. Writes ``noise_restraint.png``
and ``noise_restraint.csv`` (one row per model, sample, step, layer and category).

    python -m analyses.noise_restraint                  # SmolLM2 and Gemma 3 270M, 1K tokens, 8 samples
    python -m analyses.noise_restraint --quick          # 2 samples per model, 4 step sizes
    python -m analyses.noise_restraint --models smollm2-135m --steps 0.1 1 --move detected
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from probe import answer, tasks
from probe.probes import noise_restraint

from .arguments import add_device_arguments, check_device_arguments, check_out, load, resume_settings
from .output import save_figure
from .sweep import finish, sweep

NAME = "noise_restraint"
STEPS = [0.001, 0.01, 0.1, 1.0, 10.0]  # lr·β, from "the loss barely moves" to "the input is destroyed"
SHOWN = ("supporting", "interference", "noise", "low_frequency")


def restrain_sample(model, tokenizer, args: argparse.Namespace, seed: int) -> pd.DataFrame:
    """One sample: the greedy answer and :func:`probe.probes.noise_restraint.noise_restraint` for every step
    size."""
    sample = tasks.make(args.task, tokenizer, args.length, seed=seed, model=model)
    generated = answer(model, tokenizer, sample, args.max_new_tokens)
    lrs = [step / args.beta for step in args.steps]
    table = noise_restraint.noise_restraint(model, sample, lrs, beta=args.beta, move=args.move)
    return table.assign(
        task=args.task,
        length=len(sample.input_ids),
        seed=seed,
        generated=generated,
        correct=bool(sample.score(generated)),
    )


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per model and step: answer loss before/after and the supporting-fact attention ratio.

    Ratios are of masses averaged over samples (a ratio of means); ``best_layer`` is the layer
    where that ratio is largest.
    """
    supporting = table[table.category == "supporting"]
    layer = supporting.groupby(["model", "step", "layer"])[["before", "after"]].mean()
    layer_ratio = (layer.after / layer.before).rename("ratio").reset_index()
    best = layer_ratio.loc[layer_ratio.dropna().groupby(["model", "step"]).ratio.idxmax()]
    overall = supporting.groupby(["model", "step"]).agg(
        samples=("seed", "nunique"),
        accuracy=("correct", "mean"),
        loss_before=("loss_before", "mean"),
        loss_after=("loss_after", "mean"),
        shift=("shift", "mean"),
        before=("before", "mean"),
        after=("after", "mean"),
    )
    overall["ratio_all_layers"] = overall.after / overall.before
    best = best.set_index(["model", "step"]).rename(columns={"layer": "best_layer", "ratio": "best_ratio"})
    return overall.join(best).reset_index()


def plot(table: pd.DataFrame) -> plt.Figure:
    """One row of panels per model: supporting mass per layer, its ratio, ratios per category, loss."""
    data = table.assign(
        answer=table.correct.map({True: "correct", False: "wrong"}),
        step=table.step.map("{:g}".format),
    )
    models = list(data.model.unique())
    fig, axes = plt.subplots(len(models), 4, figsize=(20, 4.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        frame = data[data.model == model]
        supporting = frame[frame.category == "supporting"]
        per_layer = supporting.groupby(["step", "layer"], as_index=False)[["before", "after"]].mean()
        original = per_layer[per_layer.step == per_layer.step.iloc[0]]
        row[0].plot(original.layer, original.before, color="black", linestyle="--", label="before")
        sns.lineplot(data=per_layer, x="layer", y="after", hue="step", ax=row[0], palette="viridis")
        row[0].set(yscale="log", ylabel="attention mass on supporting facts", title=f"{model}: per layer")
        row[0].legend(title="after, lr·β =", fontsize=8)

        ratios = supporting.groupby(["step", "answer", "layer"], as_index=False)[["before", "after"]].mean()
        sns.lineplot(
            data=ratios.assign(ratio=ratios.after / ratios.before),
            x="layer",
            y="ratio",
            hue="step",
            style="answer",
            style_order=["correct", "wrong"],
            palette="viridis",
            ax=row[1],
        )
        row[1].axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        row[1].set(yscale="log", ylabel="after ÷ before (supporting)", title="ratio per layer, by answer")
        row[1].legend(fontsize=8)

        shown = frame[frame.category.isin(SHOWN)]
        masses = shown.groupby(["step", "category"], as_index=False)[["before", "after"]].mean()
        sns.barplot(
            data=masses.assign(ratio=masses.after / masses.before),
            x="step",
            y="ratio",
            hue="category",
            hue_order=list(SHOWN),
            ax=row[2],
        )
        row[2].axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        row[2].set(yscale="log", xlabel="lr·β", ylabel="after ÷ before (all layers)", title="per category")
        row[2].legend(fontsize=8)

        losses = supporting.drop_duplicates(["seed", "step"])[["step", "loss_before", "loss_after"]]
        losses = losses.rename(columns={"loss_before": "before", "loss_after": "after"})
        losses = losses.melt(["step"], ["before", "after"], var_name="embeddings", value_name="loss")
        sns.pointplot(data=losses, x="step", y="loss", hue="embeddings", ax=row[3], errorbar=("pi", 100))
        row[3].set(xlabel="lr·β", ylabel="answer loss (nats)", title="answer loss (range over samples)")
    fig.suptitle(
        "Context-noise restraint (CDT §3.2): moving the noise embeddings against their gradient, "
        "attention from the answer rows"
    )
    fig.tight_layout()
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--task", default="multihop-1", choices=[t for t in tasks.names() if "multihop" in t])
    parser.add_argument("--length", type=int, default=1024, help="prompt length in tokens")
    parser.add_argument("--samples", type=int, default=8, help="samples (seeds seed..seed+n-1) per model")
    parser.add_argument("--steps", nargs="+", type=float, default=STEPS, help="step sizes lr·β of CDT eq. 2")
    parser.add_argument("--beta", type=float, default=5.0, help="β of CDT eq. 2 (lr = step / β)")
    parser.add_argument(
        "--move", default="noise", choices=[*noise_restraint.MOVES, "detected"], help="which tokens to move"
    )
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--quick", action="store_true", help="2 samples per model, steps 0.01 0.1 1 10")
    parser.add_argument("--resume", action="store_true", help="keep the samples a killed run finished")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.steps = 2, [0.01, 0.1, 1.0, 10.0]
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    jobs = [(name, seed) for name in args.models for seed in range(args.seed, args.seed + args.samples)]
    loaded = {}

    def run(job: tuple) -> dict[str, pd.DataFrame]:
        name, seed = job
        if name not in loaded:
            loaded[name] = load(args, name)
        return {"rows": restrain_sample(*loaded[name], args, seed).assign(model=Path(name).name)}

    parts = args.out / f".{NAME}_parts"
    found = sweep(jobs, run, parts, args.resume, desc=NAME, settings=resume_settings(args))
    if found is None:  # not the main process of an accelerate launch: it writes the outputs
        return pd.DataFrame()
    table = found["rows"]
    save_figure(plot(table), table, args.out, NAME)
    finish(parts)  # every output is written: a --resume now runs nothing
    print(summary(table).round(4).to_string(index=False))
    return table


if __name__ == "__main__":
    main()
