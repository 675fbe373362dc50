"""AttnLRP: layer-wise relevance propagation for transformers, as modified gradients.

After Achtibat et al., "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for Transformers"
(ICML 2024, arXiv 2402.05602). Inside :func:`lrp_rules` the forward pass is unchanged and the backward
pass follows the paper's rules, so that gradient × input at the embeddings is the relevance:

- identity rule (eq. 9) on element-wise non-linearities (the MLP's activation) and on RMS
  normalization (the normalizer taken as a constant): through y = f(x) the gradient becomes
  (y / x) · ∂/∂y, so the relevance passes on unchanged;
- uniform rule (eq. 7) on products of two inputs: the gated MLP's act(gate) · up (each factor gets
  half the gradient), A · V (the value's gradient halved) and q · kᵀ inside the softmax (query and key
  gradients quartered, the attention function's modifier, :func:`probe.attention.modifiers.lrp_attention`);
- softmax: its plain gradient (the paper's rule for the softmax with its bias term, §3.3.1).

:func:`relevance` explains the sum of the gold answer tokens' logits (the paper explains one logit).
Architectures whose blocks are RMS norms and gated MLPs (Llama, Gemma 3, Qwen, Mistral, ...) are
supported; others are refused. The authors' own code (``lxt``, Clear BSD licence) states that LRP is a
patented technology that may be used free of charge for personal and scientific purposes; this is an
implementation of the paper's rules, written for longprobe's capture core.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from probe.attention.modifiers import lrp_attention, scale_gradient
from probe.attention.shared_state import frozen_parameters
from probe.checks import UnsupportedModelError, check_input_ids, check_positions, hf_model
from probe.memory.planner import guarded


class _IdentityRule(torch.autograd.Function):
    """y = f(x) forward; backward ∂/∂x = (y / x) · ∂/∂y (0 where x = 0): the identity rule."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(torch.where(x == 0, torch.zeros_like(y), y / torch.where(x == 0, 1, x)))
        return y.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ratio,) = ctx.saved_tensors
        return grad * ratio, None


def _identity_rule(module, inputs, output):
    return _IdentityRule.apply(inputs[0], output.detach())


def _uniform_rule(module, inputs):
    return (scale_gradient(inputs[0], 0.5), *inputs[1:])


def _is_gated_mlp(module: torch.nn.Module) -> bool:
    return all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


@contextmanager
def lrp_rules(model) -> Iterator[None]:
    """Inside the block, backward passes through ``model`` follow the AttnLRP rules (module docstring).

    Hooks on every RMS norm, every gated MLP's activation and down projection, and the attention
    modifier; all removed on exit, also after an exception. Refuses a model with LayerNorm or an
    MLP that is not gated (their rules are not implemented here).
    """
    inner = hf_model(model)
    modules = list(inner.modules())
    unsupported = sorted(
        {type(m).__name__ for m in modules if isinstance(m, torch.nn.LayerNorm)}
        | {type(m).__name__ for m in modules if type(m).__name__.endswith("MLP") and not _is_gated_mlp(m)}
    )
    if unsupported or not any(_is_gated_mlp(m) for m in modules):
        raise UnsupportedModelError(
            f"AttnLRP here covers RMS norms and gated MLPs (Llama, Gemma 3, Qwen, Mistral, ...); "
            f"{type(inner).__name__} has {', '.join(unsupported) or 'no gated MLP'}"
        )
    identity = {id(m): m for m in modules if _is_rms_norm(m)}
    identity |= {id(m.act_fn): m.act_fn for m in modules if _is_gated_mlp(m)}  # once, even if shared
    with ExitStack() as stack:
        for module in identity.values():
            stack.callback(module.register_forward_hook(_identity_rule).remove)
        for module in modules:
            if _is_gated_mlp(module):
                stack.callback(module.down_proj.register_forward_pre_hook(_uniform_rule).remove)
        stack.enter_context(lrp_attention(inner))
        yield


def relevance(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    checkpoint: bool | str = "auto",
) -> torch.Tensor:
    """AttnLRP relevance of each input token for Σ_t logit(x_t) at rows t − 1: Tensor[seq].

    R_i = e_i · ∂(Σ_t logit_t)/∂e_i under :func:`lrp_rules` (one forward and one backward pass);
    positive = the token speaks for the answer. ``checkpoint``: see :mod:`probe.probes.attribution`.
    """
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", 1).to(ids.device)
    inner = hf_model(model)
    with (
        guarded(model, ids.shape[1], "embedding_grads", checkpoint, len(targets)),
        frozen_parameters(inner),
        torch.enable_grad(),
        lrp_rules(inner),
    ):
        embeds = inner.get_input_embeddings()(ids).detach().requires_grad_(True)
        logits = inner(inputs_embeds=embeds, use_cache=False, logits_to_keep=targets - 1).logits[0]
        target = logits.float().gather(-1, ids[0, targets, None]).sum()
        (grad,) = torch.autograd.grad(target, embeds)
    return (embeds * grad).sum(-1)[0].detach().float().cpu()
