"""Does integrating the key-removal gradient along the path of every key bias from 0 to −depth track
exact leave-one-out better than the gradient at 0? (``key_removal_gradient(depth=, steps=)``)

SmolLM2-135M (``--model``), multihop-1 and multihop-2 at 1K tokens (``--length``), seeds 100 +
``--seeds``; per sample the LDS (16 random half masks) and AOPC of comprehensiveness (k = 1, 4) of: the
gradient at 0 (``krg``), the path integral to depth 4 and 12 with 4 midpoint steps (``ig_d4_m4``,
``ig_d12_m4``), and exhaustive leave-one-out (``loo``). One thread; about 4 minutes a sample on the
2-core machine.

    python -m analyses.key_removal_path --seeds 0 1 2 --csv bench/results/key_removal_path.csv
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch

import probe
from bench.harness import add_device_arguments, load
from probe import faithfulness, tasks
from probe.atomic import atomic_write
from probe.probes.key_removal import key_removal_gradient

VARIANTS = {"krg": (0.0, 1), "ig_d4_m4": (4.0, 4), "ig_d12_m4": (12.0, 4)}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--csv", type=Path, default=None)
    add_device_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype)
    rows = []
    for task in ("multihop-1", "multihop-2"):
        for seed in args.seeds:
            sample = tasks.make(task, tokenizer, args.length, seed=100 + seed)
            start = time.perf_counter()
            scores = {
                name: faithfulness.source_scores(
                    key_removal_gradient(
                        model, sample.input_ids, sample.target_positions, depth=depth, steps=steps
                    ),
                    sample.sources,
                    "sum",
                )
                for name, (depth, steps) in VARIANTS.items()
            }
            scores["loo"] = probe.detect("leave_one_out", model, tokenizer, sample).source_scores(sample)
            frame = faithfulness.evaluate(
                model, sample, scores, faithfulness.Judgement(ks=[1, 4], n_masks=16)
            )
            rows.append(frame[["scorer", "lds", "aopc_comprehensiveness"]].assign(task=task, seed=seed))
            print(rows[-1].to_string(index=False), f"{time.perf_counter() - start:.0f} s", flush=True)
    table = pd.concat(rows, ignore_index=True)
    if args.csv:
        atomic_write(args.csv, lambda tmp: table.to_csv(tmp, index=False))
    print(table.groupby("scorer")[["lds", "aopc_comprehensiveness"]].mean())
    return table


if __name__ == "__main__":
    main()
