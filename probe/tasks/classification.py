"""In-context classification for the position-bias study (Wu et al., ICML 2025, App. J; after Reddy 2024).

A sequence is ``x_1, y_1, ..., x_n, y_n, x_query``: ``2n + 1`` vectors of dimension ``dim`` fed to
attention directly (no embedding). Items are noisy class means, ``x = (mu_c + eps * eta) / sqrt(1 +
eps^2)``; each class has a label in ``[0, labels)`` and labels are fixed random vectors. Each
sequence draws ``n / burstiness`` classes, repeats each ``burstiness`` times and shuffles them; the
query is a fresh sample of the class of the item at the *answer position* (uniform, or drawn from
a list to bias the data). The target is that class's label.

Test set ``[a, b]`` (the bias metric ``acc[a, b] - acc[b, a]``): novel classes (new means and
labels for every sequence), answer at item ``a``, and item ``b`` overwritten with an exact copy of
``x_a`` (its label left unchanged), so a model that prefers position ``a`` answers correctly.

Vectors follow the paper's text (components with variance ``1 / dim``); the reference code uses
standard deviation ``1 / dim`` instead. ``fixed_vocabulary=lam`` mixes one shared vector ``omega``
into every item, ``x = (mu_c + lam * omega) / sqrt(1 + lam^2)`` (App. J's fixed-vocabulary variant,
lambda = 0.75). Item positions are 0-indexed: item ``i`` is token ``2 i``, its label token ``2 i + 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probe.errors import InvalidValueError


@dataclass(frozen=True)
class Config:
    """Task sizes; defaults are the paper's (App. J): n = 8 pairs, d = 64, K = 2048, L = 32, B = 4."""

    pairs: int = 8
    dim: int = 64
    classes: int = 2048
    labels: int = 32
    burstiness: int = 4
    eps: float = 0.75
    fixed_vocabulary: float | None = None


@dataclass
class Episodes:
    """A batch of episodes: ``inputs`` [batch, 2 * pairs + 1, dim], ``targets`` [batch] labels,
    ``answer_position`` [batch]."""

    inputs: torch.Tensor
    targets: torch.Tensor
    answer_position: torch.Tensor


class InContextClassification:
    """The training distribution (fixed classes) and the novel-class test sets of one task instance."""

    def __init__(self, config: Config = Config(), seed: int = 0) -> None:
        if config.pairs % config.burstiness:
            raise InvalidValueError(
                f"pairs ({config.pairs}) must be a multiple of burstiness ({config.burstiness})"
            )
        self.config = config
        self.generator = torch.Generator().manual_seed(seed)
        self.class_means = self._vectors(config.classes)
        self.class_labels = torch.randint(config.labels, (config.classes,), generator=self.generator)
        self.label_vectors = self._vectors(config.labels)
        self.omega = self._vectors(1)[0]

    def batch(self, size: int, answer_positions: Sequence[int] | None = None) -> Episodes:
        """Training sequences; answer position uniform over items, or drawn from ``answer_positions``."""
        n_classes = self.config.pairs // self.config.burstiness
        chosen = torch.stack(
            [torch.randperm(self.config.classes, generator=self.generator)[:n_classes] for _ in range(size)]
        )
        return self._sequences(self.class_means[chosen], self.class_labels[chosen], answer_positions)

    def test_batch(self, size: int, answer: int, copy: int) -> Episodes:
        """Test set ``[answer, copy]``: novel classes, answer at item ``answer``, copied to item ``copy``."""
        if answer == copy or not all(0 <= p < self.config.pairs for p in (answer, copy)):
            raise InvalidValueError(
                f"need two different items in [0, {self.config.pairs}), got {answer}, {copy}"
            )
        n_classes = self.config.pairs // self.config.burstiness
        means = self._vectors(size * n_classes).view(size, n_classes, -1)
        labels = torch.randint(self.config.labels, (size, n_classes), generator=self.generator)
        batch = self._sequences(means, labels, [answer])
        batch.inputs[:, 2 * copy] = batch.inputs[:, 2 * answer]
        return batch

    def _sequences(
        self, means: torch.Tensor, labels: torch.Tensor, answer_positions: Sequence[int] | None
    ) -> Episodes:
        """Sequences from per-sequence class ``means`` [size, classes, dim] and ``labels`` [size, classes]."""
        size, n_classes, dim = means.shape
        order = (
            torch.stack([torch.randperm(self.config.pairs, generator=self.generator) for _ in range(size)])
            % n_classes
        )  # each class exactly `burstiness` times, shuffled
        if answer_positions is None:
            answer = torch.randint(self.config.pairs, (size,), generator=self.generator)
        else:
            choices = torch.as_tensor(answer_positions)
            answer = choices[torch.randint(len(choices), (size,), generator=self.generator)]
        item_classes = torch.cat([order, order.gather(1, answer[:, None])], dim=1)  # [size, pairs + 1]
        items = self._items(means.gather(1, item_classes[..., None].expand(-1, -1, dim)))
        item_labels = labels.gather(1, item_classes)
        inputs = torch.empty(size, 2 * self.config.pairs + 1, dim)
        inputs[:, 0:-1:2] = items[:, :-1]
        inputs[:, 1::2] = self.label_vectors[item_labels[:, :-1]]
        inputs[:, -1] = items[:, -1]
        return Episodes(inputs=inputs, targets=item_labels[:, -1], answer_position=answer)

    def _items(self, means: torch.Tensor) -> torch.Tensor:
        """Noisy samples of ``means`` [..., dim] (or the fixed-vocabulary mix)."""
        lam = self.config.fixed_vocabulary
        if lam is not None:
            return (means + lam * self.omega) / (1 + lam**2) ** 0.5
        noise = self._vectors(means[..., 0].numel()).view_as(means)
        return (means + self.config.eps * noise) / (1 + self.config.eps**2) ** 0.5

    def _vectors(self, count: int) -> torch.Tensor:
        """``count`` random vectors [count, dim] with i.i.d. components of variance 1 / dim."""
        return torch.randn(count, self.config.dim, generator=self.generator) / self.config.dim**0.5
