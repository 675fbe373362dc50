"""Changes to a model that concurrent probes share: made once for every block that needs them, undone
when the last one leaves.

The concurrency contract: probes may run on one model from several threads at once; the model's
attention implementation, train/eval mode and every ``requires_grad`` are longprobe's while any
probe runs, and exactly as found once the last one has returned — also after an exception.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_LOCK = threading.Lock()
_SHARED: dict[tuple[int, str], list] = {}  # (id(model), what) -> [blocks inside, what restore needs]


@contextmanager
def shared_change(
    model: torch.nn.Module, what: str, apply: Callable[[], Any], restore: Callable[[Any], None]
):
    """Change ``model`` once for every block that needs the change ``what`` at the same time, and undo
    it when the last one leaves (blocks in several threads, nested blocks, exceptions).
    ``apply()`` makes the change and returns what ``restore`` needs to undo it."""
    key = (id(model), what)
    with _LOCK:
        if key in _SHARED:
            _SHARED[key][0] += 1
        else:
            _SHARED[key] = [1, apply()]
    try:
        yield
    finally:
        with _LOCK:
            entry = _SHARED[key]
            entry[0] -= 1
            if entry[0] == 0:
                del _SHARED[key]
                restore(entry[1])


@contextmanager
def frozen_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Turn off parameter gradients (and dropout) for the block; restore both afterwards
    (thread-safe and re-entrant, see :func:`shared_change`)."""

    def freeze() -> tuple[list, bool]:
        saved = [(p, p.requires_grad) for p in model.parameters()], model.training
        model.requires_grad_(False)
        model.eval()
        return saved

    def thaw(saved: tuple[list, bool]) -> None:
        flags, was_training = saved
        for param, flag in flags:
            param.requires_grad_(flag)
        model.train(was_training)

    with shared_change(model, "frozen", freeze, thaw):
        yield
