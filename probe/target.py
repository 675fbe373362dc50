"""The target: the one number about the answer that every gradient probe explains and every ablation
measures, written once.

A target maps the answer rows' logits to a number: ``logits`` Tensor[k, vocab] (row t − 1 for each of
the k teacher-forced answer tokens t, at least fp32) and ``answer`` LongTensor[k] (those tokens) → a
0-d tensor, higher = more of what is explained. Every probe takes it as ``target=``:

- ``None`` (the default): :func:`answer_logprob`, Σ_t log p(x_t | x_<t), the answer's log-probability;
- :class:`Contrast` (``target=Contrast(foil)``): log p(answer) − log p(foil), for a foil answer of the
  same token length scored at the same rows — "why this answer rather than that one" (e.g. the
  interference fact's answer against the supported one), where the plain target asks "why any of it";
- :class:`AnswerToken` (``target=AnswerToken(t)``): log p of answer token t alone, one token of a
  multi-token answer at a time;
- any callable ``(logits, answer) -> 0-d tensor`` (inseq's ``attributed_fn``, captum's ``target``).

Gradient probes differentiate the loss −target / k (for the default: the mean cross-entropy of the
answer tokens, :func:`target_loss`); ablations (:mod:`probe.faithfulness`) report the
target itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from probe.checks import hf_model
from probe.errors import InvalidTypeError, InvalidValueError, OutOfRangeError

Target = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def answer_logprob(logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Σ_t log p(answer_t) from the answer rows' ``logits`` [k, vocab]: a 0-d tensor."""
    return logits.log_softmax(-1).gather(-1, answer[:, None].to(logits.device)).sum()


