"""The attention and gradient detectors: each reads one forward (and backward) pass over the sample.

``attention``, ``fr``, ``embedding_grad``, ``information_flow``, ``grad_times_input``,
``key_removal_grad`` and ``at2`` are readers of the shared answer-attribution pass
(``@register(name, shared_pass=...)``): alone, each runs that pass; in
:func:`~probe.detectors.run.detect_many` they share one. ``key_removal_banzhaf`` (its key bias starts
at log ½, another forward), ``attn_lrp`` and ``integrated_gradients`` run passes of their own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from probe.attention.shared_state import frozen_parameters
from probe.checks import check_int, check_layers, hf_model, input_device
from probe.detectors.registry import Detection, SharedPass, register, top_k_mask
from probe.errors import InvalidValueError
from probe.faithfulness import random_masks
from probe.faithfulness.compaction import removed_positions
from probe.memory.planner import guarded
from probe.probes.at2 import HeadWeights, token_features
from probe.probes.attribution import AnswerAttribution, critical_tokens
from probe.probes.key_removal import key_removal_gradient
from probe.probes.lrp import relevance
from probe.target import Target, target_loss_of
from probe.tasks import Sample


@register("attention", shared_pass=SharedPass(backward=False))
def attention(
    model, attribution: AnswerAttribution, sample: Sample, layers=None, top_k: int = 30
) -> Detection:
    """Attention from the answer-predicting rows, summed over heads, mean over rows and ``layers``.

    Flags the ``top_k`` context tokens (CDT, Chen et al. 2025, §6.1 uses top-30).
    """
    layers = check_layers(model, layers)
    pattern, _ = attribution.select(layers)
    per_layer = pattern.sum(dim=1).mean(dim=1)
    scores = per_layer.mean(dim=0)
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"layers": layers, "top_k": top_k},
        details={"per_layer": per_layer},
    )


@register("fr", shared_pass=SharedPass(backward=False))
def fr(model, attribution: AnswerAttribution, sample: Sample, layers=None, top_k: int = 30) -> Detection:
    """Fact-retrieval score (CDT §3.1): how often a token is among a head's top-k attended tokens.

    At each answer step j every head attends the ``top_k`` tokens it weights most (its set s_j).
    ``scores[i]`` = fraction of (head, step) pairs whose s_j contains token i (the per-token
    form of FR averaged over heads); ``details["per_head"]`` [layers, heads, seq] holds the
    per-head fractions, from which FR_{h,l}^{(r)} = |s_j ∩ T_r| / |T_r| follows per category,
    and ``details["mass_per_head"]`` the attention-mass variant (mean attention per head).
    Flags the ``top_k`` tokens with the highest score.
    """
    layers = check_layers(model, layers)
    pattern, _ = attribution.select(layers)
    context = sample.prompt_length
    chosen = pattern[..., :context].topk(min(top_k, context), dim=-1).indices
    attended = torch.zeros_like(pattern).scatter_(-1, chosen, 1.0)
    per_head = attended.mean(dim=2)  # [L, H, S]
    scores = per_head.mean(dim=(0, 1))
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, context),
        settings={"layers": layers, "top_k": top_k},
        details={"per_head": per_head, "mass_per_head": pattern.mean(dim=2)},
    )


@register("embedding_grad", shared_pass=SharedPass(layers="none"))
def embedding_grad(model, attribution: AnswerAttribution, sample: Sample, p: float = 2) -> Detection:
    """‖∂L/∂e_i‖_p of the answer loss (CDT §4.1); flags context tokens at or above the context mean."""
    scores = attribution.embedding_grad_norms(p)
    return Detection(scores=scores, flagged=critical_tokens(scores, sample.prompt_length), settings={"p": p})


@register("information_flow", shared_pass=SharedPass())
def information_flow(
    model,
    attribution: AnswerAttribution,
    sample: Sample,
    layers=None,
    reduce: str = "sum_then_abs",
    top_k: int = 30,
) -> Detection:
    """The IG / information-flow score (CDT eq. 1) from the answer rows, summed over ``layers``.

    ``details["per_layer"]`` [layers, seq] keeps each layer's score. Flags the ``top_k`` tokens.
    """
    layers = check_layers(model, layers)
    per_layer = attribution.information_flow(layers, reduce)
    scores = per_layer.sum(dim=0)
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"layers": layers, "reduce": reduce, "top_k": top_k},
        details={"per_layer": per_layer},
    )


def _additive(scores: torch.Tensor, sample: Sample, top_k: int, passes: int = 1, **settings) -> Detection:
    """A detection from per-token first-order effects that add up over a source: each source's score
    is the sum over its tokens (``details["source_scores"]``); flags the ``top_k`` context tokens.
    ``passes``: the forward+backward passes it took (``details["passes"]``); ``settings``: the
    detector's other options, recorded."""
    scores = scores.detach().float().cpu()
    source_scores = torch.stack([scores[source.start : source.end].sum() for source in sample.sources])
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"top_k": top_k, **settings},
        details={"source_scores": source_scores, "passes": passes},
    )


