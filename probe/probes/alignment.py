"""Tokenizer alignment: carry per-token values from one tokenization of a text to another.

When the evaluator that picks LongPPL's key tokens is not the evaluated model (Fang et al. 2025, App. A.1,
eqs. 9–10), values travel between the two tokenizations through the characters of the text. Our
default reads only the non-whitespace characters of a token, so the leading-space conventions of
different tokenizers do not matter; ``skip_spaces=False`` requires plain containment of the
token's raw character span, as the official code does. Tokenizers that give no offsets get them
rebuilt by decoding (:func:`decoded_offsets`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from probe.checks import check_text, check_tokenizer
from probe.errors import InvalidValueError

__all__ = ["character_runs", "decoded_offsets", "encode", "transfer_to_tokens"]


def encode(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True
) -> tuple[torch.Tensor, np.ndarray]:
    """``text`` as LongTensor[seq] ids and int array[seq, 2] character offsets (end exclusive).

    Tokenizers that give no offsets (tiktoken-based ones raise ``NotImplementedError``, Python
    "slow" tokenizers silently omit them) get offsets from :func:`decoded_offsets`.
    """
    check_tokenizer(tokenizer)
    check_text(text, "text")
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
    """Character offsets [seq, 2] of ``ids`` [seq] rebuilt by decoding, for tokenizers without offsets.

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
        raise InvalidValueError(
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

    ``source_offsets`` [source, 2] and ``source_values`` [source] describe the source tokens,
    ``target_offsets`` [target, 2] the target tokens. Each character takes the value of the source
    token that covers it (NaN if none). A target token reads its non-whitespace characters (all of
    them if it has only whitespace, or if ``skip_spaces=False``) and gets, as float array[target]:

    - ``reduce="all"``: 1.0 if every character read has value 1, else 0.0 — with source values 1 on
      key tokens, the key tokens of the evaluated model (App. A.1, eq. 9: its key tokens decode to
      text inside the evaluator's key text);
    - ``reduce="mean"``: the mean over the characters read that carry a value — the string-level
      weight average of eq. 10 (NaN if none does).

    Tokens with no characters (special tokens) get NaN.
    """
    if reduce not in ("all", "mean"):
        raise InvalidValueError(f"reduce must be 'all' or 'mean', got {reduce!r}")
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
    """Character spans of the selected tokens (``offsets`` [seq, 2], ``selected`` bool [seq]), touching
    spans merged: [(start, end), ...]."""
    runs: list[list[int]] = []
    for start, end in offsets[np.asarray(selected, dtype=bool)]:
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], int(end))
        else:
            runs.append([int(start), int(end)])
    return [tuple(run) for run in runs]
