"""Long-short difference, key tokens, LongPPL and LongCE (seed 000: Fang et al., "What is wrong
with perplexity for long-context language modeling?", ICLR 2025).

For the token x_t at position t of a sequence (t = 0 … n−1, predicted from x_<t):

- LCL(x_t) = log P(x_t | x_<t)                                  (eq. 3: long-context likelihood)
- LSD(x_t) = log P(x_t | x_<t) − log P(x_t | s_t)                (eq. 2: s_t a short, truncated context)
- key token: LSD > α and LCL > β, strict                        (eq. 4; α = 2, β = −2)
- LongPPL = exp(mean NLL of the key tokens), scored by the evaluated model while an evaluator
  model picks the key tokens (eq. 4); LongPPL-soft weights every token by I_soft instead
- I_soft = min(exp(LSD), γ) and LongCE = −1/n Σ I_soft · log P   (eqs. 6–7; γ = 5)

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

**Evaluator ≠ evaluated model** (App. A.1, eqs. 9–10): values travel between tokenizations through the
characters of the text. Our default reads only the non-whitespace characters of a token, so the
leading-space conventions of different tokenizers do not matter; ``official=True`` requires plain
containment of the token's raw character span, as the official code does. Tokenizers that give no
offsets get them rebuilt by decoding (:func:`decoded_offsets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedTokenizerBase

from probe.capture import check_input_ids, check_positions, hf_model

HEAD_CHUNK_ELEMENTS = 2**25  # logits materialized at once (rows × vocab): 128 MiB in fp32
BATCH_TOKENS = 8192  # tokens per batched forward pass of short-context windows


# --------------------------------------------------------------------------- log-probabilities


class LogProbs(NamedTuple):
    """Per-token scores, each Tensor[seq]; NaN where a token was not scored."""

    target: torch.Tensor  # log P(x_t | context)
    top: torch.Tensor  # max_v log P(v | context): the greedy choice's log-probability

    @property
    def greedy(self) -> torch.Tensor:
        """BoolTensor[seq]: x_t is the model's greedy (argmax) prediction."""
        return self.target == self.top


