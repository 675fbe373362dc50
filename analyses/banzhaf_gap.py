"""Why ``key_removal_banzhaf`` falls short of leave-one-out on some held-out samples: the target or
its one-pass estimate?

``key_removal_banzhaf`` is a first-order, mean-field estimate of each source's Banzhaf value (the
gradient of log P(answer) in a key bias at the point where every source weighs ½). Where its LDS falls
short, either the Banzhaf value itself ranks the masks worse than leave-one-out there (no estimate of
it could do better), or the one-pass estimate misses the Banzhaf value. A held-out study's saved passes
tell the two apart without running a mask again: the least-squares linear fit of log P over uniform
half masks has the Banzhaf values as its coefficients (Hammer & Holzman 1992), so the study's
``additive_ceiling`` (that fit, by ridge with a cross-validated penalty, on 256 random half masks, none
of them an LDS mask) is a sampled estimate of the target, judged on the same 32 LDS masks. Per sample:
the LDS of leave-one-out, the ceiling and the one-pass estimate (recomputed here, one pass; its LDS is
checked against the study's) and the Spearman correlation of the one-pass scores with the ceiling's.

Then, for each sample's top source (the ceiling's largest coefficient), the one-pass score as a share
of its coefficient and the **bias curve** at the mean-field point: log P(answer) with every source's
keys at bias log ½ and the top source's lowered by a further 0, 0.5, 1, 2, 4 and 30 (≈ removed) — 6
forward passes. The one-pass estimate reads the curve's slope at 0; ``drop_beyond_1`` is the share of
the curve's whole drop that comes after the bias has fallen by 1, which a slope at 0 cannot see.

Explains, tunes nothing: the held-out samples may be looked at, a remedy is judged on new seeds.

    python -m analyses.banzhaf_gap figures/studies/detector_gemma3-270m-1024_faffad12 \\
        --csv bench/results/banzhaf_gap_gemma3.csv
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import torch
from scipy.stats import spearmanr

import probe
from bench.harness import intervals, load, report, study_masks
from probe import faithfulness, tasks
from probe.attention.modifiers import bias_keys
from probe.checks import hf_model
from probe.probes.key_removal import removal_units
from probe.target import target_of

DROPS = (0.0, 0.5, 1.0, 2.0, 4.0, 30.0)  # further bias on the top source, from the mean-field point


def bias_curve(model, sample: tasks.Sample, source: int, presence: float = 0.5) -> list[float]:
    """log P(answer) with every source's keys at bias log ``presence`` and ``source``'s lowered by
    each of :data:`DROPS` more (from every later query outside the source, as the estimate's bias)."""
    seq = len(sample.input_ids)
    units = removal_units([(s.start, s.end) for s in sample.sources], seq)
    inner, ids = hf_model(model), sample.input_ids[None]
    curve = []
    for drop in DROPS:
        bias = torch.where(units >= seq, math.log(presence), 0.0)
        bias[sample.sources[source].start : sample.sources[source].end] -= drop
        with torch.no_grad(), bias_keys(inner, bias[None], units):
            curve.append(float(target_of(inner, ids, sample.target_positions)))
    return curve


def sample_row(
    model, tokenizer, sample: tasks.Sample, saved: pd.DataFrame, mask_seed: int, n_masks: int
) -> dict:
    """One sample's LDS of each scorer, the one-pass estimate of its top source and its bias curve."""
    known = faithfulness.Ablations.from_frame(saved, sample)
    kept_lds, fit = study_masks(len(sample.sources), n_masks, 256, mask_seed)
    ceiling, actual = faithfulness.additive_ceiling(fit, known.logprob_of(fit)), known.logprob_of(kept_lds)
    one_pass = probe.detect("key_removal_banzhaf", model, tokenizer, sample).source_scores()
    loo = known.leave_one_out()
    scorers = {"leave_one_out": loo, "additive_ceiling": ceiling, "key_removal_banzhaf": one_pass}
    top = int(ceiling.argmax())
    curve = bias_curve(model, sample, top)
    return {
        **{f"lds_{name}": faithfulness.lds(score, kept_lds, actual) for name, score in scorers.items()},
        "rho_one_pass_vs_ceiling": spearmanr(one_pass, ceiling).statistic,
        "top_source_category": sample.sources[top].category,
        "top_ceiling": float(ceiling[top]),
        "top_one_pass_share": float(one_pass[top] / ceiling[top]),
        "top_one_pass_rank": int((one_pass > one_pass[top]).sum()) + 1,
        **{f"curve_{drop:g}": value for drop, value in zip(DROPS, curve, strict=True)},
        "drop_beyond_1": (curve[2] - curve[-1]) / (curve[0] - curve[-1]),
    }


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("study", type=Path, help="a held-out study's folder (its *_ablations.csv.gz)")
    parser.add_argument("--tasks", nargs="+", default=None, help="default: every task of the study")
    parser.add_argument("--masks", type=int, default=32, help="the study's LDS masks (--masks)")
    parser.add_argument("--mask-seed", type=int, default=5000, help="the study's --seed (its masks' seed)")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    (path,) = args.study.glob("detector_*_ablations.csv.gz")
    saved = pd.read_csv(path, dtype={"removed": str})
    (judged,) = args.study.glob("detector_*_faithfulness.csv")
    study_lds = pd.read_csv(judged).query("scorer == 'key_removal_banzhaf'").set_index(["task", "seed"]).lds
    (name,), (length,) = saved.model.unique(), saved.length.unique()
    model, tokenizer = load(name)
    rows = []
    for task, seed in saved[["task", "seed"]].drop_duplicates().itertuples(index=False):
        if args.tasks and task not in args.tasks:
            continue
        sample = tasks.make(task, tokenizer, int(length), seed=int(seed), model=model)
        row = {"model": name, "task": task, "seed": seed}
        row |= sample_row(model, tokenizer, sample, saved, args.mask_seed, args.masks)
        if abs(row["lds_key_removal_banzhaf"] - study_lds[task, seed]) > 1e-3:
            raise AssertionError(
                f"{task} {seed}: the one-pass LDS is not the study's {study_lds[task, seed]}"
            )
        print({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        rows.append(row)
    table = pd.DataFrame(rows)
    table["gap_one_pass"] = table.lds_key_removal_banzhaf - table.lds_leave_one_out
    table["gap_ceiling"] = table.lds_additive_ceiling - table.lds_leave_one_out
    measures = [
        "gap_one_pass",
        "gap_ceiling",
        "rho_one_pass_vs_ceiling",
        "top_one_pass_share",
        "drop_beyond_1",
    ]
    summary = pd.concat(
        [intervals(table.assign(task="all"), ["task"], measures), intervals(table, ["task"], measures)]
    )
    print(summary.round(3).to_string(index=False))
    return report(table, args.csv)


if __name__ == "__main__":
    main()
