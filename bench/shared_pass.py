"""What sharing one forward+backward saves the main job: ``key_removal_grad`` read off the shared pass
against its own pass, in one process.

The main job's shared-pass detectors (``attention``, ``information_flow``, ``embedding_grad``) read one
:func:`probe.probes.attribution.answer_attribution` pass. ``key_removal_grad`` once ran a forward and
backward of its own under a key bias at 0 (:func:`probe.probes.key_removal.key_removal_gradient`, the
baseline); now the bias rides in the shared pass (``answer_attribution(key_bias=True)``), the model
unchanged at 0. Per sample (the main job's: SmolLM2-135M, multihop-1 and multihop-2 at 1K tokens,
seeds 0–11 by default; one thread): the seconds of the shared pass plus the own pass (``separate``)
and of the one pass (``shared``), alternating which runs first, their ratio, and the largest
difference between the two key-removal gradients.

    python -m bench.shared_pass --csv bench/results/shared_pass.csv
"""

from __future__ import annotations

import time

import pandas as pd
import torch

from bench.harness import load, report, samples_parser
from probe import detectors, tasks
from probe.probes.key_removal import key_removal_gradient

READERS = ["attention", "information_flow", "embedding_grad"]  # the main job's other shared-pass readers


def separate(model, tokenizer, sample: tasks.Sample) -> tuple[float, torch.Tensor]:
    """The shared pass for the readers, then the key-removal gradient's own pass: (seconds, gradient)."""
    start = time.perf_counter()
    detectors.detect_many(READERS, model, tokenizer, sample)
    gradient = key_removal_gradient(model, sample.input_ids, sample.target_positions)
    return time.perf_counter() - start, gradient


def shared(model, tokenizer, sample: tasks.Sample) -> tuple[float, torch.Tensor]:
    """One shared pass for the readers and ``key_removal_grad``: (seconds, gradient)."""
    start = time.perf_counter()
    found = detectors.detect_many([*READERS, "key_removal_grad"], model, tokenizer, sample)
    return time.perf_counter() - start, found["key_removal_grad"].scores


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = samples_parser(__doc__).parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype, args.tokenizer)
    shared(model, tokenizer, tasks.make(args.tasks[0], tokenizer, 256, seed=0))  # warm-up
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            sample = tasks.make(task, tokenizer, args.length, seed=seed)
            order = (separate, shared) if seed % 2 == 0 else (shared, separate)
            (seconds_a, grad_a), (seconds_b, grad_b) = (run(model, tokenizer, sample) for run in order)
            seconds = {order[0].__name__: seconds_a, order[1].__name__: seconds_b}
            row = dict(task=task, seed=seed, length=len(sample.input_ids), **seconds)
            row["max_abs_difference"] = float((grad_a - grad_b).abs().max())
            rows.append(row)
            print(row, flush=True)
    table = pd.DataFrame(rows)
    table["shared_vs_separate"] = table.shared / table.separate
    total = table.shared.sum() / table.separate.sum()
    print(f"shared / separate over {len(table)} samples: {total:.3f} (seconds {table.shared.sum():.1f} "
          f"vs {table.separate.sum():.1f})")  # fmt: skip
    return report(table, args.csv)


if __name__ == "__main__":
    main()
