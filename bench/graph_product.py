"""Peak memory of the context selector P = A^(L−1)…A^(0): streamed layer by layer vs stacking all layers.

Each (method, length) runs in its own child process with the peak-RSS reset of
``bench/capture_memory.py`` (``/proc/self/clear_refs`` → ``VmHWM``, helpers imported from there), on
the same essay text, and computes the same thing: the head-averaged product over all layers.

- ``streamed``: ``probe.context_selector(model, ids, depths=[L − 1])`` — each layer's attention is
  handed over by the capture core and multiplied in place (O(heads·n²) for one layer + O(n²)).
- ``stacked``: ``probe.attention_matrices`` keeps every layer's Tensor[heads, n, n], then the
  product is taken (O(layers·heads·n²)).
- ``eager``: ``output_attentions=True`` under eager attention, how rollout code usually gets the
  matrices, then the same product.

    python bench/graph_product.py                    # SmolLM2-135M at 1K and 2K tokens
    python bench/graph_product.py --lengths 512 1024 --methods streamed stacked
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
from capture_memory import _rss_mib

METHODS = ("streamed", "stacked", "eager")


def _run_child(method: str, length: int, model_name: str, threads: int) -> dict:
    """Compute the all-layer product once in this (fresh) process; return its time and peak memory."""
    import torch

    import probe
    from probe.tasks.noise import sentences

    torch.set_num_threads(threads)
    model, tokenizer = probe.load_model(model_name)
    ids = tokenizer(" ".join(sentences()), return_tensors="pt").input_ids[:, :length]
    last = model.config.num_hidden_layers - 1

    def product(attentions) -> torch.Tensor:
        result = torch.eye(length, dtype=torch.float64)
        for attention in attentions:
            result = attention.mean(0).double() @ result
        return result

    def streamed():
        return probe.context_selector(model, ids, depths=[last])[0]

    def stacked():
        return product(probe.attention_matrices(model, ids))

    def eager():
        model.set_attn_implementation("eager")
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, use_cache=False, logits_to_keep=1)
        return product(a[0] for a in out.attentions)

    run = {"streamed": streamed, "stacked": stacked, "eager": eager}[method]
    with torch.no_grad():  # page in the (memory-mapped) weights and warm the kernels
        model(input_ids=ids[:, :64], use_cache=False)
    loaded = _rss_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    peak = _rss_mib("VmHWM") - loaded
    return {"seconds": seconds, "peak_mib": peak, "mass_first_last_row": float(result[-1, 0])}


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--csv", type=Path, default=None, help="also write the table here")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = _run_child(args.child[0], int(args.child[1]), args.model, args.threads)
        print(json.dumps(result))
        return pd.DataFrame([result])

    rows = []
    for length in args.lengths:
        for method in args.methods:
            command = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads)]
            done = subprocess.run(
                [*command, "--child", method, str(length)], capture_output=True, text=True, check=True
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"length": length, "method": method, **result})
            print(
                f"{length:>6} {method:<9} {result['seconds']:8.1f} s {result['peak_mib']:9.0f} MiB",
                flush=True,
            )
    table = pd.DataFrame(rows)
    if "streamed" in args.methods:
        streamed = table[table.method == "streamed"].set_index("length")
        table["memory_vs_streamed"] = table.peak_mib / table.length.map(streamed.peak_mib)
        table["time_vs_streamed"] = table.seconds / table.length.map(streamed.seconds)
    print(table.round(3).to_string(index=False))
    if args.csv:
        tmp = args.csv.with_suffix(".tmp")
        table.to_csv(tmp, index=False)
        tmp.replace(args.csv)
    return table


if __name__ == "__main__":
    main()
