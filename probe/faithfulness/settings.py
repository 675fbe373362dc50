"""The settings of a faithfulness judgement, as two small frozen objects: what it measures
(:class:`Judgement`, checked when made, so that a bad setting is refused before any model work) and how
its masked passes run (:class:`Passes`, checked by :func:`probe.faithfulness.answer_scores` before its
first pass)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from probe.errors import InvalidValueError
from probe.faithfulness.masks import KS
from probe.target import Target


@dataclass(frozen=True)
class Judgement:
    """What :func:`probe.faithfulness.evaluate` measures.

    ``ks``: the numbers of top sources removed / kept (comprehensiveness, sufficiency, their AOPC);
    ``n_masks`` random masks for LDS, each source kept with probability ``keep``, drawn from ``seed``;
    ``ceiling_masks`` > 0: the ``additive_ceiling`` reference fit on that many further random masks
    (seeded apart; 0: none; the studies use 256).
    """

    ks: Sequence[int] = KS
    n_masks: int = 32
    keep: float = 0.5
    seed: int = 0
    ceiling_masks: int = 0

    def __post_init__(self) -> None:
        ks = tuple(self.ks)
        if not ks or any(isinstance(k, bool) or int(k) != k or k < 1 for k in ks):
            raise InvalidValueError(f"ks must be a non-empty list of positive integers, got {list(ks)}")
        n_masks, ceiling_masks = self.n_masks, self.ceiling_masks
        if isinstance(n_masks, bool) or int(n_masks) != n_masks or n_masks < 2:
            raise InvalidValueError(
                f"n_masks must be an integer >= 2 (LDS is a rank correlation over masks), got {n_masks}"
            )
        if isinstance(ceiling_masks, bool) or int(ceiling_masks) != ceiling_masks or ceiling_masks < 0:
            raise InvalidValueError(f"ceiling_masks must be a non-negative integer, got {ceiling_masks}")
        object.__setattr__(self, "ks", ks)  # frozen: a tuple, so that a judgement is hashable


@dataclass(frozen=True)
class Passes:
    """How masked passes run: the options of :func:`probe.faithfulness.answer_scores`.

    ``reuse_prefix``: each pass starts from the KV cache of the unmasked prefix before its first removed
    token (exact), else from the first token; ``batch_size`` masks a forward; ``compact``: only the kept
    tokens run, at their original positions (None: where the model takes ``position_ids``), else the
    removed ones are key-masked; ``target``: the number measured (None: the gold answer's
    log-probability, :mod:`probe.target`).
    """

    reuse_prefix: bool = True
    batch_size: int = 1
    compact: bool | None = None
    target: Target | None = None
