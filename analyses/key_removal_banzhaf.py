"""Does estimating each source's Banzhaf value bring the key-removal gradient to leave-one-out's LDS?

LDS (:func:`probe.faithfulness.lds`) asks how well a source scoring predicts the answer's
log-probability over random masks that keep each source with probability 1/2. The best additive
predictor of such masks is the Banzhaf value of each source; ``key_removal_grad`` estimates its
removal from the *full* context (leave-one-out's question). ``key_removal_banzhaf``
(:func:`probe.detectors.key_removal_banzhaf`) takes the by-source gradient at every source's
``presence`` (½: the mean-field point of the half contexts, one pass) and, with ``pairs`` > 0,
averages it with the gradients in ``2 · pairs`` random complementary half contexts. Per sample,
each scorer's seconds (its own passes, one thread) and its LDS over the same seeded masks as the
main job (32; ``--masks``: as many as the ``--reference`` study used):

- ``information_flow``: the cost yardstick of the goal (≤ 1.5× its seconds);
- ``key_removal_grad``: the default (token units), and ``key_removal_grad_by_source`` (sources as
  units: ``key_removal_banzhaf`` at ``presence`` 1);
- ``key_removal_banzhaf_q{Q}_p{P}``: for each ``--presences`` Q and ``--pairs`` P;
- ``key_removal_fade_d{D}_s{S}``: for each ``--fades`` D:S, the by-source gradient integrated along
  the path that fades every source together from the full context (bias 0) to bias −D (presence
  e^−D), midpoint rule over S points (S passes): Aumann–Shapley on the sources' key biases. Its scores
  add up to log P(full) − log P(every source at bias −D) (to the rule's error), so a source whose
  removal is a step (RESULTS.md, the held-out study: why ``key_removal_banzhaf`` falls short on ``kv``
  and ``document-2``) gets the step where the slope at one point misses it;
- ``leave_one_out``: exhaustive, with ``--loo`` (one pass per source), else read from the
  ``--reference`` CSV (a ``detector_compare`` faithfulness CSV of the same samples and masks).

The defaults are the main job's samples (SmolLM2-135M, multihop-1 and multihop-2 at 1K tokens, seeds
0–11, 32 masks of seed 0), whose full 1K study's faithfulness CSV holds exhaustive leave-one-out's
LDS.

    python -m analyses.key_removal_banzhaf --csv out.csv
    python -m analyses.key_removal_banzhaf --presences 1 --pairs 1 2 \
        --csv bench/results/key_removal_banzhaf.csv           # the sampled estimate
    python -m analyses.key_removal_banzhaf --model gemma3-270m --seeds 0 1 2 3 4 5 --loo \
        --csv bench/results/key_removal_banzhaf_gemma3.csv
    python -m analyses.key_removal_banzhaf --model gemma3-270m --tasks kv document-2 multihop-4 \
        --seeds 22000 22001 22002 22003 --presences 0.5 --fades 8:8 --loo \
        --csv bench/results/key_removal_fade_gemma3.csv   # the fade path, new seeds
    python -m analyses.key_removal_banzhaf --length 4096 --tasks multihop-2 multihop-3 --seeds 0 1 2 3 \
        --presences 0.5 --masks 16 --csv out.csv \
        --reference STUDY/detector_smollm2-135m-4096_faithfulness.csv   # a 4K study's masks
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from bench.harness import load, samples_parser
from probe import detectors, faithfulness, tasks
from probe.atomic import atomic_write
from probe.probes.key_removal import key_removal_gradient
from probe.stats import bootstrap

REFERENCE = (
    Path(__file__).resolve().parents[1]
    / "figures/studies/detector_smollm2-135m-1024_0f1cc1b9/detector_smollm2-135m-1024_faithfulness.csv"
)


def detected(detector: str, options: dict, model, tokenizer, sample: tasks.Sample) -> torch.Tensor:
    """A registered detector's source scores: Tensor[sources]."""
    return detectors.detect(detector, model, tokenizer, sample, **options).source_scores(sample)


def fade(depth: float, steps: int, model, tokenizer, sample: tasks.Sample) -> torch.Tensor:
    """Tensor[sources]: ∫ ∂ log P(answer)/∂b_i db over the path on which every source's key bias b goes
    from 0 to −``depth`` together, midpoint rule over ``steps`` points (each a
    :func:`~probe.probes.key_removal.key_removal_gradient` at presence e^b), summed over each source's
    tokens."""
    spans = [(source.start, source.end) for source in sample.sources]
    total = torch.zeros(len(sample.input_ids))
    for point in range(steps):
        presence = math.exp(-(point + 0.5) / steps * depth)
        total += key_removal_gradient(
            model, sample.input_ids, sample.target_positions, sources=spans, presence=presence
        )
    return torch.stack([total[start:end].sum() for start, end in spans]) * depth / steps


