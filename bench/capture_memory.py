"""Peak memory and time of ``information_flow`` against a plain forward+backward and the naive eager way.

Each (method, length) runs in its own child process, so every peak is clean: the child loads
the model, resets the kernel's peak-RSS counter (``/proc/self/clear_refs``), runs the method
once (after a short warm-up forward that pages in the weights) and reports wall time and
the peak RSS above the loaded model. All methods use the same
real text (Paul Graham essays, :func:`probe.tasks.noise.essay_ids`) and the same loss: mean
cross-entropy of the last ``--targets`` tokens.

- ``plain``: sdpa forward + backward to the input embeddings, parameters frozen — the cost
  of any gradient-based attribution (what ``embedding_grad_norms`` does).
- ``information_flow``: ``probe.information_flow`` over all layers.
- ``naive``: eager attention with ``output_attentions=True`` and ``retain_grad`` on every
  layer's attention, then Σ_h A⊙∂L/∂A — how the reference code computes the IG score.

    python -m bench.capture_memory                      # 1K and 2K, all three methods
    python -m bench.capture_memory --lengths 8192 --methods plain information_flow
"""

from __future__ import annotations

import functools

import pandas as pd

from bench.harness import bench_parser, load, measure, run_bench

METHODS = ("plain", "information_flow", "naive")


def _run_child(
    method: str, length: int, n_targets: int, model_name: str, device: str, dtype: str | None
) -> dict:
    """Run one method once in this (fresh) process; return its time and peak memory."""
    import torch

    import probe
    from probe.attention.shared_state import frozen_parameters
    from probe.target import target_loss
    from probe.tasks.noise import essay_ids

    torch.set_num_threads(2)
    model, tokenizer = load(model_name, device, dtype)
    ids = essay_ids(tokenizer, length)[0][None].to(device)
    targets = torch.arange(length - n_targets, length, device=device)

    def plain():
        with frozen_parameters(model):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            target_loss(model, ids, targets, inputs_embeds=embeds).backward()

    def information_flow():
        probe.information_flow(model, ids, targets)

    def naive():
        model.set_attn_implementation("eager")
        with frozen_parameters(model):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            out = model(inputs_embeds=embeds, output_attentions=True, use_cache=False)
            for attention in out.attentions:
                attention.retain_grad()
            logits = out.logits[0, targets - 1]
            torch.nn.functional.cross_entropy(logits, ids[0, targets]).backward()
            flow = torch.stack([(a * a.grad)[0].sum(0)[targets - 1].abs().sum(0) for a in out.attentions])
        assert flow.shape == (model.config.num_hidden_layers, length)

    def warm_up():
        with torch.no_grad():
            model(input_ids=ids[:, :64], use_cache=False)

    run = {"plain": plain, "information_flow": information_flow, "naive": naive}[method]
    return measure(run, warm_up, device)[0]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = bench_parser(__doc__, METHODS, [1024, 2048])
    parser.add_argument("--targets", type=int, default=16, help="loss on the last N tokens")
    args = parser.parse_args(argv)
    child = functools.partial(
        _run_child, n_targets=args.targets, model_name=args.model, device=args.device, dtype=args.dtype
    )
    return run_bench(args, __spec__.name, ["--targets", str(args.targets)], child, "plain")


if __name__ == "__main__":
    main()
