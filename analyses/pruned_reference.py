"""Pruned leave-one-out against exhaustive on the same samples: the held-out study's agreement at 4K.

The protocol's second 4K command runs leave-one-out exact on the 8 sources ``key_removal_grad`` ranks
highest (``--loo-top-m 8``) on the samples of the exhaustive run (``--loo-top-m all``), judged on the
same LDS masks, reading the exhaustive run's saved passes (``--known``). For each sample both hold:
each reference's LDS and AOPC of comprehensiveness, their paired differences (pruned − exhaustive),
and, for each k, whether the pruned reference removes the same top-k sources as the exhaustive one
(``same_top_k{k}``: its comprehensiveness at k equals exhaustive's to the bit, i.e. the same mask read
from the same saved pass); means with 95 % bootstrap intervals over samples. Reads the studies' tables
only: a finished study's CSVs or a running study's finished parts
(:func:`analyses.claims.faithfulness_studies`).

Several models at once: one exhaustive and one pruned folder for each, in pairs.

    python -m analyses.pruned_reference figures/studies/detector_smollm2-135m-4096_196423fa \
        figures/studies/detector_smollm2-135m-4096_71b8e04d \
        figures/studies/detector_qwen2.5-coder-0.5b-4096_5d3b606e \
        figures/studies/detector_qwen2.5-coder-0.5b-4096_71b8e04d --csv bench/results/pruned_reference.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from bench.harness import intervals, report_with_summary

from .length_ranking import faithfulness_studies

SAMPLE = ["model", "length", "task", "seed"]


def reference_rows(study: Path, reference: str) -> pd.DataFrame:
    """The ``leave_one_out`` faithfulness rows of the one study in folder ``study``, indexed by sample;
    refused unless its leave-one-out ran as ``reference`` (exhaustive / pruned)."""
    studies = faithfulness_studies(study)
    if len(studies) != 1:
        raise SystemExit(f"{study} holds {len(studies)} studies: give one study's folder")
    (rows,) = studies
    if set(rows.loo_reference) != {reference}:
        raise SystemExit(f"{study}'s leave-one-out is {rows.loo_reference.iloc[0]}, not {reference}")
    return rows[rows.scorer == "leave_one_out"].set_index(SAMPLE)


def agreement(exhaustive: pd.DataFrame, pruned: pd.DataFrame) -> pd.DataFrame:
    """One row per sample both references were run on: LDS and AOPC of each, their differences, and
    ``same_top_k{k}`` for every k both were judged at."""
    both = exhaustive.join(pruned, how="inner", suffixes=("_exhaustive", "_pruned"))
    ks = sorted(
        int(c.removeprefix("comprehensiveness_k")) for c in pruned if c.startswith("comprehensiveness_k")
    )
    table = pd.DataFrame(index=both.index)
    for measure, column in (("lds", "lds"), ("aopc", "aopc_comprehensiveness")):
        for side in ("exhaustive", "pruned"):
            table[f"{measure}_{side}"] = both[f"{column}_{side}"]
        table[f"{measure}_difference"] = table[f"{measure}_pruned"] - table[f"{measure}_exhaustive"]
    for k in ks:
        column = f"comprehensiveness_k{k}"
        table[f"same_top_k{k}"] = (both[f"{column}_pruned"] == both[f"{column}_exhaustive"]).astype(float)
    return table.reset_index()


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "studies",
        type=Path,
        nargs="+",
        help="pairs of study folders: an exhaustive run's, then the pruned run's on the same samples",
    )
    parser.add_argument("--csv", type=Path, default=None, help="write the per-sample table here")
    args = parser.parse_args(argv)
    if len(args.studies) % 2:
        parser.error(f"give the study folders in pairs (exhaustive, pruned); got {len(args.studies)}")
    tables = []
    for exhaustive, pruned in zip(args.studies[::2], args.studies[1::2], strict=True):
        table = agreement(reference_rows(exhaustive, "exhaustive"), reference_rows(pruned, "pruned"))
        if table.empty:
            raise SystemExit(
                f"{exhaustive} and {pruned} share no sample: run the pruned reference on the exhaustive run's"
            )
        tables.append(table)
    table = pd.concat(tables, ignore_index=True)
    measures = [column for column in table if column not in SAMPLE]
    return report_with_summary(table, intervals(table, ["model", "length"], measures), args.csv)


if __name__ == "__main__":
    main()
