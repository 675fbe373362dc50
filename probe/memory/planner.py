"""Memory planner and guard: predicted peak memory of one probe call, from the model's shapes.

:func:`plan` predicts the peak bytes a probe allocates *above the loaded model* (weights excluded)
from the model's configuration (layers, hidden, intermediate, heads, KV heads, head dim, vocab,
dtype, sliding windows, which norms a decoder layer has) and the probe's settings (sequence length,
target rows, batch, captured layers, checkpointing). No measured peak is looked up: every term is
a count of tensors of known shape. :meth:`Plan.check` compares the prediction with the free memory
and raises :class:`InsufficientMemoryError` (a :class:`MemoryError`) with the numbers and the advice before
anything is allocated;
:func:`guard` resolves ``checkpoint="auto"`` and checks in one call (what a probe calls first).

The terms and their formulas, and what each probe's pass keeps (:class:`~probe.memory.passes.ProbePass`),
are in :mod:`probe.memory.passes`. Probes: ``"information_flow"``,
``"answer_attribution"`` (information flow + embedding gradients from one pass), ``"embedding_grads"``
(= ``"embedding_grad_norms"``), ``"attention_rows"`` (no backward) and ``"forward"`` (a no-grad
forward projecting ``rows`` rows to the vocabulary). Validated against peak RSS in
``bench/planner_validation.py`` (README table).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from probe.attention import Modifier, active_modifiers
from probe.checks import check_int, input_device
from probe.errors import InsufficientMemoryError, InvalidValueError, OutOfRangeError
from probe.memory import available_memory, compact_heap
from probe.memory.checkpointing import checkpointed
from probe.memory.passes import PROBE_PASSES, ProbePass
from probe.shapes import Shapes

__all__ = [
    "PROBE_PASSES",
    "Plan",
    "Shapes",
    "InsufficientMemoryError",
    "auto_checkpoint",
    "available_memory",
    "compact_heap",
    "guard",
    "guarded",
    "plan",
]


_GIB = 2**30


@dataclass(frozen=True)
class Plan:
    """Predicted peak memory of one probe call above the loaded model, as named terms (bytes).

    ``terms`` are the terms of the phase with the largest total (``phase``); ``phases`` holds every
    phase's terms. ``total`` = ``sum(terms.values())``.
    """

    probe: str
    seq_len: int
    rows: int
    batch: int
    checkpoint: bool
    layers: tuple[int, ...]
    device: str
    dtype_bytes: int
    phase: str
    terms: dict[str, int]
    phases: dict[str, dict[str, int]] = field(repr=False)
    checkpointed_total: int | None = None  # the same call with checkpoint=True (gradient probes)

    @property
    def total(self) -> int:
        """Predicted peak bytes: the sum of :attr:`terms`."""
        return sum(self.terms.values())

    def __str__(self) -> str:
        head = (
            f"{self.probe} on {self.seq_len} tokens, {self.rows} rows, batch {self.batch}, "
            f"{len(self.layers)} layers, checkpoint={self.checkpoint} ({self.device}): "
            f"≈ {_gib(self.total)} at the {self.phase} peak"
        )
        width = max(len(name) for name in self.terms)
        lines = [f"  {name:<{width}}  {_gib(value):>10}" for name, value in self.terms.items() if value]
        return "\n".join([head, *lines])

    def to_frame(self):
        """DataFrame with one row per term: ``term``, ``bytes``, ``gib``, ``share`` of the total."""
        import pandas as pd

        frame = pd.DataFrame({"term": list(self.terms), "bytes": list(self.terms.values())})
        return frame.assign(gib=frame["bytes"] / _GIB, share=frame["bytes"] / max(self.total, 1))

    def check(self, available_bytes: int | None = None) -> Plan:
        """Raise :class:`InsufficientMemoryError` if :attr:`total` exceeds the free memory; return ``self``.

        ``available_bytes``: defaults to :func:`available_memory` of the plan's device (skipped,
        silently, where that cannot be read).
        """
        available = available_memory(self.device) if available_bytes is None else available_bytes
        if available is None or self.total <= available:
            return self
        largest = sorted(self.terms.items(), key=lambda item: -item[1])[:3]
        detail = ", ".join(f"{name} {_gib(value)}" for name, value in largest)
        if self.checkpointed_total is not None and not self.checkpoint:
            fits = "" if self.checkpointed_total <= available else ", also too much"
            advice = (
                f"pass checkpoint=True (≈ {_gib(self.checkpointed_total)}{fits}), fewer layers, "
                "or a shorter input"
            )
        else:
            advice = "fewer layers or target rows, a smaller batch, or a shorter input"
        raise InsufficientMemoryError(
            f"{self.probe} on {self.seq_len} tokens needs ≈ {_gib(self.total)}, {_gib(available)} free: "
            f"{advice} ({detail}; see probe.memory.planner.plan(...))",
            self,
            available,
        )


def plan(
    model,
    seq_len: int,
    probe: str = "information_flow",
    rows: int = 16,
    batch: int = 1,
    checkpoint: bool = False,
    layers: Sequence[int] | None = None,
    modifiers: Sequence[Modifier] = (),
) -> Plan:
    """Predicted peak bytes above the loaded model of one call of ``probe`` (see the module docstring).

    Args:
        model: a loaded Hugging Face causal LM, or its config (then dtype from the config, CPU).
        seq_len: tokens per sequence (the padded length for a batch).
        probe: one of :data:`~probe.memory.passes.PROBE_PASSES` (its pass's declaration).
        rows: target rows (the loss's target tokens; the captured query rows; for ``"forward"``
            the rows projected to the vocabulary).
        batch: sequences per call; ``> 1`` is assumed padded (every layer then gets a mask).
        checkpoint: decoder layers recomputed in the backward
        (:func:`probe.memory.checkpointing.checkpointed`).
        layers: captured layers (``None`` = all; negative indices allowed).
        modifiers: the attention modifiers active during the call (:mod:`probe.attention`): one that
            changes scores, masks or positions gives every layer a mask, and each adds its own terms
            (:meth:`~probe.attention.Modifier.memory`) to every phase.
    """
    declared = _declared(probe)
    seq_len, rows, batch = (check_int(value, name, 1) for value, name in
                            ((seq_len, "seq_len"), (rows, "rows"), (batch, "batch")))  # fmt: skip
    shapes = model if isinstance(model, Shapes) else Shapes.of(model)
    captured = _check_layers(layers, shapes.layers)
    masked = any(modifier.masks_every_layer(shapes, modifiers) for modifier in modifiers)
    found = declared.memory(shapes, seq_len, rows, batch, bool(checkpoint), captured, masked, bool(modifiers))
    for modifier in modifiers:
        for term, size in modifier.memory(shapes, seq_len, batch, bool(checkpoint), modifiers).items():
            for terms in found.values():
                terms[term] = terms.get(term, 0) + size
    phase = max(found, key=lambda key: sum(found[key].values()))
    alternative = None
    if declared.backward and not checkpoint:
        alternative = plan(shapes, seq_len, probe, rows, batch, True, captured, modifiers).total
    return Plan(
        probe=probe,
        seq_len=seq_len,
        rows=rows,
        batch=batch,
        checkpoint=bool(checkpoint) and declared.backward,
        layers=tuple(captured),
        device=shapes.device,
        dtype_bytes=shapes.act_bytes,
        phase=phase,
        terms=found[phase],
        phases=found,
        checkpointed_total=alternative,
    )


def _declared(probe: str) -> ProbePass:
    """The declared pass of ``probe``; the one place an unknown probe is refused."""
    if probe not in PROBE_PASSES:
        raise InvalidValueError(f"unknown probe {probe!r}; plan one of {', '.join(PROBE_PASSES)}")
    return PROBE_PASSES[probe]


def _check_layers(layers: Sequence[int] | None, total: int) -> list[int]:
    chosen = list(range(total)) if layers is None else list(layers)
    bad = [layer for layer in chosen if not -total <= layer < total]
    if bad or not chosen:
        raise OutOfRangeError(f"layers {bad or chosen} out of range for a {total}-layer model")
    return sorted({layer % total for layer in chosen})


def auto_checkpoint(
    model,
    seq_len: int,
    probe: str = "information_flow",
    rows: int = 16,
    batch: int = 1,
    layers: Sequence[int] | None = None,
    modifiers: Sequence[Modifier] = (),
    available_bytes: int | None = None,
) -> bool:
    """``checkpoint="auto"``: True when the plain pass does not fit the free memory but the
    checkpointed one does. False for probes without a backward, or when the free memory is unknown.
    """
    if not _declared(probe).backward:
        return False
    available = _available(model, available_bytes)
    if available is None:
        return False
    plain = plan(model, seq_len, probe, rows, batch, False, layers, modifiers)
    return plain.total > available >= (plain.checkpointed_total or 0)


def guard(
    model,
    seq_len: int,
    probe: str = "information_flow",
    checkpoint: bool | str = False,
    rows: int = 16,
    batch: int = 1,
    layers: Sequence[int] | None = None,
    modifiers: Sequence[Modifier] = (),
    available_bytes: int | None = None,
) -> bool:
    """What a probe calls before allocating: resolve ``checkpoint`` and check the plan.

    ``checkpoint="auto"`` becomes :func:`auto_checkpoint` — and True as well when neither pass fits,
    so that the error reports the smaller need. Raises :class:`InsufficientMemoryError` (see
    :meth:`Plan.check`) when the resolved plan does not fit; returns the resolved ``checkpoint`` flag.
    """
    available = _available(model, available_bytes)
    if checkpoint == "auto":  # on whenever the plain pass does not fit (also when neither does)
        resolved = (
            _declared(probe).backward
            and available is not None
            and plan(model, seq_len, probe, rows, batch, False, layers, modifiers).total > available
        )
    elif isinstance(checkpoint, bool):
        resolved = checkpoint
    else:
        raise InvalidValueError(f"checkpoint must be True, False or 'auto', got {checkpoint!r}")
    plan(model, seq_len, probe, rows, batch, resolved, layers, modifiers).check(
        available if available is not None else 2**62
    )
    return resolved


@contextmanager
def guarded(
    model,
    seq_len: int,
    probe: str,
    checkpoint: bool | str = "auto",
    rows: int = 16,
    batch: int = 1,
    layers: Sequence[int] | None = None,
) -> Iterator[bool]:
    """The block a probe runs its pass in: :func:`guard` (with the modifiers active here, each
    asked for its memory), then :func:`probe.memory.checkpointing.checkpointed` if the resolved flag is
    set. Yields the flag.

    Raises :class:`InsufficientMemoryError` with the plan's numbers before anything is allocated when the
    call cannot fit the free memory.
    """
    resolved = guard(model, seq_len, probe, checkpoint, rows, batch, layers, active_modifiers())
    with checkpointed(model, enabled=resolved):
        yield resolved


def _available(model, available_bytes: int | None) -> int | None:
    if available_bytes is not None:
        return available_bytes
    device = model.device if isinstance(model, Shapes) else _device_of(model)
    return available_memory(device)


def _device_of(model) -> str:
    return "cpu" if isinstance(model, PretrainedConfig) else str(input_device(model))


def _gib(value: int) -> str:
    return f"{value / _GIB:.1f} GiB" if value >= _GIB / 10 else f"{value / 2**20:.0f} MiB"
