"""Long context: peak memory and time of ``information_flow`` at a model's full context, against a plain
forward at the same length, with and without activation checkpointing.

Each (model, method, length) runs in its own child process (``bench/harness.py``) on essay text
(:func:`probe.tasks.noise.essay_ids`), all layers captured, the last ``--targets`` tokens as targets.
The planner's prediction for the same call (:func:`probe.plan`) is printed beside each row.

- ``forward``: a no-grad forward (``logits_to_keep=1``) — the baseline of the ratios;
- ``forward_backward``: forward + backward to the input embeddings, parameters frozen, decoder layers
  checkpointed (what any gradient attribution costs at this length; the GPU baseline);
- ``information_flow``: :func:`probe.information_flow`, ``checkpoint=False``;
- ``information_flow_checkpointed``: the same with ``checkpoint=True``;
- ``longppl`` / ``longppl_official`` (``--device cuda``): the evaluator pass of LongPPL's key-token
  search (LSD and LCL of every token, K = 4096, d = 1024) by :func:`probe.probes.lsd.lsd_scores` (short
  windows
  batched) and by the official ``longppl`` package's ``find_key_token`` (one window at a time, full
  logits), throughput in tokens per second.

CPU (the default; real weights, fp32): Gemma 3 270M at 8K, 16K and 32K (its full context) with
checkpointing, SmolLM2-135M at 8K with and without. ``--device cuda``: random-weight bf16 models with
the shapes of Llama-3-8B and Qwen2.5-7B (speed and memory do not depend on the weights; nothing is
downloaded) at 32K, 64K and 128K, peak memory from ``torch.cuda.max_memory_allocated``; the LongPPL rows
need ``pip install longppl==0.3.0`` and ``--tokenizer`` (a folder with any tokenizer whose ids fit the
vocabulary, e.g. SmolLM2's, copied from ``~/.cache/longprobe/models``).

    python -m bench.long_context --csv bench/results/long_context_cpu.csv
    python -m bench.long_context --device cuda --tokenizer tok/ --csv bench/results/long_context_gpu.csv
"""

from __future__ import annotations

import functools
import json

import pandas as pd

from bench.harness import add_ratios, bench_parser, device_arguments, load, measure, report, run_children

METHODS = (
    "forward",
    "forward_backward",
    "information_flow",
    "information_flow_checkpointed",
    "longppl",
    "longppl_official",
)
CPU_JOBS = {
    "gemma3-270m": [
        (m, n) for n in (32768, 16384, 8192) for m in ("forward", "information_flow_checkpointed")
    ],
    "smollm2-135m": [("forward", 8192), ("information_flow", 8192), ("information_flow_checkpointed", 8192)],
}
GPU_LENGTHS = (32768, 65536, 131072)
GPU_JOBS = {
    name: [
        *[
            (m, n)
            for n in GPU_LENGTHS
            for m in ("forward", "forward_backward", "information_flow_checkpointed")
        ],
        ("longppl", 32768),
        ("longppl_official", 32768),
    ]
    for name in ("llama-3-8b", "qwen2.5-7b")
}


def _ids(tokenizer, length: int, vocab: int):
    """Essay text of ``length`` tokens; random ids where there is no tokenizer (GPU, random model)."""
    import torch

    from probe.tasks.noise import essay_ids

    if tokenizer is None:
        return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    return essay_ids(tokenizer, length)[0][None]


def _run_child(
    method: str,
    length: int,
    model_name: str,
    device: str,
    dtype: str | None,
    n_targets: int,
    tokenizer_folder: str | None,
) -> dict:
    """Run one method once in this (fresh) process; return time, peak memory and the planner's figure."""
    import torch

    import probe
    from probe.attention.shared_state import frozen_parameters
    from probe.target import target_loss

    torch.set_num_threads(2)
    model, tokenizer = load(model_name, device, dtype, tokenizer_folder)
    ids = _ids(tokenizer, length, model.config.vocab_size).to(device)
    targets = torch.arange(length - n_targets, length, device=device)

    def forward():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    def forward_backward():
        with frozen_parameters(model), probe.checkpointed(model):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            target_loss(model, ids, targets, inputs_embeds=embeds).backward()

    def information_flow(checkpoint: bool):
        return lambda: probe.information_flow(model, ids, targets, checkpoint=checkpoint)

    def longppl():
        probe.probes.lsd.lsd_scores(model, ids, K=4096, d=1024, official=True)

    def longppl_official():
        from longppl.longppl import find_key_token

        find_key_token(tokenizer.decode(ids[0]), model, tokenizer, trunc_len=4096, sliding_window=1024)

    run = {
        "forward": forward,
        "forward_backward": forward_backward,
        "information_flow": information_flow(False),
        "information_flow_checkpointed": information_flow(True),
        "longppl": longppl,
        "longppl_official": longppl_official,
    }[method]

    def warm_up():
        with torch.no_grad():
            model(input_ids=ids[:, :64], use_cache=False)

    predicted = None
    if method.startswith("information_flow"):
        checkpoint = method.endswith("checkpointed")
        predicted = probe.plan(model, length, "information_flow", rows=n_targets, checkpoint=checkpoint).total
    stats = measure(run, warm_up, device)[0]
    if method.startswith("longppl"):
        stats["tokens_per_s"] = length / stats["seconds"]
    return {**stats, "predicted_mib": None if predicted is None else predicted / 2**20, "device": device}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = bench_parser(__doc__, METHODS, [])
    parser.add_argument("--models", nargs="+", default=None, help="default: the issue's set for --device")
    parser.add_argument("--targets", type=int, default=16, help="loss on the last N tokens")
    args = parser.parse_args(argv)
    if args.child:
        child = functools.partial(
            _run_child,
            model_name=args.model,
            device=args.device,
            dtype=args.dtype,
            n_targets=args.targets,
            tokenizer_folder=args.tokenizer,
        )
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return pd.DataFrame()
    plans = GPU_JOBS if args.device.startswith("cuda") else CPU_JOBS
    tables = []
    for model in args.models or list(plans):
        jobs = [
            (method, length)
            for method, length in plans.get(model, [(m, n) for n in args.lengths for m in args.methods])
            if method in args.methods and (not args.lengths or length in args.lengths)
        ]
        if args.tokenizer is None:
            jobs = [(method, length) for method, length in jobs if not method.startswith("longppl")]
        forwarded = ["--model", model, *device_arguments(args), "--targets", str(args.targets)]
        table = run_children(__spec__.name, forwarded, jobs)
        table = add_ratios(table, "forward")
        if "forward_backward" in set(table.method):  # GPU: the baseline for the probe
            table = add_ratios(table, "forward_backward")
        tables.append(table.assign(model=model))
        table = pd.concat(tables, ignore_index=True)
        first = ["model", "device", "length", "method", "seconds", "peak_mib", "predicted_mib"]
        table = report(
            table[first + [c for c in table.columns if c not in first]], args.csv
        )  # after each model
    return table


if __name__ == "__main__":
    main()
