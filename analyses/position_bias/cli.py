"""Position bias from the attention graph (Wu et al., ICML 2025; Wang et al., "Transformers Are Biased
for Long-Context Modeling"): theory, controlled study, LMs.

1. **Controlled study** (paper §5, Figs 2/4/5): attention-only networks (:mod:`probe.training.attention_only`)
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
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from ..arguments import add_device_arguments, check_device_arguments, check_out, load, resume_settings
from ..output import save_figure
from ..sweep import finish, is_main_process, sweep
from .controlled import (
    Network,
    Study,
    controlled_study,
    mean_attention,
    plot_attention_maps,
    plot_gaps,
    plot_selector_by_layers,
    plot_sinks,
    selector_by_layers,
    sink_study,
    with_paper,
)
from .presets import PRESETS, Preset
from .real_models import (
    first_token_mass,
    lost_in_the_middle,
    plot_first_token_mass,
    plot_lost_in_the_middle,
)
from .theory import plot_theory, theory_table

PARTS = ("study", "theory", "real")


def parse_args(argv: Sequence[str] | None) -> tuple[Preset, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="python -m analyses.position_bias",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    finish(parts)  # every output is written: a --resume now runs nothing
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
    finish(parts)  # every output is written: a --resume now runs nothing
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
