"""The unit of a detector's cost: one plain forward pass over the same sample.

A detection's cost in forward-pass equivalents is ``detection.seconds / forward_seconds(model, sample)``,
both timed on the same machine in the same process, so the ratio carries across machines where the
seconds do not.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from probe.checks import hf_model
from probe.tasks import Sample


def forward_seconds(
    model, sample: Sample, clock: Callable[[], float] = time.perf_counter, logits_to_keep: int = 1
) -> float:
    """Seconds of one plain forward pass over ``sample`` by ``clock`` (wall time; ``time.process_time``
    for CPU time), best of two: the unit of a detector's cost in forward-pass equivalents.
    ``logits_to_keep``: the last rows projected to the vocabulary (0: every row, as the peers' unit)."""
    times = []
    for _ in range(2):
        start = clock()
        with torch.inference_mode():
            hf_model(model)(input_ids=sample.input_ids[None], use_cache=False, logits_to_keep=logits_to_keep)
        times.append(clock() - start)
    return min(times)