def final_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Hidden states after the final norm, Tensor[batch, seq, hidden], without the LM head."""
    return hf_model(model).base_model(input_ids=input_ids, use_cache=False).last_hidden_state


def _head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + soft-capping + log-softmax for Tensor[rows, hidden]; (target, top) log-probs [rows]."""
    inner = hf_model(model)
    logits = inner.get_output_embeddings()(hidden).float()
    cap = getattr(inner.config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    norm = logits.logsumexp(-1)
    return logits.gather(-1, targets[:, None])[:, 0] - norm, logits.max(-1).values - norm


def target_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor) -> LogProbs:
    """Log-probabilities of ``targets`` [rows] from final hidden states [rows, hidden], in row chunks.

    When ``hidden`` requires grad each chunk is checkpointed, so the backward pass recomputes its
    logits instead of keeping [rows, vocab] of them alive.
    """
    vocab = hf_model(model).get_output_embeddings().weight.shape[0]
    rows = max(1, HEAD_CHUNK_ELEMENTS // vocab)
    chunks = []
    for chunk, chunk_targets in zip(hidden.split(rows), targets.split(rows), strict=True):
        if chunk.requires_grad:
            chunks.append(checkpoint(_head_logprobs, model, chunk, chunk_targets, use_reentrant=False))
        else:
            chunks.append(_head_logprobs(model, chunk, chunk_targets))
    return LogProbs(*(torch.cat(parts) for parts in zip(*chunks, strict=True)))


def _scattered(scores: LogProbs, positions: torch.Tensor, seq: int) -> LogProbs:
    """``scores`` of ``positions`` placed into Tensor[seq]s, NaN elsewhere."""
    full = [torch.full((seq,), float("nan"), device=positions.device) for _ in scores]
    for tensor, values in zip(full, scores, strict=True):
        tensor[positions] = values
    return LogProbs(*full)


@torch.no_grad()
def long_logprobs(
    model, input_ids: torch.Tensor | Sequence[int], positions: Sequence[int] | None = None
) -> LogProbs:
    """log P(x_t | x_<t) from one full forward pass: Tensor[seq]s, NaN at t = 0 (no prediction).

    ``positions`` (each ≥ 1) limits the LM head to those tokens; the others are NaN.
    """
    ids = check_input_ids(model, input_ids)
    seq = ids.shape[1]
    if positions is None:
        positions = torch.arange(1, seq, device=ids.device)
    else:
        positions = check_positions(positions, seq, "positions", minimum=1).to(ids.device)
    if seq < 2:
        raise ValueError("a 1-token sequence has no token to predict")
    hidden = final_hidden_states(model, ids)[0]
    return _scattered(target_logprobs(model, hidden[positions - 1], ids[0, positions]), positions, seq)


def short_context_blocks(seq: int, K: int, d: int, official: bool = False) -> list[tuple[int, int, int]]:
    """The sliding-window scheme (App. A.1, eq. 8) as ``(window_start, first, end)`` triples.

    Tokens ``first … end−1`` are scored by one forward pass over ``x[window_start:end]``, and
    ``first − window_start = K`` always. Default: the first block starts at token K + 1 (the first
    token with a truncated context); ``official=True``: at token K with window start 0.
    """
    if K < 1 or d < 1:
        raise ValueError(f"K and d must be positive, got K={K}, d={d}")
    first = K if official else K + 1
    if seq <= first:
        raise ValueError(
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
    positions: Sequence[int] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> LogProbs:
    """log P(x_t | s_t) under the short contexts of :func:`short_context_blocks`: Tensor[seq]s.

    NaN where a token gets no short-context score (t ≤ K; official: t < K). Windows of equal
    length run ``batch_tokens // length`` at a time. ``positions`` skips blocks holding none of them.
    """
    ids = check_input_ids(model, input_ids)[0]
    blocks = short_context_blocks(len(ids), K, d, official)
    if positions is not None:
        wanted = check_positions(positions, len(ids), "positions", minimum=1)
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


def lsd_scores(
    model,
    input_ids: torch.Tensor | Sequence[int],
    K: int = 4096,
    d: int = 1024,
    official: bool = False,
    positions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LSD, LCL), each Tensor[seq] (eqs. 2–3), for detectors and the scores below.

    LSD is NaN where no short-context score exists (t ≤ K by default, t < K with ``official``);
    LCL is NaN only at t = 0. With ``positions`` both are NaN outside them.
    """
    long = long_logprobs(model, input_ids, positions)
    short = short_logprobs(model, input_ids, K, d, official, positions)
    return long.target - short.target, long.target


def key_token_mask(
    lsd: torch.Tensor, lcl: torch.Tensor, alpha: float = 2.0, beta: float = -2.0
) -> torch.Tensor:
    """I(x_t) of eq. 4: LSD > α and LCL > β (strict, as in the paper and the official code); NaN → False."""
    return (lsd > alpha) & (lcl > beta)


def soft_influence(lsd: torch.Tensor, gamma: float = 5.0) -> torch.Tensor:
    """I_soft(x_t) = min(exp(LSD), γ) (eq. 7); NaN stays NaN (no short-context score)."""
    return torch.clamp(lsd.exp(), max=gamma)


@torch.no_grad()
def token_lsd(
    model,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    K: int = 4096,
    d: int = 1024,
    official: bool = False,
) -> pd.DataFrame:
    """One row per token of ``text``: position, token_id, token (its text), char_start, char_end,
    long_logprob, short_logprob, lsd, lcl, greedy (the long-context argmax).

    Log-probs are NaN where undefined (see :func:`lsd_scores`); settings are in ``frame.attrs``.
    """
    ids, offsets = encode(tokenizer, text)
    long = long_logprobs(model, ids)
    short = short_logprobs(model, ids, K, d, official)
    pieces = tokenizer.convert_ids_to_tokens(ids.tolist())
    frame = pd.DataFrame(
        {
            "position": np.arange(len(ids)),
            "token_id": ids.numpy(),
            "token": [text[a:b] if b > a else piece for (a, b), piece in zip(offsets, pieces, strict=True)],
            "char_start": offsets[:, 0],
            "char_end": offsets[:, 1],
            "long_logprob": long.target.cpu().numpy(),
            "short_logprob": short.target.cpu().numpy(),
            "lsd": (long.target - short.target).cpu().numpy(),
            "lcl": long.target.cpu().numpy(),
            "greedy": long.greedy.cpu().numpy(),
        }
    )
    frame.attrs = dict(K=K, d=d, official=official)
    return frame


# --------------------------------------------------------------------------- tokens and characters


def encode(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True
) -> tuple[torch.Tensor, np.ndarray]:
    """``text`` as LongTensor[seq] ids and int array[seq, 2] character offsets (end exclusive).

    Tokenizers that give no offsets (tiktoken-based ones raise ``NotImplementedError``, Python
    "slow" tokenizers silently omit them) get offsets from :func:`decoded_offsets`.
    """
    try:
        encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    except (NotImplementedError, ValueError):
        encoding = tokenizer(text, add_special_tokens=add_special_tokens)
    ids = list(encoding["input_ids"])
    if "offset_mapping" in encoding:
        offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    else:
        offsets = decoded_offsets(tokenizer, ids, text)
    return torch.tensor(ids, dtype=torch.long), offsets


def decoded_offsets(
    tokenizer: PreTrainedTokenizerBase, ids: Sequence[int], text: str, lookback: int = 4
) -> np.ndarray:
    """Character offsets [seq, 2] rebuilt by decoding, for tokenizers without offset mapping.

    Token i's text is what it adds to the decoding of its ``lookback`` predecessors: decode(x_{i−w..i})
    minus decode(x_{i−w..i−1}). The context keeps SentencePiece's leading spaces, which a window's
    first token loses, and completes characters split over several byte tokens (an incomplete
    trailing character, decoded as U+FFFD, is left to the token that completes it; the others get
    empty spans). Special tokens add nothing. Raises if the pieces do not spell ``text``.
    """

    def decode(piece: Sequence[int]) -> str:
        return tokenizer.decode(list(piece), skip_special_tokens=True).rstrip("\ufffd")

    pieces = []
    for i in range(len(ids)):
        before, through = decode(ids[max(0, i - lookback) : i]), decode(ids[max(0, i - lookback) : i + 1])
        pieces.append(through[len(before) :] if through.startswith(before) else None)
    if None in pieces or "".join(pieces) != text:
        raise ValueError(
            f"{type(tokenizer).__name__} gives no character offsets and its token-by-token decoding does "
            "not reproduce the text (it normalizes the text), so tokens cannot be mapped to characters; "
            "use a fast tokenizer (use_fast=True) or the same tokenizer for both models"
        )
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.stack([ends - lengths, ends], axis=1)


def transfer_to_tokens(
    text: str,
    source_offsets: np.ndarray,
    source_values: np.ndarray,
    target_offsets: np.ndarray,
    reduce: str,
    skip_spaces: bool = True,
) -> np.ndarray:
    """Carry per-token values of one tokenization of ``text`` to another, through its characters.

    Each character takes the value of the source token that covers it (NaN if none). A target
    token reads its non-whitespace characters (all of them if it has only whitespace, or if
    ``skip_spaces=False``) and gets, as float array[target]:

    - ``reduce="all"``: 1.0 if every character read has value 1, else 0.0 — with source values 1 on
      key tokens, the key tokens of the evaluated model (App. A.1, eq. 9: its key tokens decode to
      text inside the evaluator's key text);
    - ``reduce="mean"``: the mean over the characters read that carry a value — the string-level
      weight average of eq. 10 (NaN if none does).

    Tokens with no characters (special tokens) get NaN.
    """
    if reduce not in ("all", "mean"):
        raise ValueError(f"reduce must be 'all' or 'mean', got {reduce!r}")
    chars = np.full(len(text), np.nan)
    for (start, end), value in zip(source_offsets, source_values, strict=True):
        chars[start:end] = value
    space = np.array([c.isspace() for c in text], dtype=bool) & skip_spaces
    result = np.full(len(target_offsets), np.nan)
    for i, (start, end) in enumerate(target_offsets):
        read = chars[start:end] if space[start:end].all() else chars[start:end][~space[start:end]]
        if len(read) == 0:
            continue
        if reduce == "all":
            result[i] = float(np.all(read == 1))
        elif not np.isnan(read).all():
            result[i] = np.nanmean(read)
    return result


def character_runs(offsets: np.ndarray, selected: np.ndarray) -> list[tuple[int, int]]:
    """Character spans of the selected tokens, touching spans merged: [(start, end), ...]."""
    runs: list[list[int]] = []
    for start, end in offsets[np.asarray(selected, dtype=bool)]:
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], int(end))
        else:
            runs.append([int(start), int(end)])
    return [tuple(run) for run in runs]


# --------------------------------------------------------------------------- LongPPL


@dataclass
class KeyTokens:
    """The evaluator's side of LongPPL for one text; reusable across evaluated models (offline mode).

    ``input_ids`` / ``offsets`` [seq] / [seq, 2] are the evaluator's tokens; ``lsd``, ``lcl``,
    ``soft`` (I_soft) are Tensor[seq] (NaN where undefined); ``key`` is BoolTensor[seq] (eq. 4).
    """

    text: str
    input_ids: torch.Tensor
    offsets: np.ndarray
    lsd: torch.Tensor
    lcl: torch.Tensor
    key: torch.Tensor
    soft: torch.Tensor
    settings: dict = field(default_factory=dict)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Character spans of the key tokens in ``text``, touching spans merged."""
        return character_runs(self.offsets, self.key.cpu().numpy())


def find_key_tokens(
    text: str,
    evaluator,
    evaluator_tokenizer: PreTrainedTokenizerBase,
    K: int = 4096,
    d: int = 1024,
    alpha: float = 2.0,
    beta: float = -2.0,
    gamma: float = 5.0,
    official: bool = False,
) -> KeyTokens:
    """Score ``text`` with the evaluator (eqs. 2–4, 7); its tokenizer adds its special tokens (BOS)."""
    ids, offsets = encode(evaluator_tokenizer, text)
    lsd, lcl = lsd_scores(evaluator, ids, K, d, official)
    settings = dict(K=K, d=d, alpha=alpha, beta=beta, gamma=gamma, official=official)
    key, soft = key_token_mask(lsd, lcl, alpha, beta), soft_influence(lsd, gamma)
    return KeyTokens(text, ids, offsets, lsd.cpu(), lcl.cpu(), key.cpu(), soft.cpu(), settings)


@dataclass(frozen=True)
class LongPPLResult:
    """LongPPL (eq. 4), LongPPL-soft (eq. 4 with I_soft), PPL (eq. 1) of one text.

    ``longppl`` is NaN when there is no key token. ``n_tokens`` counts the predicted tokens
    (official: the sequence length, first token included). ``key_spans``: the evaluator's key
    tokens as character spans of the text.
    """

    longppl: float
    longppl_soft: float
    ppl: float
    n_key_tokens: int
    n_tokens: int
    key_spans: list[tuple[int, int]]


@torch.no_grad()
def longppl(
    text: str,
    model,
    tokenizer: PreTrainedTokenizerBase,
    evaluator=None,
    evaluator_tokenizer: PreTrainedTokenizerBase | None = None,
    K: int = 4096,
    d: int = 1024,
    alpha: float = 2.0,
    beta: float = -2.0,
    gamma: float = 5.0,
    official: bool = False,
    key_tokens: KeyTokens | None = None,
) -> LongPPLResult:
    """LongPPL of ``model`` on ``text``, key tokens chosen by ``evaluator`` (default: ``model``).

    ``key_tokens`` from :func:`find_key_tokens` skips the evaluator. When both models tokenize the
    text identically the key tokens carry over one to one; otherwise through characters
    (:func:`transfer_to_tokens`). When the evaluator is the model itself its long pass is reused.
    ``official=True`` also tokenizes for the evaluated model without special tokens, matches by raw
    containment and counts ``n_tokens`` as the official package does.
    """
    if evaluator is not None and evaluator is not model and evaluator_tokenizer is None:
        raise ValueError("an evaluator model needs its evaluator_tokenizer")
    reuse = key_tokens is None and (evaluator is None or evaluator is model)
    if key_tokens is None:
        evaluator = model if evaluator is None else evaluator
        key_tokens = find_key_tokens(
            text, evaluator, evaluator_tokenizer or tokenizer, K, d, alpha, beta, gamma, official
        )
    elif key_tokens.text != text:
        raise ValueError("key_tokens were computed for a different text")
    ids, offsets = encode(tokenizer, text, add_special_tokens=not official)
    same_tokens = torch.equal(ids, key_tokens.input_ids)
    logprobs = key_tokens.lcl if reuse and same_tokens else long_logprobs(model, ids).target.cpu()
    if same_tokens:
        key, weights = key_tokens.key.numpy(), key_tokens.soft.numpy()
    else:
        hard_values = torch.where(key_tokens.lsd.isnan(), float("nan"), key_tokens.key.double()).numpy()
        transfer = dict(text=text, source_offsets=key_tokens.offsets, target_offsets=offsets)
        key = (
            transfer_to_tokens(source_values=hard_values, reduce="all", skip_spaces=not official, **transfer)
            == 1
        )
        weights = transfer_to_tokens(source_values=key_tokens.soft.numpy(), reduce="mean", **transfer)
    nll = -logprobs.double().numpy()
    key &= ~np.isnan(nll)  # a key token at position 0 has no prediction
    soft = ~np.isnan(weights) & ~np.isnan(nll)
    predicted = ~np.isnan(nll)
    return LongPPLResult(
        longppl=float(np.exp(nll[key].mean())) if key.any() else float("nan"),
        longppl_soft=float(np.exp((weights[soft] * nll[soft]).sum() / weights[soft].sum()))
        if soft.any()
        else float("nan"),
        ppl=float(np.exp(nll[predicted].mean())),
        n_key_tokens=int(key.sum()),
        n_tokens=len(ids) if official else int(predicted.sum()),
        key_spans=key_tokens.spans,
    )


# --------------------------------------------------------------------------- LongCE


def longce_weights(lsd: torch.Tensor, gamma: float = 5.0) -> torch.Tensor:
    """LongCE token weights (eq. 7), detached: min(exp(LSD), γ), and 1 where LSD is NaN (no short score)."""
    return torch.nan_to_num(soft_influence(lsd.detach(), gamma), nan=1.0)


def longce_loss(
    model, input_ids: torch.Tensor | Sequence[int], K: int = 4096, d: int = 1024, gamma: float = 5.0
) -> torch.Tensor:
    """LongCE (eq. 6): −1/(n−1) Σ_t w_t log P(x_t | x_<t), w = :func:`longce_weights` of the model's own LSD.

    The model scores itself (its short passes without gradients); the mean runs over all n−1
    predicted tokens and is not normalized by Σw, as in the paper. Gradients flow through the long
    pass only; its LM head is checkpointed per chunk.
    """
    ids = check_input_ids(model, input_ids)
    hidden = final_hidden_states(model, ids)[0, :-1]
    logprobs = target_logprobs(model, hidden, ids[0, 1:]).target
    short = short_logprobs(model, ids, K, d).target[1:]
    return -(longce_weights(logprobs - short, gamma) * logprobs).mean()
