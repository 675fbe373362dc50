"""Slow, obvious references: eager attention with ``output_attentions`` and ``retain_grad``."""

from __future__ import annotations

import torch


def eager_forward(model, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
    """Eager forward: (all-layer attentions [L, H, S, S], loss or None); A.grad set by loss.backward().

    The loss is the mean cross-entropy of ``targets`` from the full logits, computed the
    textbook way; attentions retain their gradients.
    """
    original = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=input_ids, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(original)
    for attention in out.attentions:
        attention.retain_grad()
    loss = None
    if targets is not None:
        logits = out.logits[0, targets - 1]
        loss = torch.nn.functional.cross_entropy(logits, input_ids[0, targets])
    return out.attentions, loss


def information_flow_reference(model, input_ids, targets, reduce="sum_then_abs") -> torch.Tensor:
    """Σ over target rows of |Σ_h A⊙∂L/∂A| (or Σ_h |A⊙∂L/∂A|) from eager attentions: [L, S]."""
    attentions, loss = eager_forward(model, input_ids, targets)
    loss.backward()
    rows = targets - 1
    scores = []
    for attention in attentions:
        saliency = (attention * attention.grad)[0][:, rows]  # [H, R, S]
        if reduce == "sum_then_abs":
            scores.append(saliency.sum(0).abs().sum(0))
        else:
            scores.append(saliency.abs().sum((0, 1)))
    model.zero_grad(set_to_none=True)
    return torch.stack(scores)


def embedding_grad_reference(model, input_ids, targets, p=2) -> torch.Tensor:
    """‖∂L/∂e_i‖_p via a leaf inputs_embeds with parameters left trainable: [S]."""
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, use_cache=False).logits[0, targets - 1]
    torch.nn.functional.cross_entropy(logits, input_ids[0, targets]).backward()
    model.zero_grad(set_to_none=True)
    return embeds.grad[0].norm(p=p, dim=-1)
