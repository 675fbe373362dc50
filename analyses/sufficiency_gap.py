"""Why a detector's sufficiency trails leave-one-out's on a judged study's samples: which of its top k
sources, kept alone, hold less of the answer than leave-one-out's, and how they were scored.
Each sample explains the answer its study explained (the ``explained`` column: gold or the model's own).

Sufficiency at k is the drop of log P(answer) when only a scorer's top k sources are kept
(:func:`probe.faithfulness.evaluate`); AOPC averages it over k. Where a detector's is larger than
exhaustive leave-one-out's, the two top-k sets differ. For each sample and k this reads both kept-alone
passes from the study's saved passes (no mask runs again; the detector runs once, and its sufficiency is
checked against the study's) and names the sources the detector keeps that leave-one-out does not, and
the other way round: each one's detector score, its exact leave-one-out drop, and whether the detector
measured it exactly (its certificate's ``measured``) or estimated it. ``gap`` is the detector's
sufficiency minus leave-one-out's (nats; positive: the detector's top k hold less of the answer). A study
still running lends the samples its finished parts hold.

Explains, tunes nothing: the judged samples may be looked at, a remedy is judged on new seeds.

    python -m analyses.sufficiency_gap figures/studies/detector_gemma3-270m-1024_84ce410c \\
        --tasks document-2 --csv bench/results/sufficiency_gap_gemma3.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

import probe
from bench.harness import intervals, load, report
from probe import faithfulness, tasks
from probe.faithfulness.masks import KS, top_k_masks

from .comparison import explained
from .study_files import folder_rows, saved_passes


def sample_rows(
    model, tokenizer, sample: tasks.Sample, saved: pd.DataFrame, detector: str, ks=KS
) -> list[dict]:
    """One row per k: both scorers' kept-alone drops (saved passes), their gap, the sources only the
    detector keeps (``swapped_in``) and those only leave-one-out keeps (``swapped_out``), each as
    ``source:detector score/leave-one-out drop/measured or estimated``."""
    known = faithfulness.Ablations.from_frame(saved, sample)
    full = float(known.logprob_of(torch.ones(1, len(sample.sources), dtype=torch.bool))[0])
    loo = known.leave_one_out()
    detection = probe.detect(detector, model, tokenizer, sample)
    scores = detection.source_scores()
    measured = detection.details.get("measured", torch.zeros(len(scores), dtype=torch.bool))

    def described(i: int) -> str:
        return f"{i}:{scores[i]:.2f}/{loo[i]:.2f}/{'measured' if measured[i] else 'estimated'}"

    rows = []
    for k, mine, theirs in zip(ks, top_k_masks(scores, ks), top_k_masks(loo, ks), strict=True):
        kept = known.logprob_of(torch.stack([mine, theirs]))
        only_mine = (mine & ~theirs).nonzero().flatten().tolist()
        only_theirs = (theirs & ~mine).nonzero().flatten().tolist()
        rows.append({
            "k": k,
            "sufficiency": full - float(kept[0]),
            "sufficiency_leave_one_out": full - float(kept[1]),
            "swapped_in": " ".join(described(i) for i in only_mine),
            "swapped_out": " ".join(described(i) for i in only_theirs),
            "swapped_in_estimated": int((~measured[only_mine]).sum()),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "study", type=Path, help="a judged study's folder, finished or running (its finished parts)"
    )
    parser.add_argument("--detector", default="leave_few_out", help="a detector the study judged")
    parser.add_argument("--tasks", nargs="+", default=None, help="default: every task of the study")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    saved = saved_passes(args.study)
    study = folder_rows(args.study)[1].query("scorer == @args.detector").set_index(["task", "seed"])
    if study.empty:
        raise SystemExit(f"{args.study} has no rows of {args.detector!r}: name a detector the study judged")
    ks = [int(column.removeprefix("sufficiency_k")) for column in study if column.startswith("sufficiency_k")]
    (name,), (length,) = saved.model.unique(), saved.length.unique()
    model, tokenizer = load(name)
    rows = []
    for task, seed in study.index:
        if args.tasks and task not in args.tasks:
            continue
        made = tasks.make(
            task,
            tokenizer,
            None if pd.isna(length) or length == "natural" else int(length),
            int(seed),
            model=model,
        )
        sample, _ = explained(model, tokenizer, made, study.loc[(task, seed), "explained"])
        for row in sample_rows(model, tokenizer, sample, saved, args.detector, ks):
            recorded = study.loc[(task, seed), f"sufficiency_k{row['k']}"]
            if abs(row["sufficiency"] - recorded) > 1e-3:
                raise AssertionError(f"{task} {seed} k={row['k']}: sufficiency is not the study's {recorded}")
            rows.append({"model": name, "task": task, "seed": seed} | row)
            print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table["gap"] = table.sufficiency - table.sufficiency_leave_one_out
    table["estimated_in_top"] = table.swapped_in_estimated > 0
    summary = intervals(table.assign(task="all"), ["task", "estimated_in_top"], ["gap"])
    print(pd.concat([summary, intervals(table, ["task", "k"], ["gap"])]).round(3).to_string(index=False))
    return report(table, args.csv)


if __name__ == "__main__":
    main()
