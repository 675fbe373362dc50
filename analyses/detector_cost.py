"""What each detector costs on one sample: seconds, forward-pass equivalents and peak memory, every row
measured in one invocation on one machine.

For each length, one sample of ``--task`` (a held-out task by default) is made and every detector of
the registry (``--detectors``) runs on it with the held-out study's options
(:func:`analyses.detector_compare.detector_options`: exhaustive leave-one-out, LSD's K = length / 4,
``context_cite`` and ``key_removal_banzhaf`` with their default numbers of masks). Each detector runs
twice; the second run is timed (:func:`harness.measure`: synchronized time and
``torch.cuda.max_memory_allocated`` above the loaded model on a GPU, peak RSS above the warmed-up
process on the CPU, where memory the first run left cached is not counted). ``forward`` (one no-grad
pass over the sample) is the baseline of the ratios: ``time_vs_forward`` is a detector's cost in
forward-pass equivalents on this machine.

The CPU's costs of the real models come from the held-out study itself (its ``seconds`` column); this
script is for a machine where those runs are not made, e.g. a GPU with a random model of a published
shape (:data:`harness.RANDOM_CONFIGS`; time does not depend on the weights; the tasks need a real
tokenizer, ``--tokenizer``).

    python -m analyses.detector_cost --model smollm2-135m --lengths 1024
    python -m analyses.detector_cost --device cuda --model qwen2.5-0.5b --tokenizer TOK \\
        --lengths 1024 4096 16384 --csv bench/results/detector_cost_gpu.csv
"""

from __future__ import annotations

import argparse
import functools

import pandas as pd

from bench.harness import add_device_arguments, add_ratios, load, measure, report
from probe import detectors, tasks

from .detector_compare import detector_options


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024])
    parser.add_argument("--task", default="multihop-4", choices=tasks.TASKS)
    parser.add_argument("--seed", type=int, default=24000, help="the sample's seed (outside every study)")
    parser.add_argument("--detectors", nargs="+", default=detectors.names(), choices=detectors.names())
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--csv", default=None, help="also write the table here")
    add_device_arguments(parser)
    return parser.parse_args(argv)


def costs(model, tokenizer, sample: tasks.Sample, options: dict[str, dict], device: str) -> list[dict]:
    """One row per method (``forward``, then each detector of ``options``, name → its options) on
    ``sample``: :func:`harness.measure`'s seconds and peak memory of its second run, or the error
    where it runs out of memory."""
    import torch

    ids = sample.input_ids[None].to(device)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    runs = {"forward": forward} | {
        name: functools.partial(detectors.detect, name, model, tokenizer, sample, **given)
        for name, given in options.items()
    }
    rows = []
    for method, run in runs.items():
        try:
            found = measure(run, run, device)[0]
        except torch.OutOfMemoryError as error:  # a row that says so; the other detectors still run
            found = {"error": f"out of memory: {str(error).splitlines()[0]}"}
            torch.cuda.empty_cache()
        rows.append({"method": method, **found})
        print(f"{len(ids[0]):>6} {method:<21} {found}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> pd.DataFrame:
    import torch

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype, args.tokenizer)
    if tokenizer is None:
        raise SystemExit("--tokenizer: a random-shape model needs a real tokenizer's folder to build tasks")
    rows = []
    for length in args.lengths:
        sample = tasks.make(args.task, tokenizer, length, seed=args.seed, model=model)
        about = {"length": length, "tokens": len(sample.input_ids), "sources": len(sample.sources)}
        study = detector_options(args.detectors, length, args.seed)
        options = {name: study.get(name, {}) for name in args.detectors}
        rows += [about | row for row in costs(model, tokenizer, sample, options, args.device)]
    setting = {"model": args.model, "task": args.task, "device": args.device, "dtype": str(model.dtype)}
    table = add_ratios(pd.DataFrame(rows).assign(**setting), "forward")
    return report(table, args.csv)


if __name__ == "__main__":
    main()
