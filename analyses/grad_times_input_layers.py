"""Why ``grad_times_input`` is anti-correlated with removal: gradient × hidden state layer by layer.

``grad_times_input`` scores token i by e_i · ∂ log P(answer)/∂e_i. By Euler's theorem that is
d log P(c·e_i)/dc at c = 1: what the answer does when token i's *raw embedding* gets louder. Every
read of the residual stream goes through an RMSNorm, blind to the stream's scale, so a louder raw
embedding only shifts the balance between it and what the layers have added to token i's stream
(RESULTS.md, the held-out study). The hypothesis predicts that the same product taken deeper, on the
hidden state h_i^ℓ entering layer ℓ (h · ∂ log P/∂h = d log P(c·h_i^ℓ)/dc: token i's whole *contextual*
state louder), turns from negative to positive agreement with removal as the layers build the
token's features; a sign or definition error would not depend on the layer. Beside it, the unsigned
‖h ⊙ ∂ log P/∂h‖₂ (inseq's ``input_x_gradient``, which ranked sources well in the peers' first check).

Per sample: one forward+backward with every layer's input kept (``output_hidden_states``), each
source's Σ over its tokens of h·∂ log P/∂h per layer (layer 0 is ``grad_times_input`` itself, checked
against the detector to 1e-4), and exhaustive leave-one-out (one compacted pass per source). Per
layer: the Spearman correlation with leave-one-out over sources, its mean over samples with a 95 %
bootstrap interval. New seeds (20000 on), tasks no detector was tuned on; one thread.

    python -m analyses.grad_times_input_layers --tasks multihop-2 document-2 --seeds 20000 20001 ...
"""

from __future__ import annotations

import pandas as pd
import torch
from scipy.stats import spearmanr

import probe
from bench.harness import intervals, new_seed_samples, report
from probe import tasks
from probe.attention.shared_state import frozen_parameters
from probe.probes.position_bias import attention_modules
from probe.target import target_loss


def layer_products(model, sample: tasks.Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed, norm), each Tensor[layers, seq]: h_i^ℓ · ∂ log P(answer)/∂h_i^ℓ and ‖h_i^ℓ ⊙ ∂ log
    P/∂h_i^ℓ‖₂ (inseq's input × gradient, unsigned) for the input h^ℓ of every decoder layer ℓ (ℓ = 0:
    the input embeddings as the first layer reads them), read with forward pre-hooks that are removed
    afterwards."""
    ids, targets = sample.input_ids[None], sample.target_positions
    inputs = []

    def keep(_, args, kwargs):
        state = (args or (kwargs["hidden_states"],))[0]
        state.retain_grad()
        inputs.append(state)

    hooks = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer, _ in attention_modules(model)]
    try:
        with frozen_parameters(model):
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
            loss = target_loss(model, ids, targets, inputs_embeds=embeds)
            (-len(targets) * loss).backward()  # target_loss is −log P / k
    finally:
        for hook in hooks:
            hook.remove()
    products = torch.stack([(state * state.grad)[0].detach() for state in inputs])  # [layers, seq, d]
    return products.sum(-1), products.norm(dim=-1)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    args, model, tokenizer, samples = new_seed_samples(__doc__, argv)
    rows = []
    for task, seed, sample in samples:
        signed, norm = layer_products(model, sample)
        detector = probe.detect("grad_times_input", model, tokenizer, sample).scores
        gap = float((signed[0] - detector).abs().max() / detector.abs().max())
        if gap > 1e-4:
            raise AssertionError(f"layer 0 is not grad_times_input ({gap:.1e} apart, relative)")
        removal = probe.detect("leave_one_out", model, tokenizer, sample, top_m=None).source_scores(sample)
        for kind, values in (("signed", signed), ("norm", norm)):
            for layer, per_token in enumerate(values):
                per_source = torch.stack([per_token[s.start : s.end].sum() for s in sample.sources])
                rho = spearmanr(per_source.numpy(), removal.numpy()).statistic
                rows.append(
                    {"task": task, "seed": seed, "product": kind, "layer": layer, "spearman_vs_loo": rho}
                )
        print(
            task,
            seed,
            [round(float(r["spearman_vs_loo"]), 2) for r in rows[-2 * len(signed) :]],
            flush=True,
        )
    table = pd.DataFrame(rows)
    print(intervals(table, ["product", "layer"], ["spearman_vs_loo"]).round(3).to_string(index=False))
    return report(table, args.csv)


if __name__ == "__main__":
    main()
