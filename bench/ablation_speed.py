"""Ablation passes: key masking vs prefix reuse vs compaction, and pruned leave-one-out.

Each (method, length) runs in its own child process (``bench/harness.py``) on the same sample
(``multihop-2`` at the given prompt length, seed 0). The mask methods score the same masks, a slice of
one faithfulness evaluation (:func:`probe.faithfulness.answer_scores`): the full context, 4 random
half masks, the top-k supporting facts removed and kept for k = 1, 2, 4, 8 (sufficiency keeps few
tokens), and 4 single sources removed (leave-one-out passes) — 17 masks:

- ``key_masking``: every pass runs the whole sequence with the removed tokens key-masked;
- ``prefix``: key masking, the unmasked prefix before each pass's first removed token run once;
- ``compaction``: prefix reuse, and each pass runs only the kept tokens at their original positions;
- ``compaction_batch4``: the same, four masks per forward.

The ``faithfulness_*`` methods time all the ablation it takes to judge the main job's detectors on a
sample (leave-one-out and :func:`probe.faithfulness.evaluate` of its six detectors and two
references, whose scores are computed first, untimed), on ``--loo-samples`` samples (multihop-1 and
multihop-2 in turn, seeds 0, 1, ...):

- ``faithfulness_before``: the protocol and ablation of before compaction — exhaustive leave-one-out
  and top-k removed and kept for k = 1, 2, 4, 8 and 32 random masks, key masking after the reused
  prefix; the ratio's baseline;
- ``faithfulness_compaction``: the same masks, compacted;
- ``faithfulness_main_job``: the main job's protocol — leave-one-out exact on ``key_removal_grad``'s
  top 8 (its ranking at hand), k = 1, 4 and 16 random masks, compacted, leave-one-out's passes not
  run again;
- ``faithfulness_main_job_bfloat16``: the same with the model in bfloat16 (``--dtype bfloat16`` of
  the main job; fast only on a CPU with native bf16 matrix products, such as avx512_bf16 or AMX).

``logprob_sum`` is a checksum: equal (to fp32 rounding) across the mask methods; on the
``faithfulness_*`` rows it is the sum of every scorer's LDS, equal between ``before`` and
``compaction``.

The leave-one-out methods (``loo_*``, :func:`probe.detectors.leave_one_out`, compaction on) run on
``--loo-samples`` samples (multihop-2, seeds 0, 1, ...) and report passes and seconds per sample and,
against ``loo_exhaustive``: how often the top source is the same (``top1_agreement``) and the
Spearman correlation of the source scores:

- ``loo_exhaustive``: one pass per source;
- ``loo_pruned``: exact on the 8 sources that ``key_removal_grad`` ranks highest (its cost included);
- ``loo_hierarchical``: blocks of 4 sources, the 3 blocks with the largest drops refined.

Exhaustive leave-one-out's source scores are kept in ``--exhaustive-dir`` (default: a temporary
folder of the invocation), so that the other ``loo_*`` rows compare with them without running it
again; a row without them there runs it first, untimed.

    python -m bench.ablation_speed                        # SmolLM2-135M at 1K tokens
    python -m bench.ablation_speed --model gemma3-270m --lengths 1024 4096 --csv out.csv
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import pandas as pd

from bench.harness import bench_parser, load, measure, report, run_bench

MASK_METHODS = {
    "key_masking": dict(reuse_prefix=False, compact=False),
    "prefix": dict(reuse_prefix=True, compact=False),
    "compaction": dict(reuse_prefix=True, compact=True),
    "compaction_batch4": dict(reuse_prefix=True, compact=True, batch_size=4),
}
LOO_METHODS = {
    "loo_exhaustive": {},
    "loo_pruned": dict(top_m=8, rank_by="key_removal_grad"),
    "loo_hierarchical": dict(block=4, refine=3),
}
FAITHFULNESS_METHODS = {
    "faithfulness_before": dict(top_m=None, ks=(1, 2, 4, 8), n_masks=32, compact=False),
    "faithfulness_compaction": dict(top_m=None, ks=(1, 2, 4, 8), n_masks=32, compact=True),
    "faithfulness_main_job": dict(top_m=8, ks=(1, 4), n_masks=16, compact=True),
}
FAITHFULNESS_METHODS["faithfulness_main_job_bfloat16"] = FAITHFULNESS_METHODS["faithfulness_main_job"]
#: Methods whose model runs in another dtype than ``--dtype``.
METHOD_DTYPES = {"faithfulness_main_job_bfloat16": "bfloat16"}
# the one-pass detectors the main job judged when these timings were taken (lsd joined it later)
MAIN_JOB_ONE_PASS = [
    "attention",
    "information_flow",
    "embedding_grad",
    "key_removal_grad",
    "key_removal_banzhaf",
]
METHODS = (*MASK_METHODS, *LOO_METHODS, *FAITHFULNESS_METHODS)


def bench_masks(sample):
    """BoolTensor[17, sources] of removed sources: the slice of a faithfulness evaluation above."""
    import torch

    from probe import faithfulness

    n_sources = len(sample.sources)
    top = faithfulness.top_k_masks(faithfulness.ground_truth_scores(sample), faithfulness.KS)
    single = faithfulness.single_removals(torch.linspace(0, n_sources - 1, 4).long(), n_sources)
    random = ~faithfulness.random_masks(n_sources, 4, seed=0)
    return torch.cat([torch.zeros(1, n_sources, dtype=torch.bool), random, top, ~top, single])


def judge_sample(model, tokenizer, sample, top_m: int | None, ks, n_masks: int, compact: bool) -> tuple:
    """(seconds, passes, LDS sum) of the ablation that judges the main job's detectors on ``sample``:
    leave-one-out (exhaustive, or exact on ``key_removal_grad``'s top ``top_m``), then the faithfulness
    evaluation of every scorer, ``compact`` or key masking after the reused prefix."""
    from unittest import mock

    import probe
    from probe import detectors, faithfulness

    options = {"key_removal_banzhaf": {"seed": 1}}
    found = detectors.detect_many(MAIN_JOB_ONE_PASS, model, tokenizer, sample, options)
    scorers = {name: detection.source_scores(sample) for name, detection in found.items()}
    scorers |= faithfulness.reference_scores(sample)
    pruning = (
        {} if top_m is None else {"top_m": top_m, "ranking": found["key_removal_grad"].source_scores(sample)}
    )
    judgement, how = faithfulness.Judgement(ks=ks, n_masks=n_masks), faithfulness.Passes(compact=compact)
    start = time.perf_counter()
    exact = probe.detect("leave_one_out", model, tokenizer, sample, compact=compact, **pruning)
    known, scorers["leave_one_out"] = faithfulness.Ablations.of(exact), exact.source_scores(sample)
    with mock.patch.object(faithfulness, "answer_scores", wraps=faithfulness.answer_scores) as calls:
        frame = faithfulness.evaluate(model, sample, scorers, judgement, how, known=[known])
    passes = len(known.removed) + sum(len(call.args[2]) for call in calls.call_args_list)
    return time.perf_counter() - start, passes, float(frame.lds.sum())


def exhaustive_scores(model, tokenizer, sample, found, method: str, path: Path):
    """Exhaustive leave-one-out's source scores of ``sample``: ``found``'s for ``loo_exhaustive`` (kept
    at ``path`` for the other loo_* children of this invocation), else read back from there (run
    first, untimed, if no exhaustive row came before)."""
    import torch

    import probe

    if method == "loo_exhaustive":
        torch.save(found.details["source_scores"], path)
        return found.details["source_scores"]
    if not path.exists():
        torch.save(probe.detect("leave_one_out", model, tokenizer, sample).details["source_scores"], path)
    return torch.load(path)


def _run_child(
    method: str,
    length: int,
    model_name: str,
    threads: int,
    loo_samples: int,
    device: str,
    dtype: str | None,
    tokenizer_folder: str | None,
    exhaustive_dir: Path,
) -> dict:
    """Measure one method in this (fresh) process: time, memory, passes and a checksum or agreement."""
    import torch
    from scipy.stats import spearmanr

    import probe
    from probe import faithfulness, tasks

    torch.set_num_threads(threads)
    model, tokenizer = load(model_name, device, METHOD_DTYPES.get(method, dtype), tokenizer_folder)
    sample = tasks.make("multihop-2", tokenizer, length, seed=0)
    if method in FAITHFULNESS_METHODS:
        faithfulness.answer_scores(model, sample, bench_masks(sample)[:2])  # warm up
        rows = []
        for index in range(loo_samples):
            task, seed = ("multihop-1", "multihop-2")[index % 2], index // 2
            one = tasks.make(task, tokenizer, length, seed=seed)
            rows.append(judge_sample(model, tokenizer, one, **FAITHFULNESS_METHODS[method]))
        seconds, passes, lds = (sum(column) for column in zip(*rows, strict=True))
        totals = {"seconds": seconds, "passes": passes, "logprob_sum": lds, "samples": loo_samples}
        return {**totals, "peak_mib": float("nan")}
    if method in MASK_METHODS:
        removed, how = bench_masks(sample), faithfulness.Passes(**MASK_METHODS[method])

        def run():
            return faithfulness.answer_scores(model, sample, removed, how)

        stats, result = measure(run, lambda: faithfulness.answer_scores(model, sample, removed[:2]), device)
        return {**stats, "samples": 1, "passes": len(removed), "logprob_sum": float(result.logprob.sum())}
    samples = [tasks.make("multihop-2", tokenizer, length, seed=seed) for seed in range(loo_samples)]
    faithfulness.answer_scores(model, sample, bench_masks(sample)[:2])  # warm up
    rows = []
    for one in samples:
        start = time.perf_counter()
        found = probe.detect("leave_one_out", model, tokenizer, one, **LOO_METHODS[method])
        seconds = time.perf_counter() - start
        path = exhaustive_dir / f"{model_name}_{length}_{dtype}_{one.seed}.pt"
        ours = found.details["source_scores"]
        exact = exhaustive_scores(model, tokenizer, one, found, method, path)
        rows.append(
            {
                "seconds": seconds,
                "passes": found.details["passes"],
                "top1_agreement": float(ours.argmax() == exact.argmax()),
                "spearman_vs_exhaustive": float(spearmanr(ours.numpy(), exact.numpy()).statistic),
            }
        )
    frame = pd.DataFrame(rows)
    agreement = frame[["top1_agreement", "spearman_vs_exhaustive"]].mean().to_dict()
    totals = {"seconds": float(frame.seconds.sum()), "passes": int(frame.passes.sum())}  # over the samples
    return {**totals, **agreement, "samples": len(samples), "peak_mib": float("nan")}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = bench_parser(__doc__, METHODS, [1024])
    parser.add_argument("--models", nargs="+", default=None, help="several models in one invocation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loo-samples", type=int, default=4, help="samples for the loo_* rows")
    parser.add_argument(
        "--exhaustive-dir", type=Path, default=None, help="keep exhaustive leave-one-out's scores here"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        return _main(args, args.exhaustive_dir or Path(scratch))


def _main(args: argparse.Namespace, exhaustive_dir: Path) -> pd.DataFrame:
    exhaustive_dir.mkdir(parents=True, exist_ok=True)
    child = functools.partial(
        _run_child,
        model_name=args.model,
        threads=args.threads,
        loo_samples=args.loo_samples,
        device=args.device,
        dtype=args.dtype,
        tokenizer_folder=args.tokenizer,
        exhaustive_dir=exhaustive_dir,
    )
    forwarded = ["--threads", str(args.threads), "--loo-samples", str(args.loo_samples)]
    forwarded += ["--exhaustive-dir", str(exhaustive_dir)]
    if args.child:
        return run_bench(args, __spec__.name, forwarded, child, "")
    tables = []
    for model in args.models or [args.model]:
        one = run_bench(
            argparse.Namespace(**{**vars(args), "model": model, "csv": None}),
            __spec__.name,
            forwarded,
            child,
            "",
        )
        tables.append(one.assign(model=model))
    table = pd.concat(tables, ignore_index=True)
    return report(add_ratios(table), args.csv)


#: Each ratio column and the method it divides by, per family of methods (same model and length).
RATIOS = {
    "time_vs_key_masking": {"mask": "key_masking"},
    "time_vs_prefix": {"mask": "prefix"},
    "time_vs_before": {"faithfulness": "faithfulness_before"},
    "time_vs_exhaustive": {"loo": "loo_exhaustive"},
}


def add_ratios(table: pd.DataFrame) -> pd.DataFrame:
    """Seconds per sample and passes per second, and each row's time as a ratio of its family's
    baseline (:data:`RATIOS`); NaN where the family has none."""
    table = table.assign(
        seconds_per_sample=table.seconds / table.samples, passes_per_second=table.passes / table.seconds
    )
    family = table.method.map(
        lambda m: "faithfulness" if m.startswith("faithfulness") else "loo" if m.startswith("loo") else "mask"
    )
    reference = table.set_index(["model", "length", "method"]).seconds_per_sample
    for column, baselines in RATIOS.items():
        keys = pd.MultiIndex.from_arrays([table.model, table.length, family.map(baselines)])
        table[column] = table.seconds_per_sample.to_numpy() / reference.reindex(keys).to_numpy()
    return table


if __name__ == "__main__":
    main()
