"""Peak memory of the context selector P = A^(L−1)…A^(0): streamed layer by layer vs stacking all layers.

Each (method, length) runs in its own child process with the peak-RSS reset of
``bench/harness.py`` (``/proc/self/clear_refs`` → ``VmHWM``), shared with ``bench/capture_memory.py``, on
the same essay text (:func:`probe.tasks.noise.essay_ids`), and computes the same thing: the
head-averaged context selector ``P^(L−1) = A^(L−1) … A^(0)`` over all layers (Wu et al. eq. 4).

- ``streamed``: ``probe.context_selector(model, ids, layers=[-1])`` — each layer's attention is
  handed over by the capture core and multiplied in place (O(heads·n²) for one layer + O(n²)).
- ``stacked``: every layer's Tensor[heads, n, n] from ``probe.attention_matrices`` is kept, then
  the product is taken with :func:`probe.probes.position_bias.multiply_in_place` (O(n_layers·heads·n²)).
- ``eager``: ``output_attentions=True`` under eager attention, how rollout code usually gets the
  matrices, then the same product.

    python -m bench.graph_product                    # SmolLM2-135M at 1K and 2K tokens
    python -m bench.graph_product --lengths 512 1024 --methods streamed stacked
"""

from __future__ import annotations

import functools

import pandas as pd

from bench.harness import bench_parser, load, measure, run_bench

METHODS = ("streamed", "stacked", "eager")


def _run_child(
    method: str, length: int, model_name: str, threads: int, device: str, dtype: str | None
) -> dict:
    """Compute the all-layer product once in this (fresh) process; return its time and peak memory."""
    import torch

    import probe
    from probe.probes.position_bias import multiply_in_place
    from probe.tasks.noise import essay_ids

    torch.set_num_threads(threads)
    model, tokenizer = load(model_name, device, dtype)
    ids = essay_ids(tokenizer, length)[0][None].to(device)

    def product(attentions) -> torch.Tensor:
        """``A^(L−1) … A^(0)`` of the head-averaged attentions, each Tensor[heads, n, n]: [n, n]."""
        result = torch.eye(length, dtype=torch.float64, device=device)
        for attention in attentions:
            multiply_in_place(result, attention.mean(0).double())
        return result

    def streamed():
        return probe.context_selector(model, ids, layers=[-1])[0]

    def stacked():
        layers = []  # every layer's Tensor[heads, n, n], kept (as a list: no extra copy for a stack)
        probe.attention_matrices(model, ids, on_layer=lambda _, pattern: layers.append(pattern))
        return product(layers)

    def eager():
        model.set_attn_implementation("eager")
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True, use_cache=False, logits_to_keep=1)
        return product(a[0] for a in out.attentions)

    def warm_up():
        with torch.no_grad():
            model(input_ids=ids[:, :64], use_cache=False)

    run = {"streamed": streamed, "stacked": stacked, "eager": eager}[method]
    stats, result = measure(run, warm_up, device)
    return {**stats, "mass_first_last_row": float(result[-1, 0])}  # the same number for every method


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = bench_parser(__doc__, METHODS, [1024, 2048])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    child = functools.partial(
        _run_child, model_name=args.model, threads=args.threads, device=args.device, dtype=args.dtype
    )
    return run_bench(args, __spec__.name, ["--threads", str(args.threads)], child, "streamed")


if __name__ == "__main__":
    main()
