"""Export the held-out study's samples (figures/studies/heldout_protocol.md) for the peers.

    python -m analyses.peers.export_samples --model smollm2-135m --out samples.jsonl \
        [--tasks multihop-4 kv document-2 key-token] [--samples 6] [--seed 5000] [--length 1024]
    python -m analyses.peers.export_samples --model qwen2.5-coder-1.5b --out hotpotqa.jsonl \
        --tasks hotpotqa --length natural --explain own    # real questions, the model's own answers

Writes :func:`exchange.export`'s JSON lines; the ``model`` field is the converted model's folder, which
every peer loads with its own transformers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from probe import load_model, tasks
from probe.models import converted_folder

from ..arguments import length_setting
from ..comparison import EXPLAINED, explained
from . import exchange


def heldout_samples(
    model, tokenizer, task_names, n: int, seed: int, length: int | None, explain: str | None = None
) -> list[tasks.Sample]:
    """The protocol's samples: for each task, seeds ``seed`` .. ``seed + n - 1`` (``length`` None: a real
    question's own length), each carrying the answer the peers explain: ``explain`` as
    :func:`analyses.comparison.explained` takes it (``"own"``: the model's greedy answer, teacher-forced;
    None: own for real questions, gold elsewhere)."""
    seeds = range(seed, seed + n)
    made = [tasks.make(task, tokenizer, length, s, model=model) for task in task_names for s in seeds]
    return [
        explained(model, tokenizer, one, "own")[0]
        if (explain or ("own" if one.scoring == "exact_match" else "gold")) == "own"
        else one
        for one in made
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(tasks.HELD_OUT_TASKS))
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--seed", type=int, default=5000)
    parser.add_argument("--length", type=length_setting, default=1024, help="tokens, or 'natural'")
    parser.add_argument(
        "--explain", choices=EXPLAINED, default=None,
        help="the answer the peers explain: gold, or the model's own (default: own for real questions)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model)
    samples = heldout_samples(
        model, tokenizer, args.tasks, args.samples, args.seed, args.length, args.explain
    )
    print(exchange.export(samples, converted_folder(args.model), args.out))


if __name__ == "__main__":
    main()
