"""The controlled study (Wu et al. §5): attention-only networks trained with no bias in the data.

The accuracy gaps per positional scheme and size beside the paper's (Figs 2/4/5), the mean attention
and context selector of the 2-layer network (Fig 9), attention sinks (Figs 10–12) and the context
selector's mass on token 1 after each layer beside Cesàro powers (Thm 4.1).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch
from tqdm.auto import tqdm

from probe.probes import position_bias
from probe.tasks.classification import Episodes, InContextClassification
from probe.training.attention_only import AttentionOnly, SANConfig, accuracy_gaps, log_mask, train_together

from ..sweep import sweep
from .presets import Preset

PANELS = {
    "No PE": {"mask": "causal", "pe": "none"},
    "Decay": {"mask": "decay", "pe": "none"},
    "RoPE": {"mask": "causal", "pe": "rope"},
}
PAIRS = ("first vs middle", "first vs last", "middle vs last")
# Wu et al., Fig 4 (pure attention) and Fig 5 (residual): (panel, residual, n_layers) -> gaps of PAIRS
PAPER_GAPS = {
    ("No PE", False, 2): (0.059, 0.077, 0.018),
    ("No PE", False, 4): (0.077, 0.094, 0.021),
    ("No PE", False, 6): (0.091, 0.106, 0.011),
    ("Decay", False, 2): (-0.055, -0.073, -0.003),
    ("Decay", False, 4): (-0.010, -0.001, 0.008),
    ("Decay", False, 6): (0.020, 0.014, -0.010),
    ("RoPE", False, 2): (0.002, -0.002, -0.009),
    ("RoPE", False, 4): (0.025, 0.043, 0.017),
    ("RoPE", False, 6): (0.026, 0.044, 0.017),
    ("No PE", True, 2): (0.247, 0.266, -0.004),
    ("No PE", True, 6): (0.107, 0.138, -0.002),
    ("No PE", True, 10): (0.011, 0.015, 0.002),
    ("Decay", True, 2): (-0.088, -0.164, -0.059),
    ("Decay", True, 6): (0.057, 0.087, 0.019),
    ("Decay", True, 10): (-0.003, -0.005, -0.011),
    ("RoPE", True, 2): (0.379, 0.394, 0.004),
    ("RoPE", True, 6): (0.436, 0.436, -0.015),
    ("RoPE", True, 10): (0.179, 0.024, -0.153),
}


def setting_name(n_layers: int, residual: bool) -> str:
    """A network size's label in the figures and CSVs, in the paper's word: ``depth 2 + res``."""
    return f"depth {n_layers}" + (" + res" if residual else "")


@dataclass(frozen=True)
class Network:
    """One network of the controlled study: positional scheme (a key of ``PANELS``), size, residual, seed."""

    panel: str
    n_layers: int
    residual: bool
    seed: int

    @property
    def setting(self) -> str:
        return setting_name(self.n_layers, self.residual)

    def config(self) -> SANConfig:
        return SANConfig(n_layers=self.n_layers, residual=self.residual, **PANELS[self.panel])


@dataclass
class Study:
    """The controlled study: one unbiased task per seed, its training batches and the trained networks.

    A seed's task and its pool of ``preset.pool`` training batches are drawn on first use; every later
    :meth:`task` call rewinds the task's generator to the state right after that draw, so each network
    of a seed sees the same data stream and every job of a sweep gives the same numbers in whichever
    process, and after whichever other jobs, it runs.
    """

    preset: Preset
    networks: dict[Network, AttentionOnly] = field(default_factory=dict)
    tasks: dict[int, InContextClassification] = field(default_factory=dict)
    pools: dict[int, Episodes | None] = field(default_factory=dict)
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def task(self, seed: int) -> InContextClassification:
        """The task of ``seed``, its generator rewound (drawing the task and ``pools[seed]`` on first use)."""
        if seed not in self.tasks:
            self.tasks[seed] = task = InContextClassification(seed=seed)
            self.pools[seed] = None if self.preset.pool is None else task.batch(128 * self.preset.pool)
            self.states[seed] = task.generator.get_state()
        self.tasks[seed].generator.set_state(self.states[seed])
        return self.tasks[seed]

    def train(self, config: SANConfig, seeds: Sequence[int]) -> list[AttentionOnly]:
        """One network of ``config`` per seed (initialised from it, trained on its task), trained together."""
        models = []
        for seed in seeds:
            torch.manual_seed(seed)
            models.append(AttentionOnly(config))
        tasks = [self.task(seed) for seed in seeds]
        data = None if self.preset.pool is None else [self.pools[seed] for seed in seeds]
        train_together(models, tasks, self.preset.steps, data=data)
        return models


def study_group(study: Study, panel: str, n_layers: int, residual: bool) -> dict[str, pd.DataFrame]:
    """One sweep job: the networks of one panel and size, all seeds trained together.

    Returns ``gaps`` (one row per seed and pair) and ``networks`` (each network's ``state_dict``, so
    the main process can rebuild the networks a sweep trained elsewhere).
    """
    seeds = study.preset.seeds
    networks = [Network(panel, n_layers, residual, seed) for seed in seeds]
    models = study.train(networks[0].config(), seeds)
    gaps, states = [], []
    for network, model in zip(networks, models, strict=True):
        study.networks[network] = model
        gaps.append(
            accuracy_gaps(model, study.task(network.seed), study.preset.test_size).assign(
                panel=panel,
                depth=n_layers,  # the CSV column keeps the paper's word
                residual=residual,
                seed=network.seed,
                setting=network.setting,
                steps=study.preset.steps,
            )
        )
        states.append({**dataclasses.asdict(network), "state": model.state_dict()})
    return {"gaps": pd.concat(gaps, ignore_index=True), "networks": pd.DataFrame(states)}


def controlled_study(
    study: Study, progress: bool = True, parts: Path | None = None, resume: bool = False
) -> pd.DataFrame:
    """Train every network of the preset into ``study.networks``; their gaps, one row per network and pair.

    A sweep (:mod:`analyses.sweep`) over panels and sizes: under ``accelerate launch`` the processes
    share the jobs and the main process gets every network back. Only the main process returns the
    gaps (the others an empty frame).
    """
    preset = study.preset
    sizes = [(n, False) for n in preset.n_layers] + [(n, True) for n in preset.residual_n_layers]
    jobs = [(panel, n, residual) for panel in PANELS for n, residual in sizes]
    with tempfile.TemporaryDirectory() as scratch:
        found = sweep(
            jobs,
            lambda job: study_group(study, *job),
            parts or Path(scratch),
            resume,
            desc="controlled study",
            progress=progress,
            settings=dataclasses.asdict(preset),
        )
    if found is None:
        return pd.DataFrame()
    for row in found["networks"].itertuples(index=False):
        network = Network(row.panel, row.n_layers, row.residual, row.seed)
        if network not in study.networks:  # trained by another process, or read back by --resume
            study.networks[network] = model = AttentionOnly(network.config())
            model.load_state_dict(row.state)
            model.eval()
    return found["gaps"]


def with_paper(gaps: pd.DataFrame) -> pd.DataFrame:
    """Our gaps (one row per seed) beside the paper's, long form with a ``source`` column."""
    ours = gaps[["panel", "setting", "depth", "residual", "pair", "seed", "steps", "gap"]]
    paper = [
        {"panel": p, "setting": setting_name(n, r), "depth": n, "residual": r, "pair": pair, "gap": g}
        for (p, r, n), values in PAPER_GAPS.items()
        for pair, g in zip(PAIRS, values, strict=True)
        if setting_name(n, r) in set(ours.setting)
    ]
    return pd.concat(
        [ours.assign(source="ours"), pd.DataFrame(paper).assign(source="paper")], ignore_index=True
    )


