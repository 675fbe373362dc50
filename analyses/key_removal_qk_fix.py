"""Does the AtP* "QK fix" bring the key-removal gradient closer to exact leave-one-out?

``key_removal_grad`` is ∂ log P/∂b_j at b = 0 for a bias b_j on key j's attention logit: summed over
the (layer, head, query i > j) entries, ∂L/∂s_ij. Removing key j from query i's softmax changes its
output exactly by −(∂L/∂s_ij)/(1 − a_ij) to first order in that output (the other weights are
renormalized); removing a whole source S by −Σ_{j∈S} ∂L/∂s_ij / (1 − a_iS), a_iS the source's
attention mass. AtP* (Kramár et al. 2024, arXiv 2403.00745, §3.1) computes the attention change
exactly and linearizes only the rest of the network. This benchmark weights each entry that way:

- ``krg``: the library's key-removal gradient (weight 1);
- ``qk_fix_token``: weight 1/(1 − a_ij), each token removed alone;
- ``qk_fix_source``: weight 1/(1 − a_iS), the source removed as one;
- ``no_intra_source``: weight 1, without the pairs inside one source (rows a removal deletes); the
  library has it as ``key_removal_banzhaf(presence=1)``, which the script checks it equals.

The weighted gradient is taken through an output modifier that adds Σ_j b_j·w_ij·a_ij·(v_j − o_i) to
each attention output at b = 0 (its gradient in b_j is Σ_i w_ij·∂L/∂s_ij); with w = 1 it must equal
``key_removal_grad``, which the script checks on every sample.

The default samples are the main job's (SmolLM2-135M, multihop-1 and multihop-2 at 1K tokens, seeds
0–11) with its 32 random half masks, so ``krg``'s LDS equals the main job's ``key_removal_grad``
column; ``--model``, ``--tasks``, ``--length`` and ``--seeds`` choose held-out ones. One thread; about
100 s a sample on the 2-core machine.

    python -m analyses.key_removal_qk_fix --csv bench/results/key_removal_qk_fix.csv
    python -m analyses.key_removal_qk_fix --tasks multihop-3 --seeds 0 1 2 3 4 5 6 7 \
        --csv bench/results/key_removal_qk_fix_multihop3.csv
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch

from bench.harness import load, samples_parser
from probe import faithfulness, tasks
from probe.atomic import atomic_write
from probe.attention import OUTPUTS, LayerCall, Modifier, modify
from probe.attention.patterns import apply_pattern, mask_rows
from probe.attention.shared_state import frozen_parameters
from probe.probes.key_removal import key_removal_gradient
from probe.stats import bootstrap
from probe.target import target_of

VARIANTS = {
    "qk_fix_token": {"weighted": True, "by_source": False, "intra_source": True},
    "qk_fix_source": {"weighted": True, "by_source": True, "intra_source": True},
    "no_intra_source": {"weighted": False, "by_source": True, "intra_source": False},
    "unweighted": {"weighted": False, "by_source": False, "intra_source": True},  # must equal krg
}


@dataclass(eq=False)
class WeightedKeyRemoval(Modifier):
    """Adds Σ_j bias_j·w_ij·a_ij·(v_j − o_i) to every attention output (zero at bias = 0).

    ``groups``: LongTensor[seq], the removal unit of each token (a source, or the token alone);
    ``weighted``: w_ij = 1/(1 − a_i,group(j)), else 1; ``intra_source``: keep the pairs i > j of one
    group.
    """

    changes = frozenset({OUTPUTS})
    bias: torch.Tensor  # [seq], zero, requires grad
    groups: torch.Tensor  # [seq]
    weighted: bool
    intra_source: bool

    def outputs(self, output: torch.Tensor, call: LayerCall) -> torch.Tensor:
        query, key = call.query, call.key
        seq = query.shape[2]
        rows = torch.arange(seq, device=query.device)
        with torch.no_grad():
            mask = mask_rows(
                call.attention_mask, rows, seq, key.shape[2], call.logits.sliding_window, torch.float32
            )
            pattern = call.logits.pattern(query, key, rows, mask).float()  # [batch, heads, q, kv]
            pairs = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril(-1)
            if not self.intra_source:
                pairs &= self.groups[:, None] != self.groups[None, :]
            weight = pattern * pairs
            if self.weighted:
                members = torch.nn.functional.one_hot(self.groups).float()  # [seq, groups]
                mass = pattern @ members @ members.T  # a_i,group(j): [batch, heads, q, kv]
                weight = weight / (1 - mass).clamp_min(1e-4)
        scaled = weight * self.bias
        change = (
            apply_pattern(scaled, call.value.detach())
            - scaled.sum(-1).transpose(1, 2)[..., None] * output.detach()
        )
        return output + change.to(output.dtype)


def weighted_gradient(model, sample: tasks.Sample, weighted: bool, by_source: bool, intra_source: bool):
    """Σ_i w_ij·∂ log P(answer)/∂s_ij over layers, heads and later queries: Tensor[seq]."""
    seq = len(sample.input_ids)
    groups = torch.arange(seq)
    if by_source:
        for index, source in enumerate(sample.sources):
            groups[source.start : source.end] = seq + index
    groups = torch.unique(groups, return_inverse=True)[1]
    bias = torch.zeros(seq, requires_grad=True)
    with modify(model, WeightedKeyRemoval(bias, groups, weighted, intra_source)), frozen_parameters(model):
        with torch.enable_grad():
            (gradient,) = torch.autograd.grad(
                target_of(model, sample.input_ids[None], sample.target_positions), bias
            )
    return gradient


def main(argv: list[str] | None = None) -> pd.DataFrame:
    parser = samples_parser(__doc__)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load(args.model, args.device, args.dtype)
    rows = []
    for task in args.tasks:
        for seed in args.seeds:
            start = time.perf_counter()
            sample = tasks.make(task, tokenizer, args.length, seed=seed)
            krg = key_removal_gradient(model, sample.input_ids, sample.target_positions)
            tokens = {"krg": krg} | {
                name: weighted_gradient(model, sample, **options).cpu() for name, options in VARIANTS.items()
            }
            spans = [(source.start, source.end) for source in sample.sources]
            by_source = key_removal_gradient(model, sample.input_ids, sample.target_positions, sources=spans)
            for name, reference in {"unweighted": krg, "no_intra_source": by_source}.items():
                gap = float((tokens[name] - reference).abs().max() / reference.abs().max())
                if gap > 1e-4:
                    raise AssertionError(f"{name} differs from its key_removal_gradient by {gap:.2e}")
            del tokens["unweighted"]
            scores = {
                name: faithfulness.source_scores(score, sample.sources, "sum")
                for name, score in tokens.items()
            }
            frame = faithfulness.evaluate(model, sample, scores, faithfulness.Judgement(ks=[1], n_masks=32))
            rows.append(
                frame[["scorer", "lds"]].assign(model=args.model, length=args.length, task=task, seed=seed)
            )
            print(rows[-1].to_string(index=False), f"{time.perf_counter() - start:.0f} s", flush=True)
    table = pd.concat(rows, ignore_index=True)
    if args.csv:
        atomic_write(args.csv, lambda tmp: table.to_csv(tmp, index=False))
    wide = table.pivot_table(index=["task", "seed"], columns="scorer", values="lds")
    for name in wide.columns:
        print(f"{name}: LDS {bootstrap(wide[name])}; − krg {bootstrap(wide[name] - wide['krg'])}")
    return table


if __name__ == "__main__":
    main()
