"""``probe.longppl`` against the official PyPI package ``longppl`` 0.3.0: key tokens, time, peak memory.

The official package is installed ``--no-deps`` into a throwaway folder for this run only (it is no
dependency of longprobe) and called as ``longppl.longppl.compute_longppl`` (its file imported by path).
Every method runs on the same model (evaluator = evaluated model), text (Paul Graham essays), K and d,
each in its own child process measured by ``bench/harness.py`` (peak RSS above the warmed-up model, wall
time):

- ``official``: ``compute_longppl(text, model, model, tokenizer, tokenizer, trunc_len=K, sliding_window=d)``;
- ``ours_official``: ``probe.longppl(..., official=True)`` — the official choices, our implementation;
- ``ours``: ``probe.longppl(...)`` — our default (no wasted first window, one full pass when the
  evaluator is the model itself).

Key-token agreement compares the key character spans of each of ours with the official package's
``find_key_token`` (run after the measurement, in the same child).

    python -m bench.lsd_vs_longppl                          # SmolLM2, 4K tokens, K=1024, d=512
    python -m bench.lsd_vs_longppl --lengths 4096 8192 --csv bench/results/lsd_vs_longppl.csv
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from bench.harness import (
    add_device_arguments,
    add_ratios,
    device_arguments,
    load,
    measure,
    report,
    run_children,
)

METHODS = ("official", "ours_official", "ours")
OFFICIAL = "longppl==0.3.0"


def essay_text(tokenizer, length: int, K: int, d: int) -> str:
    """About ``length`` tokens of essay text (:func:`probe.tasks.noise.essay_ids`), cut a few tokens
    short where needed to avoid the official code's crash on a 1-token last window."""
    from probe.tasks.noise import essay_ids

    (ids,) = essay_ids(tokenizer, length)
    for cut in range(length, length - 8, -1):
        text = tokenizer.decode(ids[:cut], skip_special_tokens=True)
        if (len(tokenizer(text).input_ids) - K) % d != 1:
            return text
    raise RuntimeError("no cut avoids a 1-token last window")


def official_module(target: Path):
    """The official package's ``longppl/longppl.py`` installed under ``target``, imported from its file
    (it imports no sibling of its package), so that nothing is added to the import path."""
    spec = importlib.util.spec_from_file_location("longppl_official", target / "longppl" / "longppl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_child(method: str, length: int, args: argparse.Namespace) -> dict:
    """Run one method once in this (fresh) process: seconds, peak MiB, n_key, key spans."""
    import torch

    import probe

    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, args.device, args.dtype)
    text = essay_text(tokenizer, length, args.K, args.d)
    if method != "ours":
        official = official_module(Path(args.official_path))
        compute_longppl, find_key_token = official.compute_longppl, official.find_key_token

    def run() -> dict:
        if method == "official":
            result = compute_longppl(
                text, model, model, tokenizer, tokenizer, trunc_len=args.K, sliding_window=args.d
            )
            n_key = result["n_key_token"] or 0
            return {
                "longppl": float(result["longppl"] or "nan"),
                "ppl": float(result["ppl"]),
                "n_key_tokens": n_key,
            }
        result = probe.longppl(text, model, tokenizer, K=args.K, d=args.d, official=method == "ours_official")
        return {
            "longppl": result.longppl,
            "ppl": result.ppl,
            "n_key_tokens": result.n_key_tokens,
            "spans": result.key_spans,
        }

    def warm_up() -> None:  # page in the weights and warm the kernels
        with torch.no_grad():
            model(input_ids=torch.ones(1, 64, dtype=torch.long), use_cache=False)

    stats, result = measure(run, warm_up, args.device)
    if method == "official":
        with torch.no_grad():
            spans = find_key_token(text, model, tokenizer, args.K, args.d)
        result["spans"] = [tuple(map(int, span)) for span in spans.tolist()]
    tokens = len(tokenizer(text).input_ids)
    return {"tokens": tokens, **stats, **result}


def key_characters(spans: list) -> set[int]:
    return {c for start, end in spans for c in range(start, end)}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--K", type=int, default=1024)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--csv", type=Path, default=None, help="also write the table here")
    add_device_arguments(parser)
    parser.add_argument("--official-path", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_run_child(args.child[0], int(args.child[1]), args)))
        return pd.DataFrame()

    with tempfile.TemporaryDirectory(prefix="longppl-official-") as target:
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, OFFICIAL]
        subprocess.run(pip, check=True)
        child_args = [
            "--model",
            args.model,
            "--K",
            str(args.K),
            "--d",
            str(args.d),
            "--threads",
            str(args.threads),
            *device_arguments(args),
        ]
        jobs = [(method, length) for length in args.lengths for method in args.methods]
        table = add_ratios(
            run_children(__spec__.name, [*child_args, "--official-path", target], jobs), "official"
        )
    official = table[table.method == "official"].set_index("length")
    reference = {length: key_characters(spans) for length, spans in official.spans.items()}
    table["n_key_spans"] = table.spans.map(len)
    table["key_chars"] = table.spans.map(lambda spans: len(key_characters(spans)))
    table["key_chars_jaccard"] = [
        len(key_characters(s) & reference[n]) / max(1, len(key_characters(s) | reference[n]))
        for s, n in zip(table.spans, table.length, strict=True)
    ]
    table["same_spans"] = [s == official.spans[n] for s, n in zip(table.spans, table.length, strict=True)]
    return report(table.drop(columns="spans"), args.csv)


if __name__ == "__main__":
    main()