@dataclass(frozen=True)
class Contrast:
    """log p(answer) − log p(foil): ``foil`` LongTensor[k], a foil answer's token ids aligned with the
    answer's (same length; tokenize it as the answer is, e.g. with its leading space)."""

    foil: torch.Tensor

    def __post_init__(self):
        ids = _token_ids(self.foil)
        if ids is None:
            raise InvalidTypeError(
                f"a Contrast's foil is token ids, got {self.foil!r:.60}: tokenize the foil as the answer is "
                "tokenized, e.g. tokenizer(' Paris', add_special_tokens=False).input_ids"
            )
        if (ids < 0).any():
            raise InvalidValueError(f"a Contrast's foil holds negative token ids: {ids.tolist()}")

    def __call__(self, logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        foil = self.check(answer, logits.shape[-1])
        return answer_logprob(logits, answer) - answer_logprob(logits, foil.to(answer.device))

    def check(self, answer: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
        """The foil as LongTensor[k], refused unless it is another answer of the answer's length, in the
        model's vocabulary of ``vocab_size`` tokens where given."""
        foil = torch.as_tensor(self.foil, dtype=torch.long).reshape(-1)
        if vocab_size is not None and int(foil.max()) >= vocab_size:
            raise OutOfRangeError(
                f"the foil's token id {int(foil.max())} is outside the model's vocabulary of {vocab_size} "
                "tokens: tokenize the foil with the model's own tokenizer"
            )
        if foil.shape != answer.shape:
            raise InvalidValueError(
                f"the foil has {foil.numel()} tokens, the answer {answer.numel()}: a contrast compares "
                "two answers token by token at the same rows; use foils of the answer's token length"
            )
        if torch.equal(foil.cpu(), answer.cpu()):
            raise InvalidValueError(
                "the foil is the answer itself: the contrast log p(answer) − log p(foil) is identically 0 "
                "and every detector would rank noise; give a different foil"
            )
        return foil


@dataclass(frozen=True)
class AnswerToken:
    """log p(answer token ``index`` | x_<t) alone: one token of a multi-token answer explained by itself
    (``index`` from 0; negative counts from the end). The k targets ``AnswerToken(0..k-1)`` sum to the
    default, so a gradient probe's k results under them sum to its default result. Why explain the
    tokens apart: a token the model is sure of (p_t → 1) has ∂ log p_t → 0 and vanishes from the whole
    answer's gradient, though it may depend on the context as much as the others
    (``analyses/answer_token_split.py``)."""

    index: int

    def __post_init__(self):
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise InvalidTypeError(
                f"AnswerToken's index must be an int (0 = the first answer token), got {self.index!r}"
            )

    def __call__(self, logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
        t = self.check(answer)
        return logits[t].log_softmax(-1)[answer[t].to(logits.device)]

    def check(self, answer: torch.Tensor, vocab_size: int | None = None) -> int:
        """The index as a row of ``answer`` LongTensor[k], refused unless the answer has that token."""
        k = answer.numel()
        if not -k <= self.index < k:
            raise InvalidValueError(
                f"AnswerToken({self.index}) of an answer of {k} token(s): give an index from {-k} to {k - 1}"
            )
        return self.index % k


CHECKED = (Contrast, AnswerToken)  # compared by value, checked against each answer before any model work


def _token_ids(value) -> torch.Tensor | None:
    """``value`` as a 1-D LongTensor of token ids, or None where it is not non-empty integer ids (text,
    floats, booleans, nested lists)."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        return None
    if ids.dtype in (torch.bool,) or ids.is_floating_point() or ids.is_complex() or ids.numel() == 0:
        return None
    return ids.reshape(-1).long() if ids.ndim <= 1 else None


def vocabulary_size(model) -> int | None:
    """The number of tokens ``model``'s output layer scores (None for no model: a model-free detector)."""
    if model is None:
        return None
    return hf_model(model).get_output_embeddings().weight.shape[0]


def resolve(target: Target | None) -> Target:
    """``target`` as a callable (``None``: :func:`answer_logprob`), refusing anything else."""
    if target is None:
        return answer_logprob
    if not callable(target):
        raise InvalidTypeError(
            f"target must be None (the answer's log-probability), probe.target.Contrast(foil) or a "
            f"callable (logits [k, vocab], answer [k]) -> 0-d tensor, got {target!r}"
        )
    return target


def target_value(target: Target | None, logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The target of one sequence's answer rows (``logits`` [k, vocab] upcast to at least fp32)."""
    value = resolve(target)(logits.to(torch.promote_types(logits.dtype, torch.float32)), answer)
    if not (torch.is_tensor(value) and value.ndim == 0):
        raise InvalidTypeError(f"a target must return a 0-d tensor, got {value!r}")
    return value


def target_loss_of(target: Target | None, logits: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """The loss gradient probes differentiate: −target / k (the default: mean cross-entropy)."""
    return -target_value(target, logits, answer) / len(answer)


def describe(target: Target | None) -> str:
    """A target as the text a result records among its settings."""
    if target is None:
        return "answer_logprob"
    if isinstance(target, Contrast):
        return f"contrast(foil={torch.as_tensor(target.foil).reshape(-1).tolist()})"
    if isinstance(target, AnswerToken):
        return f"answer_token({target.index})"
    return getattr(target, "__qualname__", repr(target))


def target_of(
    model,
    input_ids: torch.Tensor,
    target_positions: torch.Tensor,
    target: Target | None = None,
    **forward_kwargs,
) -> torch.Tensor:
    """The target of the k tokens at ``target_positions``, each predicted from row ``t − 1`` in at
    least fp32 (the default: Σ_t log p(x_t | x_<t)): a 0-d tensor. ``input_ids``: LongTensor[1, seq]
    on the model's input device; ``forward_kwargs`` may pass ``inputs_embeds`` instead of ids.

    Only the needed rows are projected to the vocabulary (``logits_to_keep``), never the
    full ``[seq, vocab]`` logits.
    """
    if "inputs_embeds" not in forward_kwargs:
        forward_kwargs["input_ids"] = input_ids
    logits = hf_model(model)(use_cache=False, logits_to_keep=target_positions - 1, **forward_kwargs).logits
    return target_value(target, logits[0], input_ids[0, target_positions])


def target_loss(
    model,
    input_ids: torch.Tensor,
    target_positions: torch.Tensor,
    target: Target | None = None,
    **forward_kwargs,
) -> torch.Tensor:
    """The loss gradient probes differentiate, −:func:`target_of` / k (the default: the mean
    cross-entropy of the k tokens at ``target_positions``)."""
    from probe.checks import check_input_ids, check_positions

    if "inputs_embeds" not in forward_kwargs:
        input_ids = check_input_ids(model, input_ids)
    embeds = forward_kwargs.get("inputs_embeds")
    seq = embeds.shape[1] if embeds is not None else input_ids.shape[1]
    positions = check_positions(target_positions, seq, "target_positions", minimum=1).to(input_ids.device)
    return -target_of(model, input_ids, positions, target, **forward_kwargs) / len(positions)