@register("grad_times_input", shared_pass=SharedPass(layers="none"))
def grad_times_input(model, attribution: AnswerAttribution, sample: Sample, top_k: int = 30) -> Detection:
    """Gradient × input on the embeddings: e_i · ∂ log P(answer)/∂e_i (Shrikumar et al. 2016), the
    first-order drop of the gold answer's log-probability when token i's embedding is zeroed.

    Signed (positive = the answer leans on the token); a source scores the sum over its tokens
    (``details["source_scores"]``). From the shared pass (:func:`detect_many`) at no extra cost.
    """
    return _additive(attribution.grad_times_input(), sample, top_k)


@register("key_removal_grad", shared_pass=SharedPass(layers="none", key_bias=True))
def key_removal_grad(model, attribution: AnswerAttribution, sample: Sample, top_k: int = 30) -> Detection:
    """The key-removal gradient (:func:`probe.probes.key_removal.key_removal_gradient`): ∂ log P(answer)/∂b_j
    for a bias b_j on key j's attention logit from every later query, every layer and head, at b = 0.

    A first-order estimate of removing token j from every attention, indirect paths included (a
    second hop reading the first); a source scores the sum over its tokens
    (``details["source_scores"]``), its first-order removal effect. Flags the ``top_k`` tokens. The
    bias rides in the shared pass (the model unchanged at b = 0): in :func:`detect_many` it costs no
    pass of its own. Sources removed as units (a source's own queries get no bias on its keys):
    ``key_removal_banzhaf(presence=1)``; the gradient integrated along the bias path:
    :func:`~probe.probes.key_removal.key_removal_gradient` ``depth=``.
    """
    return _additive(attribution.key_removal_gradient(), sample, top_k)


