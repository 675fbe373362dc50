"""Why does `context-cite` 0.0.4 trail our `context_cite` on Gemma 3? Its target, tested on saved passes.

The two fit the same LASSO (α = 0.01, standardized masks) to 64 random half masks, but to different
targets: ours to the answer's log-probability log p; ContextCite's to its logit-probability
log p − log(1 − p), divided by the answer's tokens before the fit and multiplied back (its
`aggregate_logit_probs` and `solver.py`; analyses/peers/context_cite/NOTES.md). Where the model is sure of
its answer (p → 1) the two part: log p saturates at 0, while −log(1 − p) still moves. LDS is judged
against log p. This fits both targets, and the two mixed forms, on the same masks — the first 64 of a
held-out study's 256 ceiling masks, read from its saved passes (no model runs) — and scores each on
the study's 32 LDS masks. It cannot test the other difference, ContextCite's cutting removed text out
and re-tokenizing where we mask keys: the saved passes are all key-masked.

Reads finished studies (or running ones) and the answers' token counts from the peers' exported
samples; tunes nothing (an explanation of a gap, not a new setting).

    python -m analyses.context_cite_target figures/studies/detector_gemma3-270m-1024_faffad12 \\
        --samples bench/results/peers/gemma3-270m-1024/samples.jsonl \\
        --csv bench/results/context_cite_target.csv
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bench.harness import intervals, report_with_summary, saved_passes_parser, study_masks
from probe import faithfulness
from probe.detectors.ablation import lasso_surrogate

from .peers.exchange import key_fields
from .study_files import saved_passes

TARGETS = {  # name → (target from log p [masks] and answer tokens, per answer token as ContextCite fits it)
    "log p (ours)": (lambda logprob: logprob, False),
    "log p per token": (lambda logprob: logprob, True),
    "logit p": (lambda logprob: logprob - torch.log(-torch.expm1(logprob)), False),
    "logit p per token (ContextCite)": (lambda logprob: logprob - torch.log(-torch.expm1(logprob)), True),
}


def answer_tokens(exported: list[Path]) -> dict[tuple[str, int], int]:
    """(task, seed) → the teacher-forced answer's token count, from the peers' ``samples.jsonl``."""
    counts = {}
    for path in exported:
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            task, _, seed = key_fields(sample["key"])
            counts[task, seed] = len(sample["input_ids"]) - sample["prompt_tokens"]
    return counts


def sample_rows(passes: pd.DataFrame, tokens: int, n_masks: int, fit_masks: int, ceiling_masks: int,
                seed: int, alpha: float) -> list[dict]:  # fmt: skip
    """One sample's saved passes → one row per target: LDS of the LASSO fit on the first ``fit_masks``
    ceiling masks."""
    known = faithfulness.Ablations.from_frame(passes)
    kept_lds, fit = study_masks(known.removed.shape[1], n_masks, ceiling_masks, seed)
    fit = fit[:fit_masks]
    actual, logprob = known.logprob_of(kept_lds), known.logprob_of(fit).double()
    full = float(known.logprob_of(torch.ones(1, kept_lds.shape[1], dtype=torch.bool))[0])
    rows = []
    for name, (target, per_token) in TARGETS.items():
        scale = tokens if per_token else 1
        weights, _ = lasso_surrogate(fit, target(logprob) / scale, alpha)
        rows.append({"target": name, "lds": faithfulness.lds(weights * scale, kept_lds, actual),
                     "answer_tokens": tokens, "full_p": float(np.exp(full))})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = saved_passes_parser(__doc__)
    parser.add_argument(
        "--samples", type=Path, nargs="+", required=True, help="the peers' samples.jsonl of these studies"
    )
    parser.add_argument("--fit-masks", type=int, default=64, help="masks to fit on (ContextCite's 64)")
    parser.add_argument("--alpha", type=float, default=0.01, help="LASSO penalty (both ContextCites' 0.01)")
    args = parser.parse_args(argv)
    if args.fit_masks > args.ceiling_masks:
        parser.error(f"--fit-masks {args.fit_masks} > the studies' {args.ceiling_masks} ceiling masks")
    tokens = answer_tokens(args.samples)
    rows = []
    for study in args.studies:
        for (model, task, seed), passes in saved_passes(study).groupby(["model", "task", "seed"]):
            if (task, seed) not in tokens:
                parser.error(f"{task} {seed} of {study} is in none of --samples")
            found = sample_rows(passes, tokens[task, seed], args.masks, args.fit_masks, args.ceiling_masks,
                                args.mask_seed, args.alpha)  # fmt: skip
            rows += [{"model": model, "task": task, "seed": seed, **row} for row in found]
    table = pd.DataFrame(rows)
    ours = table[table.target == "log p (ours)"].set_index(["model", "task", "seed"]).lds
    table["minus_ours"] = table.lds - table.set_index(["model", "task", "seed"]).index.map(ours)
    by_task = table.assign(target=table.task + ": " + table.target)
    summary = pd.concat(
        [intervals(table, ["model", "target"], ["lds", "minus_ours"]),
         intervals(by_task, ["model", "target"], ["minus_ours"])]
    )  # fmt: skip
    return report_with_summary(table, summary, args.csv)


if __name__ == "__main__":
    main()
