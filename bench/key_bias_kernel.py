"""What the flash kernel of the key bias saves: the key-removal detectors on the flash kernel against
sdpa's math kernel, in one process.

``key_removal_grad`` and ``key_removal_banzhaf`` (presence ½) take one forward and backward under a
key bias (:func:`probe.modifiers.bias_keys`). On CPU the bias runs on the flash kernel
(:mod:`probe.flash_key_bias`); the baseline here is the math kernel it ran on before (the biased mask,
every layer's ``[heads, n, n]`` attention kept for the backward, checkpointed where the planner says
so), which CUDA still uses. Per model and length, on one sample (multihop-2, seed 0): each detector's
seconds on both kernels, their ratio, the ratio to ``information_flow`` (the one-pass goal's
yardstick: ≤ 1.5×), and the largest difference between the two kernels' source scores.

    python -m bench.key_bias_kernel --csv bench/results/key_bias_kernel.csv
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from unittest import mock

import pandas as pd
import torch

from bench.harness import load
from probe import attention, detectors, modifiers, tasks
from probe.atomic import atomic_write

DETECTORS = {
    "information_flow": ("information_flow", {}),
    "key_removal_grad": ("key_removal_grad", {}),
    "key_removal_banzhaf": ("key_removal_banzhaf", {}),
}


def math_kernel():
    """The baseline: every key bias on the biased mask (sdpa's math kernel), planned as such."""
    never = mock.patch.object(attention, "flash_key_bias", lambda *args: False)
    planned = mock.patch.object(modifiers, "flash_key_bias", lambda *args: False)
    return never, planned


def timed(model, tokenizer, sample, name: str) -> tuple[float, torch.Tensor]:
    detector, options = DETECTORS[name]
    start = time.perf_counter()
    found = detectors.detect(detector, model, tokenizer, sample, **options)
    return time.perf_counter() - start, found.source_scores(sample)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.models:
        model, tokenizer = load(name)
        for length in args.lengths:
            warm_up = tasks.make("multihop-2", tokenizer, 256, seed=0)
            timed(model, tokenizer, warm_up, "key_removal_grad")
            sample = tasks.make("multihop-2", tokenizer, length, seed=0)
            for detector in DETECTORS:
                seconds, scores = timed(model, tokenizer, sample, detector)
                row = dict(model=name, length=length, detector=detector, flash_seconds=seconds)
                if detector != "information_flow":
                    never, planned = math_kernel()
                    with never, planned:
                        math_seconds, math_scores = timed(model, tokenizer, sample, detector)
                    difference = float((scores - math_scores).abs().max())
                    row |= dict(math_seconds=math_seconds, max_abs_difference=difference)
                rows.append(row)
                print(row, flush=True)
            table = summary(rows)
            if args.csv:  # after each length: a stopped run keeps what it measured
                atomic_write(args.csv, functools.partial(table.to_csv, index=False))
    print(table.to_string(index=False))
    return table


def summary(rows: list[dict]) -> pd.DataFrame:
    """The rows with the flash kernel's speed-up over the math kernel and each detector's seconds
    over ``information_flow``'s (same model and length, flash kernel)."""
    table = pd.DataFrame(rows)
    flow = table[table.detector == "information_flow"].set_index(["model", "length"]).flash_seconds
    yardstick = table.set_index(["model", "length"]).index.map(flow)
    return table.assign(
        speedup=table.math_seconds / table.flash_seconds,
        flash_vs_information_flow=table.flash_seconds / yardstick,
        math_vs_information_flow=table.math_seconds / yardstick,
    )


if __name__ == "__main__":
    main()
