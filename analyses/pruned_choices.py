"""Which pruned leave-one-out comes nearest exhaustive? Its ranking detector and its number of sources.

The held-out study's pruned reference (``--loo-top-m 8``) removes one by one the 8 sources that
``key_removal_grad`` ranks highest and scores every other source by that ranking, scaled
(:func:`probe.detectors.ablation.pruned_estimate`). Where the answer rests on a source outside that top
8 it can do no better than ``key_removal_grad`` (``analyses/pruned_reference.py``). This builds, for every
sample of an exhaustive study (every single removal saved), the pruned reference each ranking detector
and each ``top_m`` would give — from the saved single removals and one shared pass a sample for the
rankings, no masked pass runs — and judges it by LDS on the study's own LDS masks, beside exhaustive
leave-one-out's, with ``same_top_k{k}``: whether its top k sources are exhaustive's, and
``lds_minus_studied``: its LDS less the studied reference's on the same sample. The one the study ran
(``key_removal_grad``, 8) is checked equal to the pruned study's own row (``--pruned``). A ranking
``A+B`` removes one by one the ``top_m`` sources of each of A and B (their union, at most 2 ``top_m``)
and scores the rest by A's ranking, scaled: the remedy proposed for a copied answer's source that
``key_removal_grad`` ranks low (RESULTS.md), with ``attn_lrp`` as B.

It answers a question of the reference, not of a detector: the samples it reads are those the reference
is measured on at 4K, not those a longer run judges.

    python -m analyses.pruned_choices figures/studies/detector_smollm2-135m-4096_196423fa \\
        --pruned figures/studies/detector_smollm2-135m-4096_71b8e04d --csv bench/results/pruned_choices.csv
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import probe
from bench.harness import intervals, report_with_summary, saved_passes_parser, study_masks
from probe import faithfulness, tasks
from probe.detectors import detect_many
from probe.detectors.ablation import pruned_estimate, pruned_sources

from .detector_compare import detector_options
from .length_ranking import faithfulness_studies
from .study_files import saved_passes

RANK_BY = (
    "key_removal_grad",
    "key_removal_banzhaf",
    "attn_lrp",
    "embedding_grad",
    "key_removal_grad+attn_lrp",
)
TOP_M = (4, 8, 16, 32)
KS = (1, 2, 4, 8)
STUDIED = ("key_removal_grad", 8)  # the pruned reference the held-out protocol runs


def same_top_k(scores: torch.Tensor, exhaustive: torch.Tensor, k: int) -> float:
    """1.0 when ``scores`` and ``exhaustive`` (Tensor[sources]) put the same k sources on top."""
    top = [set(torch.argsort(-s, stable=True)[:k].tolist()) for s in (scores, exhaustive)]
    return float(top[0] == top[1])


def union_sources(found: dict, sample, rank_by: str, top_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranking Tensor[sources], chosen LongTensor[≤ top_m a detector]) of the ranking ``rank_by``: one
    detector's name, or ``A+B``: the ``top_m`` of each, A's ranking scores the rest."""
    rankings = torch.stack([found[name].source_scores(sample) for name in rank_by.split("+")])
    return rankings[0], pruned_sources(rankings, top_m)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = saved_passes_parser(__doc__)
    parser.add_argument("--pruned", type=Path, default=None, help="the pruned study, for the check")
    parser.add_argument("--rank-by", nargs="+", default=list(RANK_BY), help="ranking detectors")
    parser.add_argument("--top-m", type=int, nargs="+", default=list(TOP_M), help="sources removed")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    studied = pd.Series(dtype=float)
    if args.pruned is not None:
        (pruned,) = faithfulness_studies(args.pruned)
        studied = pruned[pruned.scorer == "leave_one_out"].set_index(["task", "seed"]).lds
    rows = []
    for study in args.studies:
        (judged,) = faithfulness_studies(study)
        model_name, length = judged.model.iloc[0], int(judged.length.iloc[0])
        model, tokenizer = probe.load_model(model_name)
        detectors = sorted({name for rank_by in args.rank_by for name in rank_by.split("+")})
        options = detector_options(detectors, length, args.mask_seed)
        saved = saved_passes(study, model_name, length)
        by_sample = list(saved.groupby(["task", "seed"]))
        for (task, seed), passes in tqdm(by_sample, desc=f"{model_name} {length}"):
            sample = tasks.make(task, tokenizer, length, seed, model=model)
            known = faithfulness.Ablations.from_frame(passes, sample)
            drops = known.leave_one_out()
            kept, _ = study_masks(len(sample.sources), args.masks, args.ceiling_masks, args.mask_seed)
            actual = known.logprob_of(kept)
            found = detect_many(detectors, model, tokenizer, sample, options)
            about = {"model": model_name, "length": length, "task": task, "seed": seed}
            exhaustive_lds = faithfulness.lds(drops, kept, actual)
            for rank_by, top_m in [(r, m) for r in args.rank_by for m in args.top_m]:
                ranking, chosen = union_sources(found, sample, rank_by, top_m)
                scores = pruned_estimate(ranking, chosen, drops[chosen])
                lds = faithfulness.lds(scores, kept, actual)
                own = studied.get((task, seed)) if (rank_by, top_m) == STUDIED else None
                if own is not None and abs(lds - own) > 1e-6:
                    raise AssertionError(f"{task} {seed}: LDS {lds:.6f} ≠ the pruned study's {own:.6f}")
                rows.append(
                    {**about, "rank_by": rank_by, "top_m": top_m, "lds_pruned": lds,
                     "lds_exhaustive": exhaustive_lds, "lds_difference": lds - exhaustive_lds,
                     **{f"same_top_k{k}": same_top_k(scores, drops, k) for k in KS}}
                )  # fmt: skip
    table = pd.DataFrame(rows)
    per_sample = ["model", "length", "task", "seed"]
    studied_rows = table[(table.rank_by == STUDIED[0]) & (table.top_m == STUDIED[1])]
    table = table.merge(
        studied_rows[[*per_sample, "lds_pruned"]], on=per_sample, how="left", suffixes=("", "_studied")
    )
    table["lds_minus_studied"] = table.lds_pruned - table.pop("lds_pruned_studied")
    return report_with_summary(table, summarise(table), args.csv)


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Each ranking's means with 95 % bootstrap intervals over samples from :func:`main`'s per-sample
    ``table``: one group a study (model, length), ranking and ``top_m``, and, where the table holds
    several studies, each ranking and ``top_m`` over all of their samples (``model`` "all")."""
    measures = ["lds_pruned", "lds_difference", "lds_minus_studied", *(f"same_top_k{k}" for k in KS)]
    summary = intervals(table, ["model", "length", "rank_by", "top_m"], measures)
    if len(table.groupby(["model", "length"])) > 1:
        pooled = intervals(table, ["rank_by", "top_m"], measures).assign(model="all")
        summary = pd.concat([summary, pooled], ignore_index=True)
    return summary


if __name__ == "__main__":
    main()