def plot_gaps(table: pd.DataFrame) -> plt.Figure:
    grid = sns.catplot(
        table,
        x="pair",
        y="gap",
        hue="setting",
        col="panel",
        row="source",
        kind="bar",
        col_order=list(PANELS),
        order=list(PAIRS),
        height=3,
        aspect=1.3,
        errorbar=("ci", 95),  # ours: bootstrap interval over seeds; the paper: one number,
    )
    grid.set_axis_labels("", "acc[a,b] − acc[b,a]")
    for ax in grid.axes.flat:
        ax.axhline(0, color="black", lw=0.6)
        ax.tick_params(axis="x", labelrotation=15)
    grid.figure.suptitle("Position bias with no bias in the data (Wu et al. Figs 2/4/5)", y=1.02)
    return grid.figure


@torch.no_grad()
def mean_attention(model: AttentionOnly, task: InContextClassification, size: int) -> torch.Tensor:
    """Attention of each layer averaged over ``size`` unbiased training sequences: [layers, seq, seq]."""
    return model(task.batch(size).inputs)[1].mean(0)


def plot_attention_maps(attention: torch.Tensor) -> tuple[plt.Figure, pd.DataFrame]:
    """Fig 9: layer 1, layer 2, their product P = A²A¹ and the Cesàro prediction M²."""
    seq = attention.shape[-1]
    maps = {
        "layer 1": attention[0].double(),
        "layer 2": attention[1].double(),
        "selector A²A¹": attention[1].double() @ attention[0].double(),
        "Cesàro M²": torch.linalg.matrix_power(position_bias.cesaro(seq), 2),
    }
    fig, axes = plt.subplots(1, 4, figsize=(22, 5.5))
    for ax, (name, matrix) in zip(axes, maps.items(), strict=True):
        sns.heatmap(
            matrix.numpy(),
            ax=ax,
            cmap="viridis",
            vmin=0,
            vmax=1,
            cbar=False,
            square=True,
            annot=True,
            fmt=".1f",
            annot_kws={"size": 5},
        )
        ax.set_title(name)
        ax.set_xticklabels(range(1, seq + 1), fontsize=6)
        ax.set_yticklabels(range(1, seq + 1), fontsize=6)
    fig.suptitle("2-layer causal NoPE network: mean attention and the context selector (Wu et al. Fig 9)")
    table = pd.concat(
        pd.DataFrame(m.numpy()).rename_axis("query").reset_index().melt("query", var_name="key").assign(map=n)
        for n, m in maps.items()
    )
    return fig, table.assign(query=table["query"] + 1, key=table["key"] + 1)


