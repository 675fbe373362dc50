"""Does the main job's verdict survive bfloat16? Two runs of ``analyses.detector_compare`` on the same
samples, one in float32 (the default: what ``figures/`` holds) and one with ``--dtype bfloat16``
(about 2.3× faster on a CPU with native bf16 matrix products, avx512_bf16 or AMX; far slower without).

For each scorer and faithfulness metric (LDS, AOPC of comprehensiveness and of sufficiency): the mean
in each run, the paired difference bf16 − fp32 with its 95 % bootstrap interval over samples, and
the mean absolute per-sample difference; and each run's LDS rank of the scorers. Reads the two runs'
``detector_*_faithfulness.csv``; runs no model.

    python -m analyses.detector_compare --dtype bfloat16          # writes figures/studies/detector_..._HASH
    python -m analyses.dtype_agreement --other figures/studies/detector_smollm2-135m-1024_HASH \
        --csv bench/results/dtype_agreement.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from probe.atomic import atomic_write
from probe.stats import bootstrap

METRICS = ("lds", "aopc_comprehensiveness", "aopc_sufficiency")
KEY = ["model", "length", "task", "seed", "scorer"]


def faithfulness(folder: Path) -> pd.DataFrame:
    """The one ``detector_*_faithfulness.csv`` of a detector-comparison run's folder."""
    (path,) = sorted(folder.glob("detector_*_faithfulness.csv"))
    return pd.read_csv(path)


def agreement(reference: pd.DataFrame, other: pd.DataFrame) -> pd.DataFrame:
    """One row per scorer and metric: ``reference`` and ``other`` means over the samples both ran,
    ``difference`` (other − reference, paired) with ``low``/``high``, ``mean_abs`` and ``n``; and
    ``rank_reference``/``rank_other``: the scorer's LDS rank in each run (1 = highest mean)."""
    paired = reference.merge(other, on=KEY, suffixes=("_reference", "_other"))
    if paired.empty:
        raise ValueError(
            "the two runs share no (model, length, task, seed, scorer): compare runs of the same samples"
        )
    records = []
    for scorer, rows in paired.groupby("scorer"):
        for metric in METRICS:
            a, b = rows[f"{metric}_reference"], rows[f"{metric}_other"]
            difference = bootstrap((b - a).to_numpy())
            records.append(
                dict(scorer=scorer, metric=metric, n=difference.n, reference=a.mean(), other=b.mean(),
                     difference=difference.value, low=difference.low, high=difference.high,
                     mean_abs=(b - a).abs().mean())
            )  # fmt: skip
    table = pd.DataFrame(records)
    lds = table[table.metric == "lds"].set_index("scorer")
    for run in ("reference", "other"):
        table[f"rank_{run}"] = table.scorer.map(lds[run].rank(ascending=False, method="min").astype(int))
    return table


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reference", type=Path, default=Path("figures"), help="the float32 run's folder")
    parser.add_argument("--other", type=Path, required=True, help="the bfloat16 run's folder")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    table = agreement(faithfulness(args.reference), faithfulness(args.other))
    with pd.option_context("display.width", 200, "display.float_format", "{:.3f}".format):
        print(table.to_string(index=False))
    if args.csv is not None:
        atomic_write(args.csv, lambda tmp: table.to_csv(tmp, index=False))
    return table


if __name__ == "__main__":
    main()
