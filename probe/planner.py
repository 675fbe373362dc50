"""Memory planner and guard: predicted peak memory of one probe call, from the model's shapes.

:func:`plan` predicts the peak bytes a probe allocates *above the loaded model* (weights excluded)
from the model's configuration (layers, hidden, intermediate, heads, KV heads, head dim, vocab,
dtype, sliding windows, which norms a decoder layer has) and the probe's settings (sequence length,
target rows, batch, captured layers, checkpointing). No measured peak is looked up: every term is
a count of tensors of known shape. :meth:`Plan.check` compares the prediction with the free memory
and raises :class:`InsufficientMemoryError` (a :class:`MemoryError`) with the numbers and the advice before
anything is allocated;
:func:`guard` resolves ``checkpoint="auto"`` and checks in one call (what a probe calls first).

Notation (all per sequence; multiply by ``batch``): ``n`` tokens, ``L`` decoder layers, ``d`` hidden,
``m`` intermediate, ``H`` query heads, ``K`` KV heads, ``h`` head dim, ``V`` vocab, ``R`` target rows,
``a`` bytes per activation element (4 fp32, 2 bf16/fp16), ``N`` hidden-size norms per layer (Llama 2,
Gemma 3 4). RMSNorm inputs are saved in fp32 whatever the model dtype (4 bytes), as is everything
longprobe computes itself (attention rows, log-softmax).

**What one decoder layer saves for backward** (parameters frozen, so no linear layer keeps its
input; counted once with ``torch.autograd.graph.saved_tensors_hooks`` on SmolLM2 and Gemma 3 at 256 –
2K tokens, where the formula matched every layer to < 0.1 %), bytes per token::

    S = N·4(d+1)                      every RMSNorm: its fp32 input and 1/rms
      + [4(Hh+H) + 4(Kh+K)]           q_norm / k_norm (Gemma 3, Qwen 3): same, per head
      + a(Hh + 2K'h + Hh) + 4H        sdpa: q, k, v, its output, and the log-sum-exp
      + a·g·m                         gated MLP: act input, act output, up (g = 3; 1 without a gate)

``K' = K``, except that a layer whose sdpa gets a mask and has ``1 < K < H`` receives
``repeat_kv`` copies (``K' = H``). A layer whose sdpa gets a mask (a sliding-window layer when
``n > window``, every layer under a key mask, window or padding) also keeps the float mask sdpa
converts the boolean one to: ``a·n`` bytes per token, one per layer (the *attention_workspace* term).
Under longprobe's attention function (a trace or a modifier is active) a sliding layer with
``n > 2·window`` runs in bands of one window of queries (:func:`probe.attention.runs_in_bands`): no
float mask of ``n²``, but each band's mask and sdpa output, ``a(2·window + Hh)`` bytes per token.
That is the attention of sdpa. Two other paths keep every row's probabilities instead
(:meth:`~probe.shapes.Shapes.attention_saved`, checked with the same hooks on Gemma 2 and gpt-oss):
longprobe's exact softmax, which serves soft-capped (Gemma 2) and sink (gpt-oss) logits under a trace
or modifier, ``4(Hh + 2Kh) + 4H·n`` (twice the probabilities' ``4H·n`` when soft-capped, since the
tanh output is kept too), and the model's own eager attention in a plain pass (transformers' only path
for those two models, or a model loaded with ``attn_implementation="eager"``), ``a(Hh + 2K'h) + 4H·n``
with ``K' = H`` when ``K < H``; their scores run as two score-sized transients in
``layer_workspace`` (row blocks of 256 for the exact path), and eager masks are float
(``(1 + a)·n²`` per kind). Mixture-of-experts MLPs are counted as one dense MLP of the expert size: an
underestimate for those models.
For :func:`~probe.attribution.information_flow` nothing before the first captured layer needs a
gradient; that layer saves only ``(N−1)·4(d+1) + a·g·m`` (the part after its attention output)
and the layers before it nothing.

**Terms** (bytes; the peak is the largest of a few phases, each a sum of terms):

- ``activations``: plain: ``n·Σ S_l`` over the layers that need a gradient. Checkpointed
  (:func:`probe.checkpointing.checkpointed`): the layer inputs ``L_g·n·d·a`` plus one layer's
  recomputed saved set ``n·max S_l`` (and its float mask).
- ``layer_workspace``: transient tensors of the one layer being run. Forward (no grad, or a
  checkpointed forward): ``n·a(3m + 3d)`` (act, up and their product, the residual, the normed
  input and the layer output); backward of a plain pass: ``n·a(m + d)`` (a gradient replaces each
  saved tensor it consumes); recompute + backward of a checkpointed layer: ``3·n·a·m``.
- ``captured_rows``: attention rows ``A[rows]`` of the captured layers ``L_c`` and their
  gradients: ``L_c·H·R·n·4`` each, plus the row-sized q/output tensors autograd keeps,
  ``L_c·8·H·R·h``. After the backward the probe stacks both into new tensors (the *result* phase).
- ``masks``: the boolean ``[n, n]`` mask of each kind that is materialized (sliding window when
  ``n > window``; full-causal too when key masks, windows or padding are active): ``n²`` bytes each.
- ``attention_workspace``: the float copy of a boolean mask that sdpa builds in every masked layer
  (``a·n²``): one per masked layer that needs a gradient in a plain pass (it is saved for the
  backward), one otherwise. sdpa's fused CPU kernel itself only adds per-thread blocks (< 1 MiB).
- ``logits``: the target rows only (``logits_to_keep``): ``R·V·(12 + a)`` with a gradient (logits,
  fp32 log-softmax, and two gradients), ``R·V·(a + 4)`` without.
- ``embeddings``: input embeddings that require grad (``embedding_grads``): ``2·n·d·a`` (leaf + grad).
- ``other``: the final norm's saved input, rotary cos/sin: ``n·4(d+1) + 2·n·h·a`` per RoPE kind.
- ``allocator`` (CPU with glibc's default malloc only): memory that is freed but still resident.
  glibc serves tensors below its dynamic mmap threshold (up to 32 MiB) from the heap, and the freed
  forward temporaries of each layer stay resident between the tensors that are kept. Measured once
  (peak RSS with the default allocator vs. with ``MALLOC_MMAP_THRESHOLD_=65536``, which releases
  every freed tensor; SmolLM2 and Gemma 3, 512 – 2K tokens): a plain gradient pass keeps
  ``0.36·activations`` extra (0.32 – 0.41 in 10 of 12 runs), a checkpointed one about four
  hidden-state tensors per checkpointed layer, ``4·L_g·n·d·a`` (3 – 4.6). No-grad passes: 0.
  Individual runs scatter: 2 of 12 plain runs kept almost nothing extra. Tensors of 32 MiB or more
  are always mmapped and go back to the system when freed, so a checkpointed pass keeps no holes
  once a hidden state reaches that size (Gemma 3 from 16K tokens); plain passes kept their slack at
  every length measured (SmolLM2 at 8K: 0.36·activations, as at 1K). With a fixed threshold
  (``MALLOC_MMAP_THRESHOLD_`` set, or :func:`compact_heap` called) and on CUDA the term is 0.

Batches (``batch > 1``) are assumed padded: every layer then gets a mask. Probes: ``"information_flow"``,
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

from probe.attention import EXACT_BLOCK, Modifier, active_modifiers, runs_in_bands
from probe.checkpointing import checkpointed
from probe.checks import check_int, input_device
from probe.errors import InsufficientMemoryError, InvalidValueError, OutOfRangeError
from probe.memory import (
    CHECKPOINT_HEAP_HOLES,
    MMAP_THRESHOLD_MAX,
    PLAIN_HEAP_SLACK,
    _heap_slack,
    available_memory,
    compact_heap,
)
from probe.shapes import Shapes

__all__ = [
    "PROBES",
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

TERMS = (
    "activations",
    "layer_workspace",
    "captured_rows",
    "masks",
    "attention_workspace",
    "logits",
    "embeddings",
    "other",
    "allocator",
)
GRAD_PROBES = ("information_flow", "answer_attribution", "embedding_grads")
PROBES = (*GRAD_PROBES, "embedding_grad_norms", "attention_rows", "forward")
_ALIASES = {"embedding_grad_norms": "embedding_grads"}

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
            f"{advice} ({detail}; see probe.planner.plan(...))",
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
        probe: one of :data:`PROBES`.
        rows: target rows (the loss's target tokens; the captured query rows; for ``"forward"``
            the rows projected to the vocabulary).
        batch: sequences per call; ``> 1`` is assumed padded (every layer then gets a mask).
        checkpoint: decoder layers recomputed in the backward (:func:`probe.checkpointing.checkpointed`).
        layers: captured layers (``None`` = all; negative indices allowed).
        modifiers: the attention modifiers active during the call (:mod:`probe.attention`): one that
            changes scores, masks or positions gives every layer a mask, and each adds its own terms
            (:meth:`~probe.attention.Modifier.memory`) to every phase.
    """
    name = _ALIASES.get(probe, probe)
    if name not in PROBES:
        raise InvalidValueError(f"unknown probe {probe!r}; plan one of {', '.join(PROBES)}")
    seq_len, rows, batch = (check_int(value, name, 1) for value, name in
                            ((seq_len, "seq_len"), (rows, "rows"), (batch, "batch")))  # fmt: skip
    shapes = model if isinstance(model, Shapes) else Shapes.of(model)
    captured = _check_layers(layers, shapes.layers)
    masked = any(modifier.masks_every_layer(shapes, modifiers) for modifier in modifiers)
    phases = _phases(shapes, seq_len, name, rows, batch, bool(checkpoint), captured, masked, bool(modifiers))
    for modifier in modifiers:
        for term, size in modifier.memory(shapes, seq_len, batch, bool(checkpoint), modifiers).items():
            for terms in phases.values():
                terms[term] = terms.get(term, 0) + size
    phase = max(phases, key=lambda key: sum(phases[key].values()))
    alternative = None
    if name in GRAD_PROBES and not checkpoint:
        alternative = plan(shapes, seq_len, name, rows, batch, True, captured, modifiers).total
    return Plan(
        probe=probe,
        seq_len=seq_len,
        rows=rows,
        batch=batch,
        checkpoint=bool(checkpoint) and name in GRAD_PROBES,
        layers=tuple(captured),
        device=shapes.device,
        dtype_bytes=shapes.act_bytes,
        phase=phase,
        terms=phases[phase],
        phases=phases,
        checkpointed_total=alternative,
    )