def scorers(
    presences: list[float], pairs: list[int], fades: list[str], loo: bool
) -> dict[str, Callable[..., torch.Tensor]]:
    """Scorer name → its source scores from ``(model, tokenizer, sample)``."""
    chosen = {
        "information_flow": ("information_flow", {}),
        "key_removal_grad": ("key_removal_grad", {}),
        "key_removal_grad_by_source": ("key_removal_banzhaf", {"presence": 1.0}),
    }
    chosen |= {
        f"key_removal_banzhaf_q{q:g}_p{p}": ("key_removal_banzhaf", {"presence": q, "pairs": p})
        for q in presences
        for p in pairs
    }
    if loo:
        chosen["leave_one_out"] = ("leave_one_out", {})
    found = {name: functools.partial(detected, *chosen[name]) for name in chosen}
    for spec in fades:
        depth, steps = spec.split(":")
        found[f"key_removal_fade_d{depth}_s{steps}"] = functools.partial(fade, float(depth), int(steps))
    return found


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    parser.add_argument("--presences", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--pairs", type=int, nargs="+", default=[0])
    parser.add_argument("--fades", nargs="*", default=[], metavar="DEPTH:STEPS", help="fade-path variants")
    parser.add_argument("--loo", action="store_true", help="run exhaustive leave-one-out here")
    parser.add_argument("--masks", type=int, default=32, help="LDS masks (seed 0); the reference's number")
    parser.add_argument(
        "--reference", type=Path, default=REFERENCE, help="leave-one-out's LDS, without --loo"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype)
    rows = []
    for seed in args.seeds:
        for task in args.tasks:
            sample = tasks.make(task, tokenizer, args.length, seed=seed, model=model)
            scores, seconds = {}, {}
            for name, scorer in scorers(args.presences, args.pairs, args.fades, args.loo).items():
                start = time.perf_counter()
                scores[name] = scorer(model, tokenizer, sample)
                seconds[name] = time.perf_counter() - start
            frame = faithfulness.evaluate(
                model, sample, scores, faithfulness.Judgement(ks=[1], n_masks=args.masks)
            )
            frame = frame[["scorer", "lds"]].assign(
                seconds=frame.scorer.map(seconds), model=args.model, length=args.length, task=task, seed=seed
            )
            rows.append(frame)
            print(frame.to_string(index=False), flush=True)
            table = measured(rows, None if args.loo else args.reference)
            if args.csv:  # after each sample: a stopped run keeps what it measured
                atomic_write(args.csv, functools.partial(table.to_csv, index=False))
    summarize(table)
    return table


def measured(rows: list[pd.DataFrame], reference: Path | None) -> pd.DataFrame:
    """The rows of the samples measured so far; with ``reference`` (a faithfulness CSV), also its
    leave-one-out rows of the same samples."""
    table = pd.concat(rows, ignore_index=True)
    if reference is None:
        return table
    found = pd.read_csv(reference)
    keys = ["model", "length", "task", "seed"]
    found = found.loc[found.scorer == "leave_one_out", [*keys, "lds", "seconds"]]
    found = found.assign(scorer="leave_one_out")
    return pd.concat([table, found.merge(table[keys].drop_duplicates(), on=keys)], ignore_index=True)


def summarize(table: pd.DataFrame) -> None:
    """Mean LDS with 95 % bootstrap intervals, paired differences from leave-one-out and from the
    default gradient, and seconds relative to information flow."""
    lds = table.pivot_table(index=["task", "seed"], columns="scorer", values="lds")
    seconds = table.pivot_table(index=["task", "seed"], columns="scorer", values="seconds")
    print(f"{len(lds)} samples")
    for name in lds.columns:
        cost = (seconds[name] / seconds["information_flow"]).median()
        gain = bootstrap(lds[name] - lds["key_removal_grad"])
        line = f"{name}: LDS {bootstrap(lds[name])}; − key_removal_grad {gain}"
        if "leave_one_out" in lds:
            line += f"; − leave_one_out {bootstrap(lds[name] - lds['leave_one_out'])}"
        print(f"{line}; {cost:.1f}× information_flow's seconds")


if __name__ == "__main__":
    main()