@register("key_removal_banzhaf")
def key_removal_banzhaf(
    model,
    tokenizer,
    sample: Sample,
    presence: float = 0.5,
    pairs: int = 0,
    seed: int = 1,
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """A first-order estimate of each source's Banzhaf value (Banzhaf 1965; for data attribution Wang &
    Jia, AISTATS 2023): the mean effect of removing it from a context that holds each other source
    with probability ½. The Banzhaf values are the coefficients of the least-squares linear model of
    the answer's log-probability over uniform half masks (Hammer & Holzman 1992), so they are what LDS
    (:func:`probe.faithfulness.lds`, such masks) rewards; leave-one-out and ``key_removal_grad``
    estimate the removal from the full context instead.

    One pass by default: the by-source key-removal gradient at ``presence`` ½
    (:func:`~probe.probes.key_removal.key_removal_gradient` ``presence=``), every source's keys weighted by
    ½ (bias log ½) — on average a key kept with probability ½ adds half its weight to a softmax, so
    this is the mean-field point of the random half contexts. ``pairs > 0`` adds the gradient in
    ``2 * pairs`` random half contexts (complementary pairs, ``seed``; keep it apart from the seed of
    an evaluation's masks), each run compacted over its kept tokens
    (:func:`~probe.probes.key_removal.key_removal_gradient` ``kept=``): every source is averaged over the
    first pass and the ``pairs`` contexts that keep it. ``1 + 2 * pairs`` forward+backward passes.
    ``presence=1, pairs=2`` is the sampled estimate anchored at the full context. A source scores the
    sum over its tokens.
    """
    pairs = check_int(pairs, "pairs", minimum=0)
    seq, spans = len(sample.input_ids), [(source.start, source.end) for source in sample.sources]
    contexts = [(None, presence)]
    for half in random_masks(len(spans), pairs, seed=seed) if pairs else []:
        for side in (half, ~half):
            kept = torch.ones(seq, dtype=torch.bool)
            kept[removed_positions(sample.sources, ~side)] = False
            contexts.append((kept, 1.0))
    total, count = torch.zeros(seq), torch.zeros(seq)
    for kept, weight in contexts:
        total += key_removal_gradient(
            model,
            sample.input_ids,
            sample.target_positions,
            checkpoint,
            target=target,
            sources=spans,
            kept=kept,
            presence=weight,
        )
        count += 1 if kept is None else kept.float()
    return _additive(
        total / count, sample, top_k, passes=len(contexts), presence=presence, pairs=pairs, seed=seed
    )


@register("at2", shared_pass=SharedPass(layers="all"))
def at2(
    model,
    attribution: AnswerAttribution,
    sample: Sample,
    weights: HeadWeights | str | Path | None = None,
    top_k: int = 30,
) -> Detection:
    """AT2 (Cohen-Wang et al. 2025, "Learning to Attribute with Attention"): per-head weights, learned
    from this toolkit's ablations (:mod:`probe.probes.at2`), on the answer rows' attention mass and saliency.

    ``weights``: a :class:`~probe.probes.at2.HeadWeights` or its file; ``None`` = the weights bundled for the
    model's architecture (SmolLM2-135M, Gemma 3 270M, Qwen2.5-Coder-0.5B; learn others' with
    ``python -m analyses.learn_head_weights``). One forward+backward pass over every layer, shared
    with the attention family in :func:`detect_many`. A source scores the sum over its tokens.
    """
    weights = HeadWeights.for_model(model, weights)
    detection = _additive(weights.token_scores(token_features(attribution)), sample, top_k)
    detection.settings["weights"] = weights.settings.get("name", "custom")
    return detection


@register("attn_lrp")
def attn_lrp(model, tokenizer, sample: Sample, top_k: int = 30, checkpoint: bool | str = "auto") -> Detection:
    """AttnLRP relevance (Achtibat et al., ICML 2024; :func:`probe.probes.lrp.relevance`): gradient ×
    input at
    the embeddings with the LRP rules for attention, products, norms and gated MLPs, explaining the
    gold answer tokens' logits. One forward and backward; a source scores the sum of its tokens'
    relevance. ``checkpoint``: see :mod:`probe.probes.attribution`."""
    return _additive(relevance(model, sample.input_ids, sample.target_positions, checkpoint), sample, top_k)


@register("integrated_gradients")
def integrated_gradients(
    model,
    tokenizer,
    sample: Sample,
    n_steps: int = 16,
    internal_batch_size: int = 4,
    top_k: int = 30,
    checkpoint: bool | str = "auto",
    target: Target | None = None,
) -> Detection:
    """captum ``LayerIntegratedGradients`` on the embedding layer.

    The attributed function is the mean log-probability of the answer tokens (= −L); the
    baseline puts the pad token's embedding (EOS if there is none) at every position. A token's
    score is |Σ_d attribution| (``details["signed"]`` keeps the sign).
    ``details["convergence_delta"]`` is captum's completeness gap |Σ attributions − (f(x) − f(baseline))|:
    read it before trusting the scores (long inputs and few steps make it large). ``checkpoint``:
    see :mod:`probe.probes.attribution` (planned per batch of ``internal_batch_size`` interpolated inputs).
    """
    from captum.attr import LayerIntegratedGradients

    inner = hf_model(model)
    ids = sample.input_ids[None].to(input_device(inner))
    targets = sample.target_positions.to(ids.device)
    if tokenizer is None:
        raise InvalidValueError("integrated_gradients needs the tokenizer: its baseline is its pad token")
    baseline_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def answer_log_prob(batch_ids: torch.Tensor) -> torch.Tensor:
        logits = inner(input_ids=batch_ids, use_cache=False, logits_to_keep=targets - 1).logits.float()
        answer = ids[0, targets]  # fixed: the baseline's ids are pads
        return torch.stack([-target_loss_of(target, one, answer) for one in logits])

    batch = min(internal_batch_size, n_steps)
    with (
        guarded(model, ids.shape[1], "embedding_grads", checkpoint, len(targets), batch),
        frozen_parameters(inner),
    ):
        method = LayerIntegratedGradients(answer_log_prob, inner.get_input_embeddings())
        attributions, delta = method.attribute(
            ids,
            baselines=torch.full_like(ids, baseline_id),
            n_steps=n_steps,
            internal_batch_size=internal_batch_size,
            return_convergence_delta=True,
        )
    signed = attributions[0].sum(dim=-1).detach()
    scores = signed.abs()
    return Detection(
        scores=scores,
        flagged=top_k_mask(scores, top_k, sample.prompt_length),
        settings={"n_steps": n_steps, "top_k": top_k, "baseline_token_id": baseline_id},
        details={"signed": signed, "convergence_delta": float(delta.abs().item())},
    )
