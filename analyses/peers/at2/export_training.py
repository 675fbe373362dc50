"""Export the samples longprobe trains its own ``at2`` head weights on, for AT2's trainer (``train.py``).

    OMP_NUM_THREADS=1 .venv/bin/python -m analyses.peers.at2.export_training --out /tmp/peers/at2_train.jsonl

Runs in longprobe's environment. The tasks, length, sample count and first seed are
``analyses.learn_head_weights``'s own defaults (today: multihop-1 and multihop-2 at 1024 tokens, seeds
1000-1009, 20 samples), so the two trainers see the same samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from probe import load_model
from probe.models import converted_folder

from ... import learn_head_weights
from .. import exchange
from ..export_samples import heldout_samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="default: learn_head_weights' --model")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    defaults = learn_head_weights.parse_args(["--out", str(args.out.parent)])
    name = args.model or defaults.model
    model, tokenizer = load_model(name)
    samples = heldout_samples(
        model,
        tokenizer,
        defaults.tasks,
        defaults.train_samples,
        learn_head_weights.TRAIN_SEED,
        defaults.length,
    )
    print(len(samples), "samples:", exchange.export(samples, converted_folder(name), args.out))


if __name__ == "__main__":
    main()