def _check_layers(layers: Sequence[int] | None, total: int) -> list[int]:
    chosen = list(range(total)) if layers is None else list(layers)
    bad = [layer for layer in chosen if not -total <= layer < total]
    if bad or not chosen:
        raise OutOfRangeError(f"layers {bad or chosen} out of range for a {total}-layer model")
    return sorted({layer % total for layer in chosen})


def _phases(
    s: Shapes,
    n: int,
    probe: str,
    rows: int,
    batch: int,
    checkpoint: bool,
    captured: list[int],
    masked: bool,
    modified: bool,
) -> dict[str, dict[str, int]]:
    """Every phase's terms (bytes) for one call; see the module docstring for each formula."""
    a, d, m = s.act_bytes, s.hidden, s.intermediate
    own = modified or probe in ("information_flow", "answer_attribution", "attention_rows")
    path = s.attention_path(own)  # sdpa, longprobe's exact softmax, or the model's eager attention
    everywhere = masked or batch > 1 or path == "eager"
    mask_of = [s.masked(layer, n, everywhere) for layer in range(s.layers)]
    # under longprobe's attention function a sliding layer beyond two windows runs in bands
    windowed = [own and path == "sdpa" and runs_in_bands(w, n, n) for w in s.windows]
    # a layer whose sdpa gets a whole [n, n] mask (sdpa turns it into a float copy)
    sdpa_mask = [path == "sdpa" and mask_of[layer] and not windowed[layer] for layer in range(s.layers)]
    kinds = {s.windows[layer] is not None for layer in range(s.layers) if mask_of[layer]}
    if everywhere:
        kinds = {True, False} if any(w is not None for w in s.windows) else {False}
    masks = batch * n * n * len(kinds) * (1 + a if path == "eager" else 1)  # eager: + its float copy
    float_mask = batch * a * n * n
    score_rows = {"sdpa": 0, "exact": min(EXACT_BLOCK, n), "eager": n}[path]
    scores = batch * 2 * 4 * s.heads * score_rows * n  # two score-sized tensors of the running layer
    rope = batch * s.rope_kinds * 2 * n * s.head_dim * a
    other = rope + batch * n * 4 * (d + 1)  # rotary tables, the final norm's saved input
    pattern = batch * len(captured) * s.heads * rows * n * 4
    row_extras = batch * len(captured) * 8 * s.heads * rows * s.head_dim
    forward_ws = batch * n * a * (3 * m + 3 * d) + scores
    if probe not in GRAD_PROBES:  # no backward: one layer's working set, captured rows, the result
        logits = batch * rows * s.vocab * (a + 4) if probe == "forward" else batch * s.vocab * (a + 4)
        run = _terms(
            layer_workspace=forward_ws,
            captured_rows=pattern if probe == "attention_rows" else 0,
            masks=masks,
            attention_workspace=float_mask if any(sdpa_mask) else 0,
            logits=logits,
            other=rope + batch * n * d * a,  # rotary tables and the final hidden states
        )
        phases = {"forward": run}
        if probe == "attention_rows":  # the cache and its stacked copy
            phases["result"] = _terms(captured_rows=2 * pattern)
        return phases

    first_grad = 0 if probe in ("embedding_grads", "answer_attribution") else captured[0]
    grad_layers = list(range(first_grad, s.layers))
    partial = probe == "information_flow"  # its first grad layer saves only what follows attention
    differentiated = [layer for layer in grad_layers if not (partial and layer == first_grad)]
    saved = [
        s.saved(layer, n, mask_of[layer], layer not in differentiated, path)
        + (
            a * (2 * s.windows[layer] + s.heads * s.head_dim)
            if windowed[layer] and layer in differentiated
            else 0
        )
        for layer in grad_layers
    ]  # a band layer also keeps each band's mask [window, 2·window] and each band's sdpa output
    # layers whose sdpa is differentiated (the partial first layer's is not) and gets a full mask
    masked_grad = sum(sdpa_mask[layer] for layer in differentiated)
    logits = batch * rows * s.vocab * (12 + (a if a != 4 else 0))
    embeddings = 2 * batch * n * d * a if probe in ("embedding_grads", "answer_attribution") else 0
    heap = _heap_slack(s.device)
    captured_forward = 0 if probe == "embedding_grads" else pattern + row_extras
    first_gradient = 0 if probe == "embedding_grads" else pattern // len(captured)
    if checkpoint:  # the layer inputs stay; one layer at a time is recomputed and differentiated
        inputs = batch * len(grad_layers) * n * d * a
        loss_activations, backward_activations = inputs, inputs + batch * n * max(saved)
        workspace = batch * 3 * n * a * m + scores
        attention_ws = float_mask if any(sdpa_mask[layer] for layer in grad_layers) else 0
        holes = batch * n * d * a < MMAP_THRESHOLD_MAX  # a hidden state small enough for the heap
        allocator = heap * holes * CHECKPOINT_HEAP_HOLES * inputs
    else:  # every layer's saved tensors stay until its backward
        loss_activations = backward_activations = batch * n * sum(saved)
        workspace = batch * n * a * (m + d) + scores
        attention_ws = float_mask * masked_grad
        allocator = round(heap * PLAIN_HEAP_SLACK * backward_activations)
    common = {"masks": masks, "embeddings": embeddings // 2, "other": other, "allocator": allocator}
    phases = {
        # loss and its gradient on the target rows, before any layer's backward
        "loss": _terms(
            activations=loss_activations,
            captured_rows=captured_forward,
            attention_workspace=float_mask * masked_grad if not checkpoint else 0,
            logits=logits,
            **common,
        ),
        # the last layer's backward (checkpointed: after its recomputation)
        "backward": _terms(
            activations=backward_activations,
            layer_workspace=workspace,
            captured_rows=captured_forward + first_gradient,
            attention_workspace=attention_ws,
            **common,
        ),
    }
    if checkpoint:  # the checkpointed forward: one layer's working set above the inputs kept so far
        phases["forward"] = _terms(
            activations=inputs,
            layer_workspace=forward_ws,
            captured_rows=captured_forward,
            attention_workspace=attention_ws,
            **common,
        )
    if probe != "embedding_grads":  # after the backward: rows and gradients, their stacks, A⊙∂A
        phases["result"] = _terms(captured_rows=5 * pattern, embeddings=embeddings)
    return phases


def _terms(**values: int) -> dict[str, int]:
    """All term names in a fixed order, 0 where not given."""
    return {name: int(values.get(name, 0)) for name in TERMS}


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
    if _ALIASES.get(probe, probe) not in GRAD_PROBES:
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
            _ALIASES.get(probe, probe) in GRAD_PROBES
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
    asked for its memory), then :func:`probe.checkpointing.checkpointed` if the resolved flag is
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
