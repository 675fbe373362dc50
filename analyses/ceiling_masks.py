"""How many masks does the additive ceiling need? Its LDS against the number of half masks it is fit on.

The held-out study's ``additive_ceiling`` (``faithfulness.additive_ceiling``: ridge with a
cross-validated penalty on 256 random half masks, none of them an LDS mask) stands for the LDS no
additive attribution can clearly beat. It has one weight a source: at 1K a sample has 45–60 sources
(4–6 masks a weight), at 4K about 180 (1.4). This refits it on the first n of the study's own ceiling
masks, n = 32 … 256, and scores each fit on the same 32 LDS masks, from the study's saved passes alone
(no model runs): a curve still rising at 256 says the ceiling is short of masks on those samples, and
where it ends below leave-one-out it is no bound there. Per sample also leave-one-out's LDS (where every
single removal was saved) and a check that the fit on all 256 gives the study's own ceiling.

Reads a finished study or the finished parts of one still running; tunes nothing.

    python -m analyses.ceiling_masks figures/studies/detector_smollm2-135m-1024_faffad12 \\
        figures/studies/detector_smollm2-135m-4096_196423fa --csv bench/results/ceiling_masks.csv
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from bench.harness import intervals, report_with_summary, saved_passes_parser, study_masks
from probe import faithfulness
from probe.errors import InvalidValueError

from .study_files import folder_rows, saved_passes

SIZES = (32, 64, 128, 192, 256)


def recorded_ceiling(study: Path) -> pd.Series:
    """The study's own ``additive_ceiling`` LDS, indexed by (task, seed): its faithfulness CSV and the
    finished parts of a run still going."""
    rows = folder_rows(study)[1].query("scorer == 'additive_ceiling'")
    return rows.set_index(["task", "seed"]).lds


def sample_curve(
    rows: pd.DataFrame, sizes: list[int], n_masks: int, ceiling_masks: int, seed: int
) -> list[dict]:
    """One sample's saved passes ``rows`` → one row per fit size: the ceiling's LDS on the LDS masks,
    leave-one-out's (NaN unless every single removal was saved)."""
    known = faithfulness.Ablations.from_frame(rows)
    n = known.removed.shape[1]
    kept_lds, fit = study_masks(n, n_masks, ceiling_masks, seed)
    actual, fit_actual = known.logprob_of(kept_lds), known.logprob_of(fit)
    try:
        loo_lds = faithfulness.lds(known.leave_one_out(), kept_lds, actual)
    except InvalidValueError:  # a pruned reference: not every single removal ran
        loo_lds = float("nan")
    curve = []
    for size in sizes:
        weights = faithfulness.additive_ceiling(fit[:size], fit_actual[:size])
        ceiling = faithfulness.lds(weights, kept_lds, actual)
        curve.append({"fit_masks": size, "masks_per_source": size / n, "n_sources": n,
                      "lds_ceiling": ceiling, "lds_leave_one_out": loo_lds})  # fmt: skip
    return curve


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = saved_passes_parser(__doc__)
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="masks to fit on (≤ the study's)"
    )
    args = parser.parse_args(argv)
    if max(args.sizes) > args.ceiling_masks:
        parser.error(f"--sizes go up to {max(args.sizes)}, the studies fit on {args.ceiling_masks} masks")
    rows = []
    for study in args.studies:
        saved, recorded = saved_passes(study), recorded_ceiling(study)
        for (model, length, task, seed), passes in saved.groupby(["model", "length", "task", "seed"]):
            curve = sample_curve(passes, args.sizes, args.masks, args.ceiling_masks, args.mask_seed)
            full = next((row for row in curve if row["fit_masks"] == args.ceiling_masks), None)
            if full and abs(full["lds_ceiling"] - recorded[task, seed]) > 1e-6:
                raise AssertionError(
                    f"{task} {seed}: refit {full['lds_ceiling']} ≠ the study's {recorded[task, seed]}"
                )
            rows += [{"model": model, "length": length, "task": task, "seed": seed, **row} for row in curve]
    table = pd.DataFrame(rows)
    table["ceiling_minus_loo"] = table.lds_ceiling - table.lds_leave_one_out
    by = ["model", "length", "fit_masks"]
    summary = intervals(table, by, ["lds_ceiling", "ceiling_minus_loo"])
    return report_with_summary(table, summary, args.csv)


if __name__ == "__main__":
    main()
