"""The controlled study of Wu et al. (ICML 2025, §5 and App. J): attention-only networks on in-context
classification (:mod:`probe.tasks.classification`).

:class:`AttentionOnly` is the paper's SAN: ``n_layers`` single-head attention layers of width ``dim``
(``W_Q, W_K, W_V``, no ``W_O``, no LayerNorm, no MLP between layers), an optional residual
``X ← X + A X W_V`` (else ``X ← A X W_V``), and an MLP readout (3 × [Linear + ReLU], then a linear map
to the labels) on the last (query) token. The attention graph is a mask (``full``, ``causal``,
``decay`` with ``A_ij ∝ γ^{i−j} e^{q·k}``, ``window``, ``prefix``); positions enter as ``none``,
``sin`` (sinusoids added to the input once) or ``rope`` (interleaved pairs, base 10000, all dims).

:func:`train` uses the paper's optimiser (AdamW, lr 1e-3, weight decay 1e-6, batch 128);
:func:`accuracy_gaps` measures the bias metric ``acc[a, b] − acc[b, a]`` on novel classes for the
first / middle / last items (item ``pairs // 2`` is the middle, as in the reference code).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap
from tqdm.auto import tqdm

from probe.errors import InvalidValueError
from probe.probes.position_bias import causal_mask
from probe.tasks.classification import Episodes, InContextClassification

MASKS = ("full", "causal", "decay", "window", "prefix")
ENCODINGS = ("none", "sin", "rope")


@dataclass(frozen=True)
class SANConfig:
    """One attention-only network; defaults are the paper's (d = 64, 32 labels, decay γ = 0.8).

    ``n_layers`` is the network's number of attention layers.
    """

    n_layers: int = 2
    mask: str = "causal"
    pe: str = "none"
    residual: bool = False
    dim: int = 64
    labels: int = 32
    gamma: float = 0.8
    window: int = 5
    prefix: int = 2

    def __post_init__(self) -> None:
        if self.mask not in MASKS:
            raise InvalidValueError(f"mask must be one of {MASKS}, got {self.mask!r}")
        if self.pe not in ENCODINGS:
            raise InvalidValueError(f"pe must be one of {ENCODINGS}, got {self.pe!r}")
        if self.n_layers < 1:
            raise InvalidValueError(f"n_layers must be at least 1, got {self.n_layers}")


def log_mask(config: SANConfig, seq: int) -> torch.Tensor:
    """Additive mask [seq, seq]: log of the 0/1 graph, plus ``(i − j) log γ`` on its edges for ``decay``."""
    if config.mask == "full":
        allowed = torch.ones(seq, seq, dtype=torch.bool)
    else:
        allowed = causal_mask(
            seq,
            window=config.window if config.mask == "window" else None,
            prefix=config.prefix if config.mask == "prefix" else 0,
        )
    distance = (torch.arange(seq)[:, None] - torch.arange(seq)[None]).float()
    scores = distance * math.log(config.gamma) if config.mask == "decay" else torch.zeros(seq, seq)
    return scores.masked_fill(~allowed, float("-inf"))


def sinusoids(seq: int, dim: int) -> torch.Tensor:
    """Vaswani et al. positional encodings [seq, dim]: sin on even, cos on odd dimensions."""
    angles = torch.arange(seq)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """RoPE on x [..., seq, dim]: interleaved pairs (2p, 2p+1) turned by ``pos · 10000^{−2p/dim}``."""
    seq, dim = x.shape[-2:]
    angles = torch.arange(seq)[:, None] / 10000 ** (torch.arange(0, dim, 2) / dim)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class AttentionOnly(nn.Module):
    """Wu et al.'s SAN: x [batch, seq, dim] → (logits [batch, labels], A [batch, n_layers, seq, seq]).

    ``A[:, t]`` is layer ``t``'s attention ``A^(t)``; without residuals the query's representation
    is ``(A^(t) … A^(0) X^(0) W_V^(0) … W_V^(t))_query`` (eq. 4) before the readout.
    """

    def __init__(self, config: SANConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.dim
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim, bias=False) for _ in range(config.n_layers))
        self.readout = nn.Sequential(
            *(module for _ in range(3) for module in (nn.Linear(dim, dim), nn.ReLU())),
            nn.Linear(dim, config.labels),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq, dim = x.shape[-2:]
        mask = log_mask(self.config, seq)
        if self.config.pe == "sin":
            x = x + sinusoids(seq, dim)
        patterns = []
        for qkv in self.qkv:
            q, k, v = qkv(x).chunk(3, dim=-1)
            if self.config.pe == "rope":
                q, k = rotate(q), rotate(k)
            attention = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dim) + mask, dim=-1)
            update = attention @ v
            x = x + update if self.config.residual else update
            patterns.append(attention)
        return self.readout(x[:, -1]), torch.stack(patterns, dim=1)


def train(
    model: AttentionOnly,
    task: InContextClassification,
    steps: int,
    answer_positions: Sequence[int] | None = None,
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 1e-6,
    data: Episodes | None = None,
    progress: bool = False,
) -> list[float]:
    """Train with cross-entropy on the query's label; data biased to ``answer_positions`` if given.

    ``data``: a pre-drawn training set (e.g. ``task.batch(50_000)``) cycled through in mini-batches
    instead of fresh sequences every step, as the paper does; drawing once is much faster on CPU and
    lets several models share one set. Returns the loss of every step.
    """
    if data is not None and answer_positions is not None:
        raise InvalidValueError("answer_positions is fixed when data is drawn; give one or the other")
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    losses = []
    for step in tqdm(range(steps), disable=not progress, desc="train", leave=False):
        if data is None:
            inputs, targets = (batch := task.batch(batch_size, answer_positions)).inputs, batch.targets
        else:
            start = step * batch_size % (len(data.targets) - batch_size + 1)
            inputs, targets = (
                data.inputs[start : start + batch_size],
                data.targets[start : start + batch_size],
            )
        logits, _ = model(inputs)
        loss = nn.functional.cross_entropy(logits, targets)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    model.eval()
    return losses


def train_together(
    models: Sequence[AttentionOnly],
    tasks: Sequence[InContextClassification],
    steps: int,
    batch_size: int = 128,
    lr: float = 1e-3,
    weight_decay: float = 1e-6,
    data: Sequence[Episodes] | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Train networks of one architecture side by side, each as :func:`train` would alone.

    Network ``i`` learns ``tasks[i]`` (fresh batches every step) or cycles through ``data[i]``. The
    parameters are stacked to ``[networks, ...]`` (:func:`torch.func.stack_module_state`) and one
    vmapped forward runs them all; the summed loss gives each network its own gradient, and AdamW
    acts element by element, so each follows the trajectory it would follow alone (tested). The
    trained weights are written back into ``models``. Returns the losses ``[steps, networks]``.
    """
    if len({model.config for model in models}) != 1:
        raise InvalidValueError(
            "train_together stacks networks of one SANConfig; train other configs separately"
        )
    if len(tasks) != len(models) or (data is not None and len(data) != len(models)):
        raise InvalidValueError(f"need one task (and one data set) per network: {len(models)} networks")
    params, buffers = stack_module_state(list(models))
    template = copy.deepcopy(models[0]).to("meta")

    def loss(params: dict, buffers: dict, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, _ = functional_call(template, (params, buffers), (inputs,))
        return nn.functional.cross_entropy(logits, targets)

    losses_of = vmap(loss)
    optimiser = torch.optim.AdamW(params.values(), lr=lr, weight_decay=weight_decay)
    losses = torch.empty(steps, len(models))
    for step in tqdm(range(steps), disable=not progress, desc="train", leave=False):
        if data is None:
            batches = [task.batch(batch_size) for task in tasks]
        else:
            batches = [
                Episodes(
                    pool.inputs[start : start + batch_size], pool.targets[start : start + batch_size], None
                )
                for pool in data
                for start in [step * batch_size % (len(pool.targets) - batch_size + 1)]
            ]
        inputs, targets = torch.stack([b.inputs for b in batches]), torch.stack([b.targets for b in batches])
        step_losses = losses_of(params, buffers, inputs, targets)
        optimiser.zero_grad()
        step_losses.sum().backward()
        optimiser.step()
        losses[step] = step_losses.detach()
    with torch.no_grad():
        for i, model in enumerate(models):
            model.load_state_dict({name: value[i] for name, value in (params | buffers).items()})
            model.eval()
    return losses


def position_names(pairs: int) -> dict[str, int]:
    """The paper's item positions: first, middle (``pairs // 2``) and last."""
    return {"first": 0, "middle": pairs // 2, "last": pairs - 1}


@torch.no_grad()
def accuracy_gaps(model: AttentionOnly, task: InContextClassification, size: int = 2000) -> pd.DataFrame:
    """The bias metric on novel classes: per pair ``acc_ab``, ``acc_ba`` and ``gap = acc_ab − acc_ba``.

    ``acc_ab`` is the accuracy on test set ``[a, b]``: answer at item ``a``, an exact copy of it at ``b``.
    """
    positions = position_names(task.config.pairs)

    def accuracy(answer: int, copy: int) -> float:
        batch = task.test_batch(size, answer, copy)
        return (model(batch.inputs)[0].argmax(-1) == batch.targets).float().mean().item()

    rows = []
    for a, b in (("first", "middle"), ("first", "last"), ("middle", "last")):
        acc_ab = accuracy(positions[a], positions[b])
        acc_ba = accuracy(positions[b], positions[a])
        rows.append({"pair": f"{a} vs {b}", "acc_ab": acc_ab, "acc_ba": acc_ba, "gap": acc_ab - acc_ba})
    return pd.DataFrame(rows)
