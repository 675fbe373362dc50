"""Judge peers' scores beside longprobe's own re-implementations of them, on the exported samples.

    OMP_NUM_THREADS=1 .venv/bin/python bench/peers/context_cite/check.py EXPORTED.jsonl \
        --peer context-cite /tmp/peers/context_cite.jsonl context_cite \
        --peer at2 /tmp/peers/at2.jsonl at2 [--out /tmp/peers/check.csv]

Runs in longprobe's environment (it lives in ContextCite's folder; AT2's check is the same). Rebuilds
the samples from their keys (``task-length-seed``; the texts must equal the exported ones), reads each
peer's scores (``exchange.read_scores``), runs the longprobe detector each peer is compared with on each
sample, judges them all in one ``exchange.judge`` (LDS on 32 masks, top-k at 1, 2, 4, 8, the additive
ceiling on 64 masks: the masks they share run once) and prints, per sample, each one's LDS and the
Spearman correlation of each peer's source scores with longprobe's detector's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pandas as pd
import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import exchange  # noqa: E402

import probe  # noqa: E402
from probe import tasks  # noqa: E402


def rebuild(path: Path, model, tokenizer) -> list[tasks.Sample]:
    """The exported samples, rebuilt from their keys and checked against the exported texts."""
    samples = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        task, length, seed = record["key"].rsplit("-", 2)
        sample = tasks.make(task, tokenizer, int(length), int(seed), model=model)
        if exchange.sample_key(sample) != record["key"] or sample.text != record["text"]:
            raise SystemExit(f"{record['key']}: the rebuilt sample differs from the exported one")
        samples.append(sample)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exported", type=Path)
    parser.add_argument(
        "--peer", nargs=3, action="append", required=True, metavar=("NAME", "SCORES", "OURS"),
        help="a peer's name in the table, its scores file and the longprobe detector to compare it with",
    )  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path, default=None, help="the judged table as CSV")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = probe.load_model(args.model)
    samples = rebuild(args.exported, model, tokenizer)
    methods, agreement = {}, []
    for name, path, detector in args.peer:
        peer = exchange.read_scores(path, samples)
        ours = {}
        for sample in samples:
            key = exchange.sample_key(sample)
            start = time.perf_counter()
            scores = probe.detect(detector, model, tokenizer, sample).source_scores(sample)
            ours[key] = (scores, time.perf_counter() - start)
            rho = spearmanr(peer[key][0].numpy(), scores.numpy()).statistic
            agreement.append({"sample": key, "scorer": name, "spearman_vs_ours": rho})
        methods[name], methods[f"longprobe {detector}"] = peer, ours
    frame = exchange.judge(model, samples, methods, ceiling_masks=64, n_masks=32, ks=(1, 2, 4, 8))
    frame = frame.merge(pd.DataFrame(agreement), on=["sample", "scorer"], how="left")
    if args.out:
        frame.to_csv(args.out, index=False)
    columns = [
        "sample",
        "scorer",
        "lds",
        "lds_share",
        "aopc_comprehensiveness",
        "seconds",
        "spearman_vs_ours",
    ]
    with pd.option_context("display.width", 200):
        print(frame[columns].round(3).to_string(index=False))


if __name__ == "__main__":
    main()
