"""Long-short difference, key tokens and LongPPL ("What is wrong with
perplexity for long-context language modeling?", ICLR 2025).

For the token x_t at position t of a sequence (t = 0 … n−1, predicted from x_<t):

- LCL(x_t) = log P(x_t | x_<t)                                  (eq. 3: long-context likelihood)
- LSD(x_t) = log P(x_t | x_<t) − log P(x_t | s_t)                (eq. 2: s_t a short, truncated context)
- key token: LSD > α and LCL > β, strict                        (eq. 4; α = 2, β = −2)
- LongPPL = exp(mean NLL of the key tokens), scored by the evaluated model while an evaluator
  model picks the key tokens (eq. 4); LongPPL-soft weights every token by I_soft instead
- I_soft = min(exp(LSD), γ)                                     (eq. 7; γ = 5)

The two log-probabilities come from :mod:`probe.probes.logprobs` (its docstring describes the sliding
short-context windows of App. A.1, eq. 8, and ``official=True``). When the evaluator is not the
evaluated model (App. A.1, eqs. 9–10), key tokens and weights travel between the tokenizations
through the characters of the text (:mod:`probe.probes.alignment`). A :class:`LongPPLResult` keeps the
per-token sums behind its scores, so :func:`pool_longppl` pools documents per token, as a
corpus-level LongPPL is defined. LongCE (eqs. 6–7) is in :mod:`probe.training.objectives`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedTokenizerBase

from probe.checks import hf_model
from probe.errors import InvalidTypeError, InvalidValueError
from probe.probes import alignment, logprobs
from probe.results import read_json, reading, write_json

__all__ = [
    "KeyTokens",
    "LongPPLResult",
    "find_key_tokens",
    "key_token_mask",
    "longppl",
    "lsd_scores",
    "pool_longppl",
    "soft_influence",
    "token_lsd",
]


def lsd_scores(
    model,
    input_ids: torch.Tensor | Sequence[int],
    K: int = 4096,
    d: int = 1024,
    official: bool = False,
    target_positions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LSD, LCL), each Tensor[seq] (eqs. 2–3), for ``input_ids`` [seq] or [1, seq].

    LSD is NaN where no short-context score exists (t ≤ K by default, t < K with ``official``);
    LCL is NaN only at t = 0. With ``target_positions`` (each ≥ 1) both are NaN outside them.
    """
    long = logprobs.long_logprobs(model, input_ids, target_positions)
    short = logprobs.short_logprobs(model, input_ids, K, d, official, target_positions=target_positions)
    return long.target - short.target, long.target


def key_token_mask(
    lsd: torch.Tensor, lcl: torch.Tensor, alpha: float = 2.0, beta: float = -2.0
) -> torch.Tensor:
    """I(x_t) of eq. 4, BoolTensor[seq] from Tensor[seq]s: LSD > α and LCL > β (strict, as in the paper
    and the official code); NaN → False."""
    return (lsd > alpha) & (lcl > beta)


def soft_influence(lsd: torch.Tensor, gamma: float = 5.0) -> torch.Tensor:
    """I_soft(x_t) = min(exp(LSD), γ) (eq. 7), Tensor[seq]; NaN stays NaN (no short-context score)."""
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
    long_logprob, short_logprob, lsd, lcl (eqs. 2–3), greedy (the long-context argmax).

    Log-probs are NaN where undefined (see :func:`lsd_scores`); settings are in ``frame.attrs``.
    """
    ids, offsets = alignment.encode(tokenizer, text)
    long = logprobs.long_logprobs(model, ids)
    short = logprobs.short_logprobs(model, ids, K, d, official)
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


def _model_name(model) -> str | None:
    """The last part of the model's ``name_or_path`` (``"smollm2-135m"``), ``None`` for unnamed models."""
    return Path(hf_model(model).config.name_or_path).name or None


# --------------------------------------------------------------------------- key tokens


