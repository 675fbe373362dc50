"""Position bias from the attention graph (Wu et al., ICML 2025; seed 004): theory, controlled study, LMs.

1. **Controlled study** (paper §5, Figs 2/4/5): attention-only networks (:mod:`probe.attention_only`)
   trained on in-context classification with no data bias; the gap ``acc[a, b] − acc[b, a]`` for
   first / middle / last, per positional scheme (No PE = causal mask, Decay = decay mask γ = 0.8,
   RoPE) and number of layers, without and with residual connections, beside the paper's reported
   gaps. (The CSVs keep the paper's word: column ``depth`` and settings ``depth L`` are ``n_layers``.)
2. **Attention maps and sinks** (Figs 9–12): the mean attention of the 2-layer causal NoPE network,
   its context selector ``A²A¹`` beside the Cesàro prediction, and the sink rate (τ = 0.2) per token
   for causal, sliding-window (w = 5, 9, 13) and prefix (K = 2, 4, 6) networks.
3. **Selector vs layers**: the query row's mass on token 1 after each layer of the trained networks,
   beside powers of the Cesàro matrix (Thm 4.1), raw and with 0.5 residual mixing.
4. **Theory**: Cesàro powers (n = 64), the decay mask's negative-binomial rows (Thm 4.5) and the
   RoPE kernel convolution (Thm 4.7), each beside the numeric product.
5. **Real models** (SmolLM2-135M, Gemma 3 270M): the context selector's mass on the first token
   vs layers multiplied on essay text (raw, rollout λ = 0.5, measured λ_t), beside the Cesàro
   prediction; and lost in the middle: key–value retrieval accuracy by gold position (the needle's
   ``depth``) beside the rollout mass on the gold pair.

    python -m analyses.position_bias              # quick preset (default): ≲15 min on 2 CPU cores
    python -m analyses.position_bias --smoke      # a minute or two: every figure at toy settings
    python -m analyses.position_bias --paper      # the paper's 100k steps, 5 seeds, 2/4/6 & 2/6/10 layers
    python -m analyses.position_bias --paper --parts study --steps 10000 --seeds 0 1 2 \
        --n-layers 2 6 --residual-n-layers 2     # the committed study: 81 min, 1 thread, shared
    python -m analyses.position_bias --steps 4000 --seeds 0 1 --n-layers 2 4 6 --residual-n-layers 2 6 10
    python -m analyses.position_bias --parts real --models gemma3-270m     # one part, one model
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from tqdm.auto import tqdm

import probe
from analyses.arguments import add_device_arguments, check_device_arguments, check_out, load, resume_settings
from analyses.output import save_figure
from analyses.sweep import is_main_process, sweep
from probe import graph, tasks
from probe.attention_only import AttentionOnly, SANConfig, accuracy_gaps, log_mask, train_together
from probe.generation import answer
from probe.tasks.classification import Batch, InContextClassification
from probe.tasks.noise import essay_ids

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
REAL_MODELS = ("smollm2-135m", "gemma3-270m")
PARTS = ("study", "theory", "real")


@dataclass(frozen=True)
class Preset:
    """Everything a run depends on."""

    steps: int
    seeds: tuple[int, ...]
    n_layers: tuple[int, ...]  # network sizes without residual connections
    residual_n_layers: tuple[int, ...]  # network sizes with residual connections
    test_size: int
    pool: int | None  # pre-drawn training batches, cycled (None: fresh sequences every step, as the paper)
    windows: tuple[int, ...] = (5, 9, 13)
    prefixes: tuple[int, ...] = (2, 4, 6)
    models: tuple[str, ...] = REAL_MODELS
    text_length: int = 512
    texts: int = 2
    kv_length: int = 512
    kv_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    kv_samples: int = 3


PRESETS = {
    "smoke": Preset(
        steps=30,
        seeds=(0,),
        n_layers=(2,),
        residual_n_layers=(2,),
        test_size=200,
        pool=10,
        windows=(5,),
        prefixes=(2,),
        models=("smollm2-135m",),
        text_length=64,
        texts=1,
        kv_length=300,
        kv_depths=(0.0, 1.0),
        kv_samples=1,
    ),
    "quick": Preset(
        steps=1000, seeds=(0,), n_layers=(2, 6), residual_n_layers=(2, 6), test_size=2000, pool=500
    ),
    "paper": Preset(
        steps=100_000,
        seeds=(0, 1, 2, 3, 4),
        n_layers=(2, 4, 6),
        residual_n_layers=(2, 6, 10),
        test_size=10_000,
        pool=None,
        kv_samples=10,
    ),
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
    pools: dict[int, Batch | None] = field(default_factory=dict)
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


# --- controlled study ----------------------------------------------------------------------------------


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
        "Cesàro M²": torch.linalg.matrix_power(graph.cesaro(seq), 2),
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
        rate = graph.sink_rate(attention, mask)
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
            graph.multiply_in_place(product, graph.residual_mix(layer_attention, lam))
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
        cesaro = graph.selector_rows(graph.cesaro(2 * task.config.pairs + 1), deepest, mix)
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


# --- theory --------------------------------------------------------------------------------------------


def theory_table(n: int = 64, m: float = 0.5, theta: float = 0.02, r2: float = 20.0) -> pd.DataFrame:
    """Numeric products of content-free attention beside the closed forms (query row, n tokens)."""
    rows = []
    for mix, name in ((None, "raw"), (0.5, "λ = 0.5")):
        for t, row in enumerate(graph.selector_rows(graph.cesaro(n), 32, mix)):
            rows.append(
                {
                    "family": "Cesàro",
                    "curve": name,
                    "layers": t + 1,
                    "token": 1,
                    "numeric": row[0].item(),
                    "closed_form": float(graph.cesaro_exact_row(n, t + 1)[0]) if mix is None else np.nan,
                }
            )
    for family, attention, closed in (
        ("decay m = 0.5", graph.decay_attention(n, m), lambda L: graph.decay_closed_form(n, L, m)),
        (
            "RoPE θ = 0.02, r² = 20",
            graph.rope_attention(n, theta, r2),
            lambda L: graph.rope_closed_form(n, L, theta, r2),
        ),
    ):
        numeric = graph.selector_rows(attention, 16)
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


# --- real models ---------------------------------------------------------------------------------------


def first_token_mass(model_name: str, model, tokenizer, preset: Preset) -> pd.DataFrame:
    """Token-1 mass of the context selector ``P^(t)`` (eq. 4; last row, mean over rows) after each layer.

    On essay text, raw, rollout and with measured λ_t, beside the Cesàro prediction with the same λ.
    """
    rows = []
    for window, ids in enumerate(essay_ids(tokenizer, preset.text_length, preset.texts)):
        lams = graph.measured_mix(model, ids)
        n, n_layers = len(ids), len(lams)
        for mix, name in ((None, "raw"), (0.5, "λ = 0.5"), ("measured", "measured λ_t")):
            selector = probe.context_selector(model, ids, mix=mix)
            prediction = graph.selector_rows(graph.cesaro(n), n_layers, lams if mix == "measured" else mix)
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


# --- driver --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> tuple[Preset, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", dest="preset", action="store_const", const="quick", help="the default preset"
    )
    size.add_argument("--smoke", dest="preset", action="store_const", const="smoke", help="toy settings")
    size.add_argument(
        "--paper", dest="preset", action="store_const", const="paper", help="the paper's settings"
    )
    parser.add_argument("--steps", type=int, help="training steps per network")
    parser.add_argument("--seeds", type=int, nargs="+", help="one network per seed and setting")
    parser.add_argument("--n-layers", type=int, nargs="+", help="network sizes (layers) without residual")
    parser.add_argument("--residual-n-layers", type=int, nargs="+", help="network sizes with residual")
    parser.add_argument("--pool", type=int, help="pre-drawn training batches per seed (--steps: no repeats)")
    parser.add_argument("--models", nargs="*", help="real models (none: skip the real-model part)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: best on a shared CPU)")
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, default=Path("figures"))
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--resume", action="store_true", help="keep the jobs a killed run finished")
    args = parser.parse_args(argv)
    counts = [args.steps, args.pool, args.threads, *(args.n_layers or ()), *(args.residual_n_layers or ())]
    if any(count is not None and count < 1 for count in counts) or min(args.seeds or [0]) < 0:
        parser.error("--steps, --pool, --threads and the layer counts must be at least 1, --seeds >= 0")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    preset = PRESETS[args.preset or "quick"]
    overrides = {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in vars(args).items()
        if k in Preset.__dataclass_fields__ and v is not None
    }
    return dataclasses.replace(preset, **overrides), args


def run_study(preset: Preset, out: Path, progress: bool, resume: bool) -> dict[str, pd.DataFrame]:
    """The controlled study: gap bars, attention maps, sinks, selector vs layers (main process only)."""
    study = Study(preset)
    parts = out / ".position_bias_parts"
    gaps = controlled_study(study, progress, parts, resume)
    if not is_main_process():
        return {}
    sinks = sink_study(study, progress)
    by_layers = selector_by_layers(study)
    seed = preset.seeds[0]
    maps_model = study.networks[Network("No PE", min(preset.n_layers), False, seed)]
    maps_fig, maps = plot_attention_maps(mean_attention(maps_model, study.task(seed), preset.test_size))
    tables = {"gaps": with_paper(gaps), "attention_maps": maps, "sinks": sinks, "selector_depth": by_layers}
    save_figure(plot_gaps(tables["gaps"]), tables["gaps"], out, "position_bias_gaps")
    save_figure(maps_fig, maps, out, "position_bias_attention_maps")
    save_figure(plot_sinks(sinks), sinks, out, "position_bias_sinks")
    save_figure(plot_selector_by_layers(by_layers), by_layers, out, "position_bias_selector_depth")
    summary = tables["gaps"].pivot_table(index=["panel", "setting", "pair"], columns="source", values="gap")
    print(summary.round(3).to_string())
    shutil.rmtree(parts, ignore_errors=True)
    return tables


def run_real(preset: Preset, args: argparse.Namespace, progress: bool) -> dict[str, pd.DataFrame]:
    """Real models (one sweep job each, on ``--device`` in ``--dtype``): first-token mass vs layers,
    and lost in the middle."""
    out, resume = args.out, args.resume

    def run(job: tuple[str]) -> dict[str, pd.DataFrame]:
        model, tokenizer = load(args, job[0])
        return {
            "real_models": first_token_mass(job[0], model, tokenizer, preset),
            "lost_in_the_middle": lost_in_the_middle(job[0], model, tokenizer, preset, progress),
        }

    if not preset.models:
        return {}
    parts = out / ".position_bias_real_parts"
    jobs = [(name,) for name in preset.models]
    settings = dataclasses.asdict(preset) | resume_settings(args, "threads", "no_progress", "parts")
    tables = sweep(jobs, run, parts, resume, "real models", progress=progress, settings=settings)
    if tables is None:
        return {}
    save_figure(
        plot_first_token_mass(tables["real_models"]), tables["real_models"], out, "position_bias_real_models"
    )
    lost = tables["lost_in_the_middle"]
    save_figure(plot_lost_in_the_middle(lost), lost, out, "position_bias_lost_in_the_middle")
    shutil.rmtree(parts, ignore_errors=True)
    return tables


def main(argv: Sequence[str] | None = None) -> dict[str, pd.DataFrame]:
    """Run the chosen parts, writing ``position_bias_*.png`` + ``.csv`` to ``--out``; returns the tables."""
    preset, args = parse_args(argv)
    progress = not args.no_progress
    torch.set_num_threads(args.threads)  # tiny networks: thread hand-offs cost more than the arithmetic
    tables = {}
    if "study" in args.parts:
        tables |= run_study(preset, args.out, progress, args.resume)
    if "theory" in args.parts and is_main_process():
        tables["theory"] = theory_table()
        save_figure(plot_theory(tables["theory"]), tables["theory"], args.out, "position_bias_theory")
    if "real" in args.parts:
        tables |= run_real(preset, args, progress)
    return tables


if __name__ == "__main__":
    main()
