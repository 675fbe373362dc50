"""What the fused kernels of the key bias save: the key-removal detectors on the CPU flash kernel against
sdpa's math kernel, in one process; on CUDA, the key-removal gradient on FlexAttention against a plain
forward and backward.

``key_removal_grad`` and ``key_removal_banzhaf`` (presence ½) take one forward and backward under a
key bias (:func:`probe.attention.modifiers.bias_keys`). On CPU the bias runs on the flash kernel
(:mod:`probe.attention.flash_key_bias`); the baseline here is the math kernel it ran on before (the
biased mask, every layer's ``[heads, n, n]`` attention kept for the backward, checkpointed where the
planner says so). Per model and length, on one sample (multihop-2, seed 0): each detector's seconds on
both kernels, their ratio, the ratio to ``information_flow`` (the one-pass goal's yardstick: ≤ 1.5×),
and the largest difference between the two kernels' source scores.

``--device cuda``: the key bias on FlexAttention, compiled (:mod:`probe.attention.flex_key_bias`), on a
random-weight bf16 model of Qwen2.5-0.5B's shape (``bench.harness.RANDOM_CONFIGS``; nothing is
downloaded; speed and memory do not depend on the weights) at 4K and 16K random tokens, the last 3 the
targets. Each (method, length) runs in its own child process (``bench/harness.py``): one run at the same
length first (it compiles; its seconds are ``warm_up_seconds``), then the timed run and its peak CUDA
memory above the loaded model, and both as ratios to ``forward_backward`` of the same invocation:

- ``forward_backward``: Σ log P(targets), backward to the input embeddings, parameters frozen, no
  checkpointing (the baseline);
- ``key_removal_flex``: :func:`probe.probes.key_removal.key_removal_gradient`, ``checkpoint=False``,
  every layer on FlexAttention (``flex_calls`` counts the layer calls of the timed run);
- ``key_removal_math`` (only when named in ``--methods``): the same on sdpa's math kernel (the biased
  mask, as before FlexAttention; ``checkpoint="auto"``, as the detectors run it).

Without CUDA ``--device cuda`` exits with a message and measures nothing.

    python -m bench.key_bias_kernel --csv bench/results/key_bias_kernel.csv
    python -m bench.key_bias_kernel --device cuda --csv bench/results/key_bias_kernel_gpu.csv
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time
from pathlib import Path
from unittest import mock

import pandas as pd
import torch

from bench.harness import add_ratios, load, measure, report, run_children
from probe import attention, detectors, tasks
from probe.atomic import atomic_write
from probe.attention import modifiers

DETECTORS = {
    "information_flow": ("information_flow", {}),
    "key_removal_grad": ("key_removal_grad", {}),
    "key_removal_banzhaf": ("key_removal_banzhaf", {}),
}
GPU_METHODS = ("forward_backward", "key_removal_flex", "key_removal_math")
DEFAULTS = {  # models and lengths: on the CPU, on CUDA
    "cpu": (["smollm2-135m", "gemma3-270m"], [1024, 4096]),
    "cuda": (["qwen2.5-0.5b"], [4096, 16384]),
}


def math_kernel():
    """The baseline: every key bias on the biased mask (sdpa's math kernel), planned as such."""
    never = mock.patch.object(attention, "fused_key_bias", lambda *args: None)
    planned = mock.patch.object(modifiers, "fused_key_bias", lambda *args: None)
    return never, planned


def timed(model, tokenizer, sample, name: str) -> tuple[float, torch.Tensor]:
    detector, options = DETECTORS[name]
    start = time.perf_counter()
    found = detectors.detect(detector, model, tokenizer, sample, **options)
    return time.perf_counter() - start, found.source_scores(sample)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="+", default=None, help="default: see the description")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="default: see the description")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu (the flash kernel) or cuda (FlexAttention)")
    parser.add_argument("--methods", nargs="+", choices=GPU_METHODS, default=list(GPU_METHODS[:2]))
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    kind = torch.device(args.device).type
    if kind not in DEFAULTS:
        parser.error(f"--device {args.device}: use cpu or cuda")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"bench.key_bias_kernel --device {args.device}: no CUDA device on this machine; the key bias on "
            "FlexAttention is measured on a GPU only. Nothing was measured."
        )
    models, lengths = DEFAULTS[kind]
    args.models, args.lengths = args.models or models, args.lengths or lengths
    if args.child:
        print(json.dumps(gpu_child(args.models[0], args.child[0], int(args.child[1]), args.device)))
        return pd.DataFrame()
    if kind == "cuda":
        return on_gpu(args)
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


def on_gpu(args: argparse.Namespace) -> pd.DataFrame:
    """Every (model, method, length) in its own child process; ratios to ``forward_backward``."""
    tables = []
    for name in args.models:
        jobs = [(method, length) for length in args.lengths for method in args.methods]
        table = run_children("bench.key_bias_kernel", ["--device", args.device, "--models", name], jobs)
        if "forward_backward" in args.methods:
            table = add_ratios(table, "forward_backward")
        tables.append(table.assign(model=name))
    return report(pd.concat(tables, ignore_index=True), args.csv)


def gpu_child(name: str, method: str, length: int, device: str) -> dict:
    """Run ``method`` once at ``length`` tokens in this (fresh) process, after one warm-up run of the
    same; return its seconds, peak memory and warm-up seconds (and FlexAttention's layer calls)."""
    from probe.attention.shared_state import frozen_parameters
    from probe.probes.key_removal import key_removal_gradient
    from probe.target import target_of

    model, _ = load(name, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=generator).to(device)
    targets = list(range(length - 3, length))

    def forward_backward():
        with frozen_parameters(model):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            found = target_of(model, ids, torch.tensor(targets, device=device), inputs_embeds=embeds)
            return torch.autograd.grad(found, embeds)

    def key_removal(checkpoint: bool | str):
        return lambda: key_removal_gradient(model, ids, targets, checkpoint=checkpoint)

    run = {
        "forward_backward": forward_backward,
        "key_removal_flex": key_removal(False),
        "key_removal_math": key_removal("auto"),
    }[method]
    warm = {}
    flex = mock.patch.object(
        attention, "key_biased_flex_attention", wraps=attention.key_biased_flex_attention
    )
    baseline = math_kernel() if method == "key_removal_math" else (contextlib.nullcontext(),) * 2
    with baseline[0], baseline[1], flex as calls:

        def warm_up():  # compiles FlexAttention at this length
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            warm["seconds"] = time.perf_counter() - start
            calls.reset_mock()

        stats = measure(run, warm_up, device)[0]
    return {**stats, "warm_up_seconds": warm["seconds"], "flex_calls": calls.call_count, "device": device}


if __name__ == "__main__":
    main()
