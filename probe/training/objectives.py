"""Training objectives of the papers: LongCE (the LongPPL paper), CDT and LOGO.

- **LongCE** (Fang et al. 2025, eqs. 6–7): cross-entropy with token weights min(exp(LSD), γ), where the
  model scores its own long-short difference online (:mod:`probe.probes.lsd`, :mod:`probe.probes.logprobs`).
  :func:`longce_loss` weights every token of a sequence; :func:`longce_target_loss` weights only
  the target tokens (e.g. an answer), the setting of our fine-tuning experiment.
- **CDT** (Context Denoising Training, §4): critical tokens are those whose embedding-gradient norm
  reaches the mean (eq. 1); the other (noise) tokens are moved against their loss gradient, E' = E − lr·β·∇E
  (eq. 2), and the model is trained with cross-entropy on E' (eq. 3). :func:`cdt_loss` does all
  three steps online for one sequence.
- **LOGO** (Tang et al. 2024, eqs. 2–3): a reference-free (SimPO-style) preference loss with M
  dispreferred responses plus an SFT term, :func:`logo_loss`, fed by :func:`sequence_logprob`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from probe.checks import check_input_ids, check_positions, hf_model
from probe.errors import InvalidValueError
from probe.memory.planner import guarded
from probe.probes.attribution import critical_tokens, embedding_grads
from probe.probes.logprobs import final_hidden_states, short_logprobs, target_logprobs
from probe.probes.lsd import soft_influence
from probe.probes.noise_restraint import denoised_embeddings, noise_tokens
from probe.target import target_loss

__all__ = [
    "CDTLoss",
    "cdt_loss",
    "logo_loss",
    "longce_loss",
    "longce_target_loss",
    "longce_weights",
    "sequence_logprob",
]


# ------------------------------------------------------------------------------ LongCE (Fang et al. 2025)


def longce_weights(lsd: torch.Tensor, gamma: float = 5.0) -> torch.Tensor:
    """LongCE token weights (eq. 7), detached Tensor[seq] from LSD Tensor[seq]: min(exp(LSD), γ)
    (:func:`probe.probes.lsd.soft_influence`), and 1 where LSD is NaN (no short-context score)."""
    return torch.nan_to_num(soft_influence(lsd.detach(), gamma), nan=1.0)


def longce_loss(
    model, input_ids: torch.Tensor | Sequence[int], K: int = 4096, d: int = 1024, gamma: float = 5.0
) -> torch.Tensor:
    """LongCE (eq. 6): −1/(n−1) Σ_t w_t log P(x_t | x_<t), w = :func:`longce_weights` of the model's own LSD.

    ``input_ids`` is [n] or [1, n]; returns a scalar. The model scores itself (its short passes,
    :func:`probe.probes.logprobs.short_logprobs`, without gradients); the mean runs over all n−1 predicted
    tokens and is not normalized by Σw, as in the paper. Gradients flow through the long pass only;
    its LM head is checkpointed per chunk.
    """
    ids = check_input_ids(model, input_ids)
    hidden = final_hidden_states(model, ids)[0, :-1]
    logprobs = target_logprobs(model, hidden, ids[0, 1:]).target
    short = short_logprobs(model, ids, K, d).target[1:]
    return -(longce_weights(logprobs - short, gamma) * logprobs).mean()


def longce_target_loss(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    K: int,
    d: int = 1,
    gamma: float = 5.0,
) -> torch.Tensor:
    """LongCE (Fang et al. 2025, eqs. 6–7) on the target tokens only: −1/|T| Σ_{t∈T} w_t log P(x_t | x_<t).

    ``input_ids`` is [seq] or [1, seq], ``target_positions`` the T positions scored (each ≥ 1).
    w_t = :func:`longce_weights` (min(exp(LSD_t), γ), detached) of the model's own LSD, with the
    short context of the last K tokens (``d`` = 1: exactly K per target; see
    :func:`probe.probes.logprobs.short_context_blocks`). Targets at t ≤ K have no short context and weight 1:
    if every target is that close to the start, this is plain cross-entropy of the targets.
    Returns a scalar with gradients to the parameters through log P (the short passes run
    without gradients).
    """
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", minimum=1).to(ids.device)
    hidden = final_hidden_states(model, ids)[0, targets - 1]
    logprobs = target_logprobs(model, hidden, ids[0, targets]).target
    lsd = torch.full_like(logprobs, float("nan"))  # t ≤ K: no short context, weight 1
    far = targets > K
    if far.any():  # no short pass at all when every target is within K of the start
        short = short_logprobs(model, ids, K, d, target_positions=targets[far]).target
        lsd[far] = logprobs[far] - short[targets[far]]
    return -(longce_weights(lsd, gamma) * logprobs).mean()


# --------------------------------------------------------------------------- CDT (Context Denoising Training)


class CDTLoss(NamedTuple):
    """What :func:`cdt_loss` returns."""

    loss: torch.Tensor  # scalar: CE of the targets on E' (eq. 3), gradients to the parameters
    critical: torch.Tensor  # bool [seq]: I(x_i) of eq. 1
    shift: torch.Tensor  # [seq, hidden]: E' − E (detached; zero on critical tokens and from `context` on)


def cdt_loss(
    model,
    input_ids: torch.Tensor | Sequence[int],
    target_positions: Sequence[int],
    lr: float,
    beta: float = 5.0,
    context: int | None = None,
    checkpoint: bool | str = "auto",
) -> CDTLoss:
    """One online CDT step's loss (Context Denoising Training, §4, eqs. 1–3) for one sequence.

    1. ∇E = ∂L/∂E of the mean cross-entropy of the tokens at ``target_positions`` (each predicted
       from row t − 1), parameters frozen (:func:`probe.embedding_grads`): Tensor[seq, hidden].
    2. I(x_i) = :func:`~probe.probes.attribution.critical_tokens` of ‖∇E(x_i)‖₂ over the first ``context``
       tokens (eq. 1).
    3. E' = :func:`~probe.probes.noise_restraint.denoised_embeddings` moving the noise tokens,
       ``move = ~I`` (the text's reading of eq. 2; :func:`~probe.probes.noise_restraint.noise_tokens`),
       with the learning rate ``lr`` and β (paper: 5). Tokens at or after ``context`` (the response, when
       ``context`` is the prompt length) are not moved.
    4. L_CDT = cross-entropy of the targets with E' as the model input (eq. 3).

    The shift lr·β·∇E is a constant (no second-order gradient); E itself keeps its graph, so the
    embedding table trains as in plain fine-tuning ("we unfreeze the model"). Parameter flags and
    train/eval mode are left as they were (step 1 runs in eval mode, step 4 in the model's mode).

    ``checkpoint`` (``False | True | "auto"``, see :mod:`probe.probes.attribution`) applies to both
    passes: with it, step 4's decoder layers are recomputed when the returned loss is
    back-propagated, and the gradients are the same.
    """
    ids = check_input_ids(model, input_ids)
    targets = check_positions(target_positions, ids.shape[1], "target_positions", minimum=1).to(ids.device)
    with guarded(model, ids.shape[1], "embedding_grads", checkpoint, len(targets)) as checkpointing:
        grads = embedding_grads(model, ids, targets, checkpoint=checkpointing)
        norms = grads.norm(dim=-1)
        critical, move = critical_tokens(norms, context), noise_tokens(norms, context)
        embeds = hf_model(model).get_input_embeddings()(ids)[0]
        denoised = denoised_embeddings(embeds, grads, move, lr, beta)
        loss = target_loss(model, ids, targets, inputs_embeds=denoised[None])
    return CDTLoss(loss, critical, (denoised - embeds).detach())


# --------------------------------------------------------------------------- LOGO (Tang et al. 2024)


def sequence_logprob(
    model, prompt_ids: torch.Tensor | Sequence[int], response_ids: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, int]:
    """(log π(y | x), |y|): the summed log-probability of the response tokens and their count.

    ``prompt_ids`` x is [prompt] (at least one token), ``response_ids`` y is [response]; the
    model reads x + y once and only the |y| rows predicting y reach the vocabulary projection
    (``logits_to_keep``, via :func:`probe.target.target_loss`). The sum carries gradients.
    """
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    response = torch.as_tensor(response_ids, dtype=torch.long).reshape(-1)
    if prompt.numel() == 0 or response.numel() == 0:
        raise InvalidValueError("prompt and response each need at least one token")
    ids = check_input_ids(model, torch.cat([prompt, response]))
    targets = torch.arange(len(prompt), ids.shape[1], device=ids.device)
    return -target_loss(model, ids, targets) * len(response), len(response)


def logo_loss(
    chosen_logps: torch.Tensor,
    chosen_lengths: torch.Tensor | Sequence[int],
    rejected_logps: torch.Tensor,
    rejected_lengths: torch.Tensor | Sequence[Sequence[int]],
    beta: float,
    gamma: float,
    sft_weight: float = 0.1,
) -> torch.Tensor:
    """LOGO's loss (Tang et al. 2024, eqs. 2–3), mean over the batch: a scalar.

    With r(y) = β/|y| · log π(y|x) (SimPO's length-normalized implicit reward, eq. 1):

        L = −log σ( r(y_w) − 1/M Σ_j r(y_l^(j)) − γ ) + λ · (−1/|y_w|) log π(y_w|x)

    ``chosen_logps`` / ``chosen_lengths``: Tensor[batch], log π(y_w|x) summed over the response
    tokens (:func:`sequence_logprob`) and |y_w|. ``rejected_logps`` / ``rejected_lengths``:
    Tensor[batch, M] for the M dispreferred responses (paper: M = 2). Eq. 2 prints a single |y_l|
    for all of them; each is normalized by its own length here, which is the reward margin the
    paper plots (Fig. 6b) and the same when the lengths agree. M = 1 is SimPO (eq. 1).
    ``sft_weight`` = λ (paper: 0.1); eq. 3 prints "+ λ E log π(y_w|x)", a sign typo: adding the
    log-likelihood would push the preferred response *down*, so the SFT regularizer here is the
    per-token negative log-likelihood of y_w. The paper's β, γ: 10, 3 (Llama-3-8B), 2.5, 0.25
    (Mistral-7B), 3, 0.6 (Llama-2-7B).
    """
    chosen_lengths = torch.as_tensor(chosen_lengths).to(chosen_logps)
    rejected_lengths = torch.as_tensor(rejected_lengths).to(rejected_logps)
    batch = chosen_logps.shape
    if (
        chosen_logps.ndim != 1
        or chosen_lengths.shape != batch
        or rejected_logps.ndim != 2
        or rejected_logps.shape[:1] != batch
        or rejected_lengths.shape != rejected_logps.shape
    ):
        raise InvalidValueError(
            "chosen_logps and chosen_lengths must be [batch], rejected_logps and rejected_lengths "
            f"[batch, M]; got {tuple(chosen_logps.shape)}, {tuple(chosen_lengths.shape)}, "
            f"{tuple(rejected_logps.shape)}, {tuple(rejected_lengths.shape)}"
        )
    chosen = chosen_logps / chosen_lengths  # mean log-prob per token of y_w
    rejected = (rejected_logps / rejected_lengths).mean(dim=1)
    preference = -F.logsigmoid(beta * (chosen - rejected) - gamma)
    return (preference - sft_weight * chosen).mean()
