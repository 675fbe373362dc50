"""Real models: the context selector's mass on the first token vs layers, and lost in the middle."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from tqdm.auto import tqdm

import probe
from probe import answer, tasks
from probe.probes import position_bias
from probe.tasks.noise import essay_ids

from .presets import Preset


def first_token_mass(model_name: str, model, tokenizer, preset: Preset) -> pd.DataFrame:
    """Token-1 mass of the context selector ``P^(t)`` (eq. 4; last row, mean over rows) after each layer.

    On essay text, raw, rollout and with measured λ_t, beside the Cesàro prediction with the same λ.
    """
    rows = []
    for window, ids in enumerate(essay_ids(tokenizer, preset.text_length, preset.texts)):
        lams = position_bias.measured_mix(model, ids)
        n, n_layers = len(ids), len(lams)
        for mix, name in ((None, "raw"), (0.5, "λ = 0.5"), ("measured", "measured λ_t")):
            selector = probe.context_selector(model, ids, mix=mix)
            mixing = lams if mix == "measured" else mix
            prediction = position_bias.selector_rows(position_bias.cesaro(n), n_layers, mixing)
            for t in range(n_layers):
                rows.append(
                    {
                        "model": model_name,
                        "window": window,
                        "mix": name,
                        "layers": t + 1,
                        "last_row": selector[t, -1, 0].item(),
                        "mean_row": selector[t, 1:, 0].mean().item(),
                        "cesaro": prediction[t, 0].item(),
                        "lambda": lams[t].item(),
                    }
                )
    return pd.DataFrame(rows)


def plot_first_token_mass(table: pd.DataFrame) -> plt.Figure:
    long = table.melt(
        ["model", "window", "mix", "layers"], ["last_row", "cesaro"], var_name="source", value_name="mass"
    )
    long["source"] = long.source.map({"last_row": "measured (last token)", "cesaro": "Cesàro prediction"})
    grid = sns.relplot(
        long,
        x="layers",
        y="mass",
        hue="mix",
        style="source",
        col="model",
        kind="line",
        height=3.5,
        aspect=1.3,
        errorbar=None,
    )
    grid.set_axis_labels("layers multiplied", "P(z_last = token 1)")
    grid.figure.suptitle("Real models on essay text: context-selector mass on the first token", y=1.03)
    return grid.figure


def lost_in_the_middle(model_name: str, model, tokenizer, preset: Preset, progress: bool) -> pd.DataFrame:
    """Key–value retrieval by gold depth: accuracy, and the last prompt row's selector mass on each pair.

    The mass is that of the last layer's context selector ``P^(L−1)`` (eq. 4), raw and rollout.
    """
    rows = []
    jobs = [(d, s) for d in preset.kv_depths for s in range(preset.kv_samples)]
    for depth, seed in tqdm(jobs, desc=f"kv {model_name}", disable=not progress, leave=False):
        sample = tasks.make("kv", tokenizer, preset.kv_length, seed=seed, depth=depth)
        correct = sample.score(answer(model, tokenizer, sample))
        for mix, name in ((None, "raw"), (0.5, "λ = 0.5")):
            last = probe.context_selector(model, sample.prompt_ids, layers=[-1], mix=mix)[0, -1]
            mass = {
                c: [last[a:b].sum().item() for a, b in sample.spans[c]]
                for c in ("supporting", "interference")
            }
            rows.append(
                {
                    "model": model_name,
                    "depth": depth,
                    "seed": seed,
                    "correct": correct,
                    "mix": name,
                    "gold_mass": mass["supporting"][0],
                    "other_pair_mass": float(np.mean(mass["interference"])),
                    "pairs": 1 + len(mass["interference"]),
                    "tokens": sample.prompt_length,
                }
            )
    return pd.DataFrame(rows)


def plot_lost_in_the_middle(table: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    accuracy = table[table.mix == "raw"]
    sns.lineplot(accuracy, x="depth", y="correct", hue="model", marker="o", ax=axes[0], errorbar=None)
    axes[0].set(
        xlabel="gold pair depth (0 = start)",
        ylabel="accuracy",
        ylim=(-0.05, 1.05),
        title="Key–value retrieval by gold position",
    )
    mass = table.assign(ratio=table.gold_mass / table.other_pair_mass)
    sns.lineplot(mass, x="depth", y="ratio", hue="model", style="mix", marker="o", ax=axes[1], errorbar=None)
    axes[1].axhline(1, color="gray", lw=0.6)
    axes[1].set(
        xlabel="gold pair depth (0 = start)",
        ylabel="selector mass: gold pair / mean other pair",
        yscale="log",
        title="Final-layer context selector of the last prompt token",
    )
    return fig
