"""Content-free attention multiplied over layers beside the closed forms (Wu et al. Thms 4.1, 4.5, 4.7)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from probe.probes import position_bias


def theory_table(n: int = 64, m: float = 0.5, theta: float = 0.02, r2: float = 20.0) -> pd.DataFrame:
    """Numeric products of content-free attention beside the closed forms (query row, n tokens)."""
    rows = []
    for mix, name in ((None, "raw"), (0.5, "λ = 0.5")):
        for t, row in enumerate(position_bias.selector_rows(position_bias.cesaro(n), 32, mix)):
            rows.append(
                {
                    "family": "Cesàro",
                    "curve": name,
                    "layers": t + 1,
                    "token": 1,
                    "numeric": row[0].item(),
                    "closed_form": (
                        float(position_bias.cesaro_exact_row(n, t + 1)[0]) if mix is None else np.nan
                    ),
                }
            )
    for family, attention, closed in (
        (
            "decay m = 0.5",
            position_bias.decay_attention(n, m),
            lambda L: position_bias.decay_closed_form(n, L, m),
        ),
        (
            "RoPE θ = 0.02, r² = 20",
            position_bias.rope_attention(n, theta, r2),
            lambda L: position_bias.rope_closed_form(n, L, theta, r2),
        ),
    ):
        numeric = position_bias.selector_rows(attention, 16)
        for layers in (1, 2, 4, 8, 16):
            predicted = closed(layers)
            rows += [
                {
                    "family": family,
                    "curve": f"L = {layers}",
                    "layers": layers,
                    "token": j + 1,
                    "numeric": numeric[layers - 1, j].item(),
                    "closed_form": predicted[j].item(),
                }
                for j in range(n)
            ]
    return pd.DataFrame(rows)


def plot_theory(table: pd.DataFrame) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    cesaro = table[table.family == "Cesàro"]
    sns.lineplot(cesaro, x="layers", y="numeric", hue="curve", ax=axes[0])
    exact = cesaro.dropna(subset="closed_form")
    axes[0].scatter(
        exact.layers, exact.closed_form, s=12, color="black", label="Hausdorff closed form", zorder=3
    )
    axes[0].legend()
    axes[0].set(ylabel="P(z_64 = 1)", title="Causal mask: Cesàro powers, n = 64 (Thm 4.1)")
    for ax, family in zip(axes[1:], [f for f in table.family.unique() if f != "Cesàro"], strict=True):
        part = table[table.family == family]
        sns.lineplot(part, x="token", y="numeric", hue="curve", ax=ax, legend=True)
        ax.scatter(part.token, part.closed_form, s=6, color="black", label="closed form", zorder=3)
        ax.set(yscale="log", ylim=(1e-6, 1), ylabel="P(z_64 = j)", xlabel="token j", title=family)
    axes[1].set_title("Decay mask: negative binomial (Thm 4.5)")
    axes[2].set_title("RoPE d = 2: kernel convolution (Thm 4.7)")
    return fig
