"""The controlled study's training: the networks of one setting one by one vs stacked and vmapped.

For each network size, ``--seeds`` networks (Wu et al.'s attention-only SAN, RoPE, batch 128) are
trained for ``--steps`` steps from the same initialisations on the same pre-drawn batches, first
one after another (:func:`probe.training.attention_only.train`), then together
(:func:`probe.training.attention_only.train_together`); the two runs alternate ``--repeats`` times in this
one process and the table keeps the median time per step of all networks and the ratio. The
trained weights of the two ways are compared too (they must agree to float rounding).

    python -m bench.position_bias_training --csv bench/results/position_bias_training.csv
    python -m bench.position_bias_training --device cuda      # where a GPU is lent
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from bench.harness import report
from probe.tasks.classification import InContextClassification
from probe.training.attention_only import AttentionOnly, SANConfig, train, train_together


def networks(config: SANConfig, seeds: list[int], device: str) -> list[AttentionOnly]:
    models = []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(AttentionOnly(config).to(device))
    return models


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n-layers", type=int, nargs="+", default=[2, 6, 10])
    parser.add_argument("--seeds", type=int, default=5, help="networks per setting")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_default_device(args.device)
    seeds = list(range(args.seeds))
    tasks = [InContextClassification(seed=seed) for seed in seeds]
    pools = [task.batch(128 * args.steps) for task in tasks]
    rows = []
    for n_layers in args.n_layers:
        config = SANConfig(n_layers=n_layers, pe="rope", residual=True)
        times = {"one by one": [], "together": []}
        for _ in range(args.repeats):
            alone, together = networks(config, seeds, args.device), networks(config, seeds, args.device)
            start = time.perf_counter()
            for model, task, pool in zip(alone, tasks, pools, strict=True):
                train(model, task, args.steps, data=pool)
            times["one by one"].append(time.perf_counter() - start)
            start = time.perf_counter()
            train_together(together, tasks, args.steps, data=pools)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()  # train() syncs every step with loss.item(); this run only here
            times["together"].append(time.perf_counter() - start)
        difference = max(
            (p - q).abs().max().item()
            for a, b in zip(alone, together, strict=True)
            for p, q in zip(a.parameters(), b.parameters(), strict=True)
        )
        for method, seconds in times.items():
            rows.append(
                dict(
                    n_layers=n_layers,
                    networks=args.seeds,
                    method=method,
                    ms_per_step=1000 * statistics.median(seconds) / args.steps,
                    max_weight_difference=difference,
                    device=args.device,
                    threads=args.threads,
                )
            )
    table = pd.DataFrame(rows)
    baseline = table[table.method == "one by one"].set_index("n_layers").ms_per_step
    table["speedup"] = table.n_layers.map(baseline) / table.ms_per_step
    return report(table, args.csv)


if __name__ == "__main__":
    main()
