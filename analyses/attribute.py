"""Which parts of your document carry the model's answer to your question (:func:`probe.attribute`).

The context file is cut into sources (sentences by default), the model answers the query greedily
(or explains ``--response``), and ``--detector`` scores every source. Writes to ``--out``:

- ``sources.csv``: one row per source: its text, score and rank (1 = carries the answer most);
- ``view.html``: the prompt with each token shaded by its score (self-contained, opens offline);
- with ``--faithfulness``: ``faithfulness.csv``, the method's comprehensiveness, sufficiency, AOPC
  and LDS (:func:`probe.faithfulness.evaluate`), beside exact leave-one-out and random scores.

    python -m analyses.attribute --model smollm2-135m --context doc.txt --query "Who wrote it?" --out out/
    python -m analyses.attribute --model HuggingFaceTB/SmolLM2-360M-Instruct --context doc.txt \\
        --query "..." --detector leave_one_out --faithfulness --device cuda --out out/
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import probe
from probe import detectors, faithfulness
from probe.atomic import atomic_write

from .arguments import add_device_arguments, check_device_arguments, check_out, load


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="bundled name, local folder or hub id")
    parser.add_argument("--context", type=Path, required=True, help="a UTF-8 text file: the document")
    parser.add_argument("--query", required=True, help="the question about the document")
    parser.add_argument("--response", default=None, help="the answer to explain (default: the model's)")
    parser.add_argument("--detector", default="key_removal_banzhaf", choices=detectors.names())
    parser.add_argument("--sources", default="sentences", choices=("sentences", "paragraphs"))
    parser.add_argument("--faithfulness", action="store_true", help="also measure faithfulness by ablation")
    parser.add_argument("--masks", type=int, default=32, help="random source masks for LDS")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_device_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="output folder (created)")
    args = parser.parse_args(argv)
    if not args.context.is_file():
        parser.error(f"--context {args.context} is not a file")
    try:
        args.text = args.context.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"--context {args.context} cannot be read as UTF-8 text: {error}")
    if not args.text.strip():
        parser.error(f"--context {args.context} is empty")
    if not args.query.strip():
        parser.error("--query is empty")
    if args.masks < 2 or args.max_new_tokens < 1:
        parser.error("--masks must be at least 2 and --max-new-tokens at least 1")
    check_out(parser, args.out)
    check_device_arguments(parser, args)
    return args


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args = parse_args(argv)
    model, tokenizer = load(args)
    found = probe.attribute(
        model, tokenizer, args.text, args.query, args.response, args.detector, args.sources,
        max_new_tokens=args.max_new_tokens,
    )  # fmt: skip
    sample = found.sample
    table = found.to_frame().drop(columns=["detector"]).sort_values("rank")
    atomic_write(args.out / "sources.csv", lambda tmp: table.to_csv(tmp, index=False))
    found.save_html(args.out / "view.html")
    about = {"model": args.model, "query": args.query, "response": sample.answer, "detector": args.detector}
    atomic_write(args.out / "settings.json", lambda tmp: tmp.write_text(json.dumps(about, indent=1)))
    print(f"response: {sample.answer!r}\n\n{table.head(10).to_string(index=False)}")
    if args.faithfulness:
        scores = {args.detector: found.source_scores()}
        if args.detector != "leave_one_out":
            scores["leave_one_out"] = probe.detect("leave_one_out", model, tokenizer, sample).source_scores()
        scores["random_sources"] = torch.tensor(np.random.default_rng(0).random(len(sample.sources)))
        faithful = faithfulness.evaluate(
            model, sample, scores, faithfulness.Judgement(n_masks=args.masks, seed=1)
        )
        atomic_write(args.out / "faithfulness.csv", lambda tmp: faithful.to_csv(tmp, index=False))
        columns = ["scorer", "aopc_comprehensiveness", "aopc_sufficiency", "lds"]
        print(f"\nfaithfulness:\n{faithful[columns].round(3).to_string(index=False)}")
    return table


if __name__ == "__main__":
    main()