def sink_study(study: Study, progress: bool) -> pd.DataFrame:
    """Sink rate (τ = 0.2) per token: causal NoPE networks by size, window and prefix networks (smallest)."""
    preset = study.preset
    n_layers = min(preset.n_layers)
    seed = preset.seeds[0]
    cases = [
        ("causal", setting_name(n, False), study.networks[Network("No PE", n, False, seed)])
        for n in preset.n_layers
    ]
    extra = [
        ("window", f"w = {w}", SANConfig(n_layers=n_layers, mask="window", window=w)) for w in preset.windows
    ]
    extra += [
        ("prefix", f"K = {k}", SANConfig(n_layers=n_layers, mask="prefix", prefix=k)) for k in preset.prefixes
    ]
    for family, name, config in tqdm(extra, desc="sink networks", disable=not progress):
        cases.append((family, name, *study.train(config, [seed])))
    task = study.task(seed)
    rows = []
    for family, name, model in cases:
        with torch.no_grad():
            attention = model(task.batch(preset.test_size).inputs)[1]
        mask = log_mask(model.config, attention.shape[-1]).isfinite()
        rate = position_bias.sink_rate(attention, mask)
        rows += [
            {"family": family, "network": name, "token": j + 1, "sink_pct": 100 * r.item()}
            for j, r in enumerate(rate)
        ]
    return pd.DataFrame(rows)


def plot_sinks(table: pd.DataFrame) -> plt.Figure:
    grid = sns.relplot(
        table,
        x="token",
        y="sink_pct",
        hue="network",
        col="family",
        kind="line",
        marker="o",
        height=3,
        aspect=1.2,
        facet_kws={"sharey": False},
    )
    grid.set_axis_labels("token index", "attention sink (%)")
    grid.figure.suptitle("Attention sinks, τ = 0.2 (Wu et al. Figs 10–12)", y=1.03)
    return grid.figure


def selector_by_layers(study: Study) -> pd.DataFrame:
    """Query-row mass on token 1 of ``P^(t)`` (eq. 4) after each layer of the causal NoPE networks.

    The product of each network's mean attention, with the rollout factor ``0.5 I + 0.5 A^(t)`` for
    networks with residual connections, beside the same products of the Cesàro matrix (Thm 4.1).
    """
    preset = study.preset
    seed = preset.seeds[0]
    task = study.task(seed)
    rows = []
    for network, model in study.networks.items():
        if network.panel != "No PE" or network.seed != seed:
            continue
        attention = mean_attention(model, task, preset.test_size).double()
        lam = 0.5 if network.residual else None
        product = torch.eye(attention.shape[-1], dtype=torch.float64)
        for layer, layer_attention in enumerate(attention):
            position_bias.multiply_in_place(product, position_bias.residual_mix(layer_attention, lam))
            rows.append(
                {
                    "curve": network.setting + (" (λ = 0.5)" if network.residual else ""),
                    "layers": layer + 1,
                    "mass_first": product[-1, 0].item(),
                    "source": "trained",
                }
            )
    deepest = max(preset.n_layers + preset.residual_n_layers)
    for mix, name in ((None, "Cesàro M^L"), (0.5, "Cesàro, λ = 0.5")):
        cesaro = position_bias.selector_rows(position_bias.cesaro(2 * task.config.pairs + 1), deepest, mix)
        rows += [
            {"curve": name, "layers": t + 1, "mass_first": r[0].item(), "source": "theory"}
            for t, r in enumerate(cesaro)
        ]
    return pd.DataFrame(rows)


def plot_selector_by_layers(table: pd.DataFrame) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(6, 4))
    sns.lineplot(table, x="layers", y="mass_first", hue="curve", style="source", markers=True, ax=ax)
    ax.set(
        xlabel="layers multiplied",
        ylabel="P(z_query = token 1)",
        ylim=(0, 1.02),
        title="Context selector of trained networks vs Cesàro powers (n = 17)",
    )
    return fig
