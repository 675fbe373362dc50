"""Log-probabilities of the tokens of a sequence, under its whole prefix or a truncated one.

The long-context likelihood log P(x_t | x_<t) (Fang et al. 2025, eq. 3) and the short-context one
log P(x_t | s_t) (eq. 2, s_t the last K tokens before x_t) — the two terms of the long-short
difference of :mod:`probe.probes.lsd` — and the per-token log-probabilities the LongCE objective weights
(:mod:`probe.training.objectives`). Throughout, ``target_positions`` are the positions t of the predicted
tokens; the row that predicts token t is t − 1, and ``target_ids`` are the ids x_t predicted.

**Short contexts** (App. A.1, eq. 8). Scored tokens come in blocks of ``d`` that share one window
start, so one forward pass over K + d tokens scores d tokens; windows of equal length are batched.
Our default scores every token that has *more* than K tokens before it (t ≥ K + 1): block j holds
tokens K+1+jd … K+jd+d and starts its window at 1 + jd, so a token sees between K and K+d−1 previous
tokens, and ``d = 1`` is the exact mode (each token sees exactly its K previous tokens).
``official=True`` reproduces the official package (PyPI ``longppl`` 0.3.0): scored tokens t ≥ K,
window start jd — the first block then sees its whole prefix (its LSD is 0, one wasted pass).

**Memory** (DESIGN decision 4): no pass ever holds [seq, vocab] logits. Passes return final hidden
states; the LM head (with Gemma's final logit soft-capping) and the log-softmax run on row chunks of
at most ``HEAD_CHUNK_ELEMENTS`` logits, checkpointed when gradients flow (LongCE).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from probe.checks import check_input_ids, check_int, check_positions, hf_model
from probe.errors import InvalidValueError

__all__ = [
    "BATCH_TOKENS",
    "HEAD_CHUNK_ELEMENTS",
    "LogProbs",
    "final_hidden_states",
    "long_logprobs",
    "short_context_blocks",
    "short_logprobs",
    "target_logprobs",
]

HEAD_CHUNK_ELEMENTS = 2**25  # logits materialized at once (rows × vocab): 128 MiB in fp32
BATCH_TOKENS = 8192  # tokens per batched forward pass of short-context windows


class LogProbs(NamedTuple):
    """Per-token scores, each Tensor[seq]; NaN where a token was not scored."""

    target: torch.Tensor  # log P(x_t | context)
    top: torch.Tensor  # max_v log P(v | context): the greedy choice's log-probability

    @property
    def greedy(self) -> torch.Tensor:
        """BoolTensor[seq]: x_t is the model's greedy (argmax) prediction."""
        return self.target == self.top