@dataclass
class KeyTokens:
    """The evaluator's side of LongPPL for one text; reusable across evaluated models (offline mode).

    ``input_ids`` / ``offsets`` [seq] / [seq, 2] are the evaluator's tokens; ``lsd``, ``lcl``,
    ``soft`` (I_soft) are Tensor[seq] (NaN where undefined); ``key`` is BoolTensor[seq] (eq. 4).
    ``settings``: K, d, alpha, beta, gamma, official and the evaluator's name (``None`` if unknown).
    """

    text: str
    input_ids: torch.Tensor
    offsets: np.ndarray
    lsd: torch.Tensor
    lcl: torch.Tensor
    key: torch.Tensor
    soft: torch.Tensor
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Character spans of the key tokens in ``text``, touching spans merged."""
        return alignment.character_runs(self.offsets, self.key.cpu().numpy())

    def to_frame(self) -> pd.DataFrame:
        """One row per evaluator token: position, token_id, char_start, char_end, lsd, lcl, key, soft.

        The settings are in ``frame.attrs``.
        """
        frame = pd.DataFrame(
            {
                "position": np.arange(len(self.input_ids)),
                "token_id": self.input_ids.numpy(),
                "char_start": self.offsets[:, 0],
                "char_end": self.offsets[:, 1],
                "lsd": self.lsd.numpy(),
                "lcl": self.lcl.numpy(),
                "key": self.key.numpy(),
                "soft": self.soft.numpy(),
            }
        )
        frame.attrs = dict(self.settings)
        return frame

    def save(self, path: str | Path) -> None:
        """Write text, tokens, scores and settings as JSON (NaN as ``NaN``), atomically."""
        arrays = ("input_ids", "offsets", "lsd", "lcl", "key", "soft")
        record = {name: getattr(self, name).tolist() for name in arrays}
        write_json(path, record | {"text": self.text, "settings": self.settings})

    @classmethod
    def load(cls, path: str | Path) -> KeyTokens:
        """The key tokens :meth:`save` wrote."""
        record = read_json(path, "KeyTokens", ("text", "input_ids", "offsets", "lsd", "lcl", "key", "soft"))
        with reading(path, "KeyTokens"):
            return cls(
                text=record["text"],
                input_ids=torch.tensor(record["input_ids"], dtype=torch.long),
                offsets=np.asarray(record["offsets"], dtype=np.int64).reshape(-1, 2),
                lsd=torch.tensor(record["lsd"], dtype=torch.float32),
                lcl=torch.tensor(record["lcl"], dtype=torch.float32),
                key=torch.tensor(record["key"], dtype=torch.bool),
                soft=torch.tensor(record["soft"], dtype=torch.float32),
                settings=record["settings"],
            )


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
    ids, offsets = alignment.encode(evaluator_tokenizer, text)
    lsd, lcl = lsd_scores(evaluator, ids, K, d, official)
    settings = dict(
        K=K, d=d, alpha=alpha, beta=beta, gamma=gamma, official=official, evaluator=_model_name(evaluator)
    )
    key, soft = key_token_mask(lsd, lcl, alpha, beta), soft_influence(lsd, gamma)
    return KeyTokens(text, ids, offsets, lsd.cpu(), lcl.cpu(), key.cpu(), soft.cpu(), settings)


# --------------------------------------------------------------------------- LongPPL


@dataclass(frozen=True)
class LongPPLResult:
    """LongPPL (eq. 4), LongPPL-soft (eq. 4 with I_soft, eq. 7) and PPL (eq. 1) of one text or corpus.

    The result keeps the per-token sums its scores are ratios of, with nll_t = −log P(x_t | x_<t)
    of the evaluated model, so that documents pool per token (:func:`pool_longppl`):

    - ``nll_sum`` = Σ_t nll_t over the ``n_predicted`` predicted tokens (all but the first);
    - ``key_nll_sum`` = Σ nll_t over the ``n_key_tokens`` key tokens;
    - ``soft_nll_sum`` = Σ w_t·nll_t and ``soft_weight_sum`` = Σ w_t over the tokens with a weight
      w_t = I_soft (tokens without a short-context score carry none).

    ``n_tokens`` is the count reported (default: ``n_predicted``; official: the sequence length,
    first token included, as the official package counts). ``key_spans``: the evaluator's key tokens
    as character spans of the text (empty for a pooled result: its documents are different texts).
    ``settings``: K, d, alpha, beta, gamma, official, the evaluator's and the model's names
    (``None`` if unknown), and ``documents`` for a pooled result.
    """

    nll_sum: float
    n_predicted: int
    key_nll_sum: float
    n_key_tokens: int
    soft_nll_sum: float
    soft_weight_sum: float
    n_tokens: int
    key_spans: list[tuple[int, int]]
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def longppl(self) -> float:
        """exp(Σ_key nll / n_key) (eq. 4); NaN when there is no key token."""
        return float(np.exp(self.key_nll_sum / self.n_key_tokens)) if self.n_key_tokens else float("nan")

    @property
    def longppl_soft(self) -> float:
        """exp(Σ w·nll / Σ w), w = I_soft (eq. 7); NaN when no token has a weight."""
        if not self.soft_weight_sum:
            return float("nan")
        return float(np.exp(self.soft_nll_sum / self.soft_weight_sum))

    @property
    def ppl(self) -> float:
        """exp(Σ nll / n_predicted) (eq. 1)."""
        return float(np.exp(self.nll_sum / self.n_predicted)) if self.n_predicted else float("nan")

    @classmethod
    def from_tokens(
        cls,
        nll: np.ndarray,
        key: np.ndarray,
        weights: np.ndarray,
        n_tokens: int | None = None,
        key_spans: Sequence[tuple[int, int]] = (),
        settings: dict[str, Any] | None = None,
    ) -> LongPPLResult:
        """The result of one text from its per-token values, each array[seq] over the evaluated tokens.

        ``nll``: −log P(x_t | x_<t), NaN where not predicted (t = 0); ``key``: bool, the key tokens
        (eq. 4; unpredicted ones are dropped); ``weights``: I_soft (eq. 7), NaN where a token has
        none. ``n_tokens`` defaults to the number of predicted tokens.
        """
        predicted = ~np.isnan(nll)
        key = key & predicted  # a key token at position 0 has no prediction
        soft = ~np.isnan(weights) & predicted
        return cls(
            nll_sum=float(nll[predicted].sum()),
            n_predicted=int(predicted.sum()),
            key_nll_sum=float(nll[key].sum()),
            n_key_tokens=int(key.sum()),
            soft_nll_sum=float((weights[soft] * nll[soft]).sum()),
            soft_weight_sum=float(weights[soft].sum()),
            n_tokens=int(predicted.sum()) if n_tokens is None else n_tokens,
            key_spans=list(key_spans),
            settings=dict(settings or {}),
        )

    def to_frame(self) -> pd.DataFrame:
        """One row: longppl, longppl_soft, ppl, the counts and sums, n_key_spans, then the settings."""
        record = asdict(self)
        spans, settings = record.pop("key_spans"), record.pop("settings")
        scores = dict(longppl=self.longppl, longppl_soft=self.longppl_soft, ppl=self.ppl)
        return pd.DataFrame([scores | record | {"n_key_spans": len(spans)} | settings])

    def save(self, path: str | Path) -> None:
        """Write the sums, counts, key spans and settings as JSON, atomically."""
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: str | Path) -> LongPPLResult:
        """The result :meth:`save` wrote."""
        record = read_json(path, "LongPPLResult", [f.name for f in fields(cls)])
        with reading(path, "LongPPLResult"):
            return cls(**record | {"key_spans": [tuple(span) for span in record["key_spans"]]})


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
    (:func:`probe.probes.alignment.transfer_to_tokens`, App. A.1 eqs. 9–10). When the evaluator is the
    model itself its long pass is reused. ``official=True`` also tokenizes for the evaluated model
    without special tokens, matches by raw containment and counts ``n_tokens`` as the official
    package does. The result's settings are the key tokens' settings, this call's ``official`` and
    the model's name.
    """
    if evaluator is not None and evaluator is not model and evaluator_tokenizer is None:
        raise InvalidValueError("an evaluator model needs its evaluator_tokenizer")
    reuse = key_tokens is None and (evaluator is None or evaluator is model)
    if key_tokens is None:
        evaluator = model if evaluator is None else evaluator
        key_tokens = find_key_tokens(
            text, evaluator, evaluator_tokenizer or tokenizer, K, d, alpha, beta, gamma, official
        )
    elif key_tokens.text != text:
        raise InvalidValueError("key_tokens were computed for a different text")
    ids, offsets = alignment.encode(tokenizer, text, add_special_tokens=not official)
    same_tokens = torch.equal(ids, key_tokens.input_ids)
    lcl = key_tokens.lcl if reuse and same_tokens else logprobs.long_logprobs(model, ids).target.cpu()
    if same_tokens:
        key, weights = key_tokens.key.numpy(), key_tokens.soft.numpy()
    else:
        hard_values = torch.where(key_tokens.lsd.isnan(), float("nan"), key_tokens.key.double()).numpy()
        transfer = dict(text=text, source_offsets=key_tokens.offsets, target_offsets=offsets)
        key = (
            alignment.transfer_to_tokens(
                source_values=hard_values, reduce="all", skip_spaces=not official, **transfer
            )
            == 1
        )
        soft_values = key_tokens.soft.numpy()
        weights = alignment.transfer_to_tokens(source_values=soft_values, reduce="mean", **transfer)
    return LongPPLResult.from_tokens(
        nll=-lcl.double().numpy(),
        key=key,
        weights=weights,
        n_tokens=len(ids) if official else None,
        key_spans=key_tokens.spans,
        settings=key_tokens.settings | {"official": official, "model": _model_name(model)},
    )


