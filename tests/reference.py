"""Slow, obvious references: eager attention with ``output_attentions`` and ``retain_grad``; the span rule."""

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


def explicit_masks(
    model, seq: int, hidden=(), window: int | None = None, hidden_from: int = 0
) -> dict[str, torch.Tensor]:
    """Additive masks [1, 1, seq, seq] by layer type, built entry by entry with Python loops.

    Query i sees key j iff j ≤ i, j is within the layer's own sliding window and within ``window``,
    and j is not in ``hidden`` unless j = i or i < ``hidden_from`` (the queries before it see every
    key). Keys are the layer types of ``config.layer_types``
    ("full_attention" / "sliding_attention"), the form transformers accepts as ``attention_mask``.
    """
    config = model.config.get_text_config()
    masks = {}
    for layer_type in set(getattr(config, "layer_types", None) or ["full_attention"]):
        own = config.sliding_window if layer_type == "sliding_attention" else None
        mask = torch.full((1, 1, seq, seq), torch.finfo(torch.float32).min)
        for i in range(seq):
            for j in range(i + 1):
                visible = (own is None or j > i - own) and (window is None or j > i - window)
                if visible and (j == i or j not in hidden or i < hidden_from):
                    mask[0, 0, i, j] = 0.0
        masks[layer_type] = mask
    return masks


def masked_eager_forward(model, input_ids, hidden=(), window=None, heads=(), hidden_from=0):
    """Eager forward under :func:`explicit_masks`, with ``heads`` [(layer, head)] zeroed at o_proj's input.

    Returns (attentions [L] of [1, H, S, S], logits [1, S, vocab]).
    """
    masks = explicit_masks(model, input_ids.shape[1], hidden, window, hidden_from)
    mask = masks if len(masks) > 1 else next(iter(masks.values()))
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    handles = []
    for layer, head in heads:

        def zero(_, args, head=head):
            x = args[0].clone()
            x[..., head * head_dim : (head + 1) * head_dim] = 0
            return (x,)

        o_proj = model.model.layers[layer].self_attn.o_proj
        handles.append(o_proj.register_forward_pre_hook(zero))
    original = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model(input_ids=input_ids, attention_mask=mask, output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(original)
        for handle in handles:
            handle.remove()
    return out.attentions, out.logits


def head_weights_for(model, seed: int = 0):
    """Random AT2 head weights that fit ``model`` (the bundled ones fit only the real models)."""
    from probe.probes import at2

    config = model.config.get_text_config()
    shape = (len(at2.FEATURES), config.num_hidden_layers, config.num_attention_heads)
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return at2.HeadWeights(weights, {"name": "random", "model": at2.fingerprint(model)})


def token_starts(text: str, offsets) -> list[int | None]:
    """The span rule of :mod:`probe.tasks.sample`, one token at a time: a token starts at its first
    non-whitespace character (its first character if it has none); an added special token with an
    empty offset starts nowhere (``None``)."""
    starts = []
    for start, end in offsets.tolist():
        visible = [i for i in range(start, end) if not text[i].isspace()]
        starts.append(None if end <= start else (visible[0] if visible else start))
    return starts


def tokens_starting_in(starts: list[int | None], char_span: tuple[int, int]) -> list[int]:
    """The tokens whose start (:func:`token_starts`) lies in ``char_span`` [start, end)."""
    return [i for i, s in enumerate(starts) if s is not None and char_span[0] <= s < char_span[1]]


COMPACT_ATOL = 1e-4  # nats, fp32: compaction against key masking


def eager_answer_logprob(model, sample, hidden, hidden_from: int = 0) -> float:
    """Σ log P(gold answer token) from an eager forward with the hidden keys masked by hand (from the
    queries at ``hidden_from`` on)."""
    ids = sample.input_ids[None]
    _, logits = masked_eager_forward(model, ids, hidden=set(hidden), hidden_from=hidden_from)
    targets = sample.target_positions
    logprobs = logits[0, targets - 1].log_softmax(-1)
    return float(logprobs.gather(-1, sample.input_ids[targets, None]).sum().detach())
