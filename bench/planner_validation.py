"""The memory planner's predicted peak against the measured one: ``information_flow`` with and without
checkpointing, and the key-bias pass of ``key_removal_banzhaf``, on the real models, at growing lengths.

Each (model, method, length) runs in its own child process (the shared harness): the child loads the
model, warms it up, resets the kernel's peak-RSS counter and runs ``probe.information_flow`` once —
all layers, the last ``--targets`` tokens as targets, essay text (:func:`probe.tasks.noise.essay_ids`)
— and reports the peak RSS above the warmed-up model beside :func:`probe.memory.planner.plan`'s prediction
for the same call (computed before the run, from the model's shapes only). ``ratio`` is measured /
predicted; ``tensors_mib`` is the prediction without its ``allocator`` term (the bytes of live tensors;
the rest is glibc heap slack, see :mod:`probe.memory.planner`). ``load`` is the 1-minute load average seen
by the child just before its run (the machine has 2 cores).

- ``plain``: ``probe.information_flow(model, ids, targets)``.
- ``checkpointed``: the same call inside ``probe.memory.checkpointing.checkpointed(model)``.
- ``key_bias``: ``probe.probes.key_removal.key_removal_gradient`` checkpointed at presence ½ over sources of
  64 tokens (the pass of ``key_removal_banzhaf``: the key bias on the CPU flash kernel, its masks
  under the planner's ``key_bias`` term), predicted with the same bias active.

    python -m bench.planner_validation --csv bench/results/planner_validation.csv
    python -m bench.planner_validation --models smollm2-135m --lengths 1024 2048   # quick
    python -m bench.planner_validation --measured a.csv b.csv --csv out.csv   # re-predict, no re-run

``--measured`` takes the measured peaks of earlier runs (this script's CSVs, or
``bench/long_context.py``'s ``information_flow`` rows) and sets the current planner's prediction
beside each, without running anything: after a change to the planner, the same measurements
validate it again.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pandas as pd

from bench.harness import bench_parser, device_arguments, load, measure, report, run_children

METHODS = ("plain", "checkpointed", "key_bias")
SOURCE_TOKENS = 64  # tokens per source of the key_bias method
MODELS = ("smollm2-135m", "gemma3-270m")


def prediction(model, method: str, length: int, n_targets: int):
    """The planner's :class:`probe.memory.planner.Plan` for ``method`` on ``model`` (a model or its
    config)."""
    import torch

    from probe.attention.modifiers import KeyBias
    from probe.memory.planner import plan

    if method == "key_bias":
        bias = KeyBias(torch.zeros(1, length, requires_grad=True))
        return plan(model, length, "embedding_grads", n_targets, checkpoint=True, modifiers=[bias])
    return plan(model, length, "information_flow", rows=n_targets, checkpoint=method == "checkpointed")


def _run_child(
    method: str, length: int, n_targets: int, model_name: str, threads: int, device: str, dtype: str | None
) -> dict:
    """Run ``information_flow`` once in this (fresh) process; return measured and predicted peaks."""
    import torch

    import probe
    from probe.memory.checkpointing import checkpointed
    from probe.probes.key_removal import key_removal_gradient
    from probe.tasks.noise import essay_ids

    torch.set_num_threads(threads)
    model, tokenizer = load(model_name, device, dtype)
    ids = essay_ids(tokenizer, length)[0][None].to(device)
    targets = torch.arange(length - n_targets, length, device=device)
    predicted = prediction(model, method, length, n_targets)

    def run():
        if method == "key_bias":
            starts = range(0, length - n_targets - SOURCE_TOKENS, SOURCE_TOKENS)
            sources = [(start, start + SOURCE_TOKENS) for start in starts]
            key_removal_gradient(model, ids, targets, checkpoint=True, sources=sources, presence=0.5)
            return
        with checkpointed(model, enabled=method == "checkpointed"):
            probe.information_flow(model, ids, targets)

    def warm_up():
        with torch.no_grad():
            model(input_ids=ids[:, :64], use_cache=False)

    system_load = os.getloadavg()[0]
    measured = measure(run, warm_up, device)[0]
    return {
        **measured,
        "predicted_mib": predicted.total / 2**20,
        "tensors_mib": (predicted.total - predicted.terms["allocator"]) / 2**20,
        "phase": predicted.phase,
        "load": system_load,
        **{f"{name}_mib": value / 2**20 for name, value in predicted.terms.items()},
    }


SAME = {"information_flow": "plain", "information_flow_checkpointed": "checkpointed"}  # long_context.py


def repredict(paths: list, n_targets: int) -> pd.DataFrame:
    """The measured ``peak_mib`` of earlier runs beside the current planner's prediction (from each
    model's config alone; nothing is loaded or run)."""
    from transformers import AutoConfig

    from probe.models import converted_folder

    measured = pd.concat(
        [pd.read_csv(path).assign(source=Path(path).name) for path in paths], ignore_index=True
    )
    measured = measured.assign(method=measured.method.replace(SAME))
    measured = measured[measured.method.isin(METHODS)]
    configs = {name: AutoConfig.from_pretrained(converted_folder(name)) for name in measured.model.unique()}
    rows = []
    for row in measured.itertuples():
        predicted = prediction(configs[row.model], row.method, int(row.length), n_targets)
        rows.append({
            "model": row.model, "length": int(row.length), "method": row.method, "peak_mib": row.peak_mib,
            "predicted_mib": predicted.total / 2**20,
            "tensors_mib": (predicted.total - predicted.terms["allocator"]) / 2**20, "source": row.source,
        })  # fmt: skip
    return pd.DataFrame(rows).sort_values(["model", "length", "method"], ignore_index=True)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = bench_parser(__doc__, METHODS, [1024, 2048, 4096, 8192])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--targets", type=int, default=16, help="loss on the last N tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    parser.add_argument(
        "--measured", nargs="+", type=Path, help="re-predict these measured CSVs; run nothing"
    )
    args = parser.parse_args(argv)
    if args.measured:
        table = repredict(args.measured, args.targets)
        table = table.assign(ratio=table.peak_mib / table.predicted_mib)
        return report(table.assign(within_15pct=(table.ratio - 1).abs() <= 0.15), args.csv)
    if args.child:
        child = functools.partial(
            _run_child,
            n_targets=args.targets,
            model_name=args.model,
            threads=args.threads,
            device=args.device,
            dtype=args.dtype,
        )
        import json

        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return pd.DataFrame()
    tables = []
    for model in args.models:
        jobs = [(method, length) for length in args.lengths for method in args.methods]
        forwarded = ["--model", model, *device_arguments(args), "--targets", str(args.targets)]
        forwarded += ["--threads", str(args.threads)]
        table = run_children(__spec__.name, forwarded, jobs)
        tables.append(table.assign(model=model))
    table = pd.concat(tables, ignore_index=True)
    table = table.assign(ratio=table.peak_mib / table.predicted_mib)
    table = table.assign(within_15pct=(table.ratio - 1).abs() <= 0.15)
    first = ["model", "length", "method", "peak_mib", "predicted_mib", "ratio", "within_15pct", "tensors_mib"]
    table = table[first + [c for c in table.columns if c not in first]]
    return report(table, args.csv)


if __name__ == "__main__":
    main()
