"""Export the held-out study's samples (figures/studies/heldout_protocol.md) for the peers.

    python -m analyses.peers.export_samples --model smollm2-135m --out samples.jsonl \
        [--tasks multihop-4 kv document-2 key-token] [--samples 6] [--seed 5000] [--length 1024]

Writes :func:`exchange.export`'s JSON lines; the ``model`` field is the converted model's folder, which
every peer loads with its own transformers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from probe import load_model, tasks
from probe.models import converted_folder

from . import exchange


def heldout_samples(model, tokenizer, task_names, n: int, seed: int, length: int) -> list[tasks.Sample]:
    """The protocol's samples: for each task, seeds ``seed`` .. ``seed + n - 1``."""
    return [
        tasks.make(task, tokenizer, length, s, model=model)
        for task in task_names
        for s in range(seed, seed + n)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(tasks.HELD_OUT_TASKS))
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--seed", type=int, default=5000)
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    samples = heldout_samples(model, tokenizer, args.tasks, args.samples, args.seed, args.length)
    print(exchange.export(samples, converted_folder(args.model), args.out))


if __name__ == "__main__":
    main()