def final_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states after the final norm, Tensor[batch, seq, hidden], without the LM head.

    ``input_ids`` is LongTensor[batch, seq].
    """
    return hf_model(model).base_model(input_ids=input_ids, use_cache=False).last_hidden_state


def _head_logprobs(
    model, hidden: torch.Tensor, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + soft-capping + log-softmax of Tensor[rows, hidden]: (target, top) log-probs, each [rows].

    ``target_ids`` is LongTensor[rows], the token each row predicts.
    """
    inner = hf_model(model)
    logits = inner.get_output_embeddings()(hidden).float()
    cap = getattr(inner.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    norm = logits.logsumexp(-1)
    return logits.gather(-1, target_ids[:, None])[:, 0] - norm, logits.max(-1).values - norm


def target_logprobs(model, hidden: torch.Tensor, target_ids: torch.Tensor) -> LogProbs:
    """Log-probabilities of ``target_ids`` [rows] from final hidden states [rows, hidden], in row chunks.

    Returns :class:`LogProbs` of Tensor[rows]. When ``hidden`` requires grad each chunk is
    checkpointed, so the backward pass recomputes its logits instead of keeping [rows, vocab] of
    them alive.
    """
    vocab = hf_model(model).get_output_embeddings().weight.shape[0]
    rows = max(1, HEAD_CHUNK_ELEMENTS // vocab)
    chunks = []
    for chunk, chunk_ids in zip(hidden.split(rows), target_ids.split(rows), strict=True):
        if chunk.requires_grad:
            chunks.append(checkpoint(_head_logprobs, model, chunk, chunk_ids, use_reentrant=False))
        else:
            chunks.append(_head_logprobs(model, chunk, chunk_ids))
    return LogProbs(*(torch.cat(parts) for parts in zip(*chunks, strict=True)))


def _scattered(scores: LogProbs, target_positions: torch.Tensor, seq: int) -> LogProbs:
    """``scores`` [k] of ``target_positions`` [k] placed into Tensor[seq]s, NaN elsewhere."""
    full = [torch.full((seq,), float("nan"), device=target_positions.device) for _ in scores]
    for tensor, values in zip(full, scores, strict=True):
        tensor[target_positions] = values
    return LogProbs(*full)


@torch.no_grad()
def long_logprobs(
    model, input_ids: torch.Tensor | Sequence[int], target_positions: Sequence[int] | None = None
) -> LogProbs:
    """log P(x_t | x_<t) (eq. 3) from one full forward pass: Tensor[seq]s, NaN at t = 0 (no prediction).

    ``input_ids`` is [seq] or [1, seq]; ``target_positions`` (each ≥ 1) limits the LM head to those
    tokens, the others are NaN.
    """
    ids = check_input_ids(model, input_ids)
    seq = ids.shape[1]
    if target_positions is None:
        target_positions = torch.arange(1, seq)
    else:
        target_positions = check_positions(target_positions, seq, "target_positions", minimum=1)
    target_positions = target_positions.to(ids.device)
    if seq < 2:
        raise InvalidValueError("a 1-token sequence has no token to predict")
    hidden = final_hidden_states(model, ids)[0]
    scores = target_logprobs(model, hidden[target_positions - 1], ids[0, target_positions])
    return _scattered(scores, target_positions, seq)


def short_context_blocks(seq: int, K: int, d: int, official: bool = False) -> list[tuple[int, int, int]]:
    """The sliding-window scheme (App. A.1, eq. 8) as ``(window_start, first, end)`` triples.

    Tokens ``first … end−1`` are scored by one forward pass over ``x[window_start:end]``, and
    ``first − window_start = K`` always. Default: the first block starts at token K + 1 (the first
    token with a truncated context); ``official=True``: at token K with window start 0.
    """
    K, d = check_int(K, "K", 1), check_int(d, "d", 1)
    first = K if official else K + 1
    if seq <= first:
        raise InvalidValueError(
            f"a {seq}-token sequence has no token at position ≥ {first}, so no token gets a short-context "
            f"score with K={K}; use K < {seq - (0 if official else 1)} or a longer text"
        )
    return [(start - K, start, min(start + d, seq)) for start in range(first, seq, d)]


@torch.no_grad()
def short_logprobs(
    model,
    input_ids: torch.Tensor | Sequence[int],
    K: int = 4096,
    d: int = 1024,
    official: bool = False,
    target_positions: Sequence[int] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> LogProbs:
    """log P(x_t | s_t) (eq. 2) under the short contexts of :func:`short_context_blocks`: Tensor[seq]s.

    ``input_ids`` is [seq] or [1, seq]. NaN where a token gets no short-context score (t ≤ K;
    official: t < K). Windows of equal length run ``batch_tokens // length`` at a time.
    ``target_positions`` (each ≥ 1) skips the blocks holding none of them.
    """
    ids = check_input_ids(model, input_ids)[0]
    blocks = short_context_blocks(len(ids), K, d, official)
    if target_positions is not None:
        wanted = check_positions(target_positions, len(ids), "target_positions", minimum=1)
        blocks = [b for b in blocks if ((wanted >= b[1]) & (wanted < b[2])).any()]
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for block in blocks:
        by_length.setdefault(block[2] - block[0], []).append(block)
    scored, parts = [], []
    for length, group in by_length.items():
        per_pass = max(1, batch_tokens // length)
        for i in range(0, len(group), per_pass):
            batch = group[i : i + per_pass]
            windows = torch.stack([ids[start:end] for start, _, end in batch])  # [B, K + block]
            hidden = final_hidden_states(model, windows)[:, K - 1 : -1]  # rows predicting windows[:, K:]
            parts.append(
                target_logprobs(model, hidden.reshape(-1, hidden.shape[-1]), windows[:, K:].reshape(-1))
            )
            scored += [torch.arange(first, end) for _, first, end in batch]
    if not parts:  # no wanted position has a short context: nothing scored
        none = torch.empty(0, device=ids.device)
        return _scattered(LogProbs(none, none), none.long(), len(ids))
    scores = LogProbs(*(torch.cat(p) for p in zip(*parts, strict=True)))
    return _scattered(scores, torch.cat(scored).to(ids.device), len(ids))