def pool_longppl(results: Sequence[LongPPLResult]) -> LongPPLResult:
    """Corpus-level LongPPL, LongPPL-soft and PPL of several documents, pooled per token.

    Sums and counts add up over the documents, so LongPPL = exp(Σ_docs Σ_key nll / Σ_docs n_key)
    (the official corpus aggregation, ``perplexity.py`` after commit a7082c3), LongPPL-soft =
    exp(Σ w·nll / Σ w) and PPL = exp(Σ nll / Σ n_predicted) over all tokens of all documents: the
    scores of their concatenation, each token scored in its own document. (The official package
    weights log PPL by its ``n_tokens``, which counts each document's unpredicted first token.)
    The results must share their settings; the pooled one has ``settings["documents"]`` (pooled
    results count their documents) and no key spans.
    """
    if not isinstance(results, (list, tuple)) or not all(isinstance(r, LongPPLResult) for r in results):
        raise InvalidTypeError(f"results must be a list of probe.longppl's results, got {results!r:.60}")
    if not results:
        raise InvalidValueError("pool_longppl needs at least one result")

    def shared(result: LongPPLResult) -> dict[str, Any]:
        return {k: v for k, v in result.settings.items() if k != "documents"}

    settings = shared(results[0])
    differ = sorted({k for r in results for k, _ in shared(r).items() ^ settings.items()})
    if differ:
        raise InvalidValueError(f"results with different settings cannot be pooled; they differ in {differ}")
    counts = ("n_predicted", "n_key_tokens", "n_tokens")
    sums = ("nll_sum", "key_nll_sum", "soft_nll_sum", "soft_weight_sum")
    return LongPPLResult(
        **{name: sum(getattr(r, name) for r in results) for name in counts + sums},
        key_spans=[],
        settings=settings | {"documents": sum(r.settings.get("documents", 1) for r in results)},
    )
