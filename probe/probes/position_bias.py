"""Position bias as a property of the attention graph (Wu, Wang, Jegelka & Jadbabaie, ICML 2025; Wang et
al., "Transformers Are Biased for Long-Context Modeling").

**Context selector** (eq. 4). Without residuals, ``X^(t+1) = A^(t) … A^(0) X^(0) W_V^(0) … W_V^(t)``, so
row ``i`` of ``P^(t) = A^(t) … A^(0)`` (later layers on the left) is a distribution
``P^(t)(z_i = j)`` over the context tokens ``j`` that token ``i`` draws from. ``P^(t)`` multiplies
``t + 1`` layers. With residual connections, each factor becomes ``(1 − λ_t) I + λ_t A^(t)``:
``λ = 0.5`` is attention rollout (Abnar & Zuidema 2020); ``λ_t`` measured per layer as the mean over
tokens of ``‖a_t‖ / (‖x_t‖ + ‖a_t‖)`` (``a_t`` the attention output, ``x_t`` the block input) follows
Herasimchyk et al. (2026). :func:`context_selector` streams the layers from the capture core and
multiplies in row blocks, in place, so memory is O(seq²) whatever the number of layers.

Words: ``layers`` are layer indices (negative allowed, as in :func:`probe.checks.check_layers`),
``n_layers`` is how many layers a network has or a product multiplies (the paper's ``t + 1``).

**Theory** (content-free attention). Each function returns the query row ``i = n`` of the product of
``n_layers`` factors over ``j = 1 … n``:

- causal mask, uniform weights: the Cesàro matrix ``M_ij = 1/i`` (Thm 4.1: mass on token 1 → 1);
  :func:`cesaro_exact_row` is the exact closed form of its powers (a Hausdorff mean), the numeric
  product :func:`selector_rows` also handles residual mixing;
- decay mask ``D_ij = −(i − j) m`` (Thm 4.5): away from the sequence start the row is exactly the
  negative binomial ``(1 − q)^L C(L − 1 + x, x) q^x`` with ``q = e^{−m}``, ``x = i − j``;
- RoPE with ``d = 2`` (Lemma 4.6, Thm 4.7): one layer is the kernel ``∝ exp(r² cos(sθ))`` of the
  distance ``s``; away from the start the product is its ``L``-fold convolution.

**Attention sinks**: the per-token rate of Wu et al. (App. K.4, τ = 0.2) and the per-head metric
of Gu et al. (ICLR 2025, ε = 0.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from math import comb

import numpy as np
import torch
from torch import nn

from probe.attention.shared_state import frozen_parameters
from probe.checks import UnsupportedModelError, check_input_ids, check_layers, hf_model, n_layers
from probe.errors import InvalidValueError
from probe.probes.attribution import attention_matrices

Mix = float | str | None


def _check_mix(mix: Mix) -> None:
    if mix is None or mix == "measured":
        return
    if isinstance(mix, bool) or not isinstance(mix, int | float) or not 0 <= mix <= 1:
        raise InvalidValueError(
            f"mix must be None (raw product), a float λ in [0, 1] or 'measured', got {mix!r}"
        )


def multiply_in_place(product: torch.Tensor, factor: torch.Tensor, block_size: int = 256) -> None:
    """``product ← factor @ product`` for lower-triangular (causal) ``factor`` [seq, seq], in row blocks.

    One step ``P^(t) = R^(t) P^(t−1)`` of eq. 4. Row block ``b`` of the result needs only rows ``≤ b``
    of ``product`` [seq, seq], so blocks are done from the last to the first and each overwrites its
    rows after it is computed: memory is one block extra.
    """
    seq = product.shape[0]
    for start in reversed(range(0, seq, block_size)):
        end = min(start + block_size, seq)
        if factor[start:end, end:].any():
            raise InvalidValueError(
                "the attention pattern is not causal; the in-place product needs a causal mask"
            )
        product[start:end] = factor[start:end, :end] @ product[:end]


def residual_mix(attention: torch.Tensor, lam: float | torch.Tensor | None) -> torch.Tensor:
    """The factor ``R = (1 − λ) I + λ A`` of eq. 4 with residual connections: Tensor[seq, seq].

    ``attention`` is ``A`` [seq, seq]; ``lam=None`` returns it unchanged (no residual, ``R = A``).
    Rows stay stochastic.
    """
    if lam is None:
        return attention
    mixed = attention * lam
    mixed.diagonal().add_(1 - lam)
    return mixed


def attention_modules(model) -> list[tuple[nn.Module, nn.Module]]:
    """``(decoder layer, its attention module)`` for layers ``0 … n_layers − 1``, found by structure.

    An attention module is one whose class name ends in ``Attention`` and that holds an int
    ``layer_idx`` (as every attention module that calls transformers' ``AttentionInterface`` does);
    its decoder layer is the module that contains it. Raises :class:`UnsupportedModelError` unless
    there is exactly one per layer.
    """
    inner = hf_model(model)
    found: dict[int, list[tuple[nn.Module, nn.Module]]] = {}
    for name, module in inner.named_modules():
        index = getattr(module, "layer_idx", None)
        if type(module).__name__.endswith("Attention") and isinstance(index, int):
            found.setdefault(index, []).append((inner.get_submodule(name.rpartition(".")[0]), module))
    total = n_layers(model)
    if sorted(found) != list(range(total)) or any(len(pairs) != 1 for pairs in found.values()):
        raise UnsupportedModelError(
            f"{type(inner).__name__}: expected one attention module (class name ending in 'Attention', "
            f"with a layer_idx) in each of its {total} decoder layers, found them for layers "
            f"{sorted(found)}"
        )
    return [found[index][0] for index in range(total)]


@torch.no_grad()
def measured_mix(model, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """λ_t = mean over tokens of ‖a_t‖ / (‖x_t‖ + ‖a_t‖) per layer: Tensor[n_layers] (Herasimchyk et al.).

    The λ_t of the residual factor ``(1 − λ_t) I + λ_t A^(t)`` (eq. 4 with residuals). ``x_t`` [seq, d]
    is the input of decoder layer ``t`` (the residual stream) and ``a_t`` [seq, d] the output of its
    attention module (:func:`attention_modules`), read with forward hooks that are removed afterwards.
    """
    ids = check_input_ids(model, input_ids)
    inner = hf_model(model)
    modules = attention_modules(inner)
    residual, attended = {}, {}

    def keep_input(index: int):
        return lambda _, args, kwargs: residual.__setitem__(index, (args or (kwargs["hidden_states"],))[0])

    def keep_output(index: int):
        return lambda _, __, output: attended.__setitem__(
            index, output[0] if isinstance(output, tuple) else output
        )

    handles = []
    for index, (layer, attention) in enumerate(modules):
        handles.append(layer.register_forward_pre_hook(keep_input(index), with_kwargs=True))
        handles.append(attention.register_forward_hook(keep_output(index)))
    try:
        with frozen_parameters(inner):
            inner(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    ratios = []
    for index in range(len(modules)):
        x, a = residual[index][0].float().norm(dim=-1), attended[index][0].float().norm(dim=-1)
        ratios.append((a / (x + a).clamp(min=1e-12)).mean())  # 0 where both vanish (a padding row)
    return torch.stack(ratios)


@torch.no_grad()
def context_selector(
    model,
    input_ids: torch.Tensor | Sequence[int],
    layers: Sequence[int] | None = None,
    mix: Mix = None,
    heads: str | int = "mean",
    block_size: int = 256,
) -> torch.Tensor:
    """The context selector ``P^(t) = R^(t) … R^(0)`` after each of ``layers``: Tensor[len(layers), seq, seq].

    Row ``i`` of ``P^(t)`` is ``P^(t)(z_i = j)`` (Wu et al. eq. 4): the weight of token ``j`` in what
    token ``i`` holds after layer ``t`` (0-based, so ``t + 1`` layers). ``layers`` are layer indices
    (``None``: every layer; negative counts from the last, as in :func:`probe.checks.check_layers`).
    ``R^(t)`` is ``A^(t)`` for ``mix=None``, ``(1 − λ) I + λ A^(t)`` for a float ``mix=λ`` (0.5: attention
    rollout) and ``(1 − λ_t) I + λ_t A^(t)`` with λ_t from :func:`measured_mix` for ``mix="measured"``.
    ``heads="mean"`` averages each layer's heads; an int follows that head in every layer.
    Layers are streamed from :func:`probe.attention_matrices`; the product is kept in float64.
    """
    ids = check_input_ids(model, input_ids)
    total = n_layers(model)
    layers = check_layers(model, layers)
    if not layers:
        raise InvalidValueError("layers is empty: give at least one layer index (or None for all)")
    _check_mix(mix)
    n_heads = hf_model(model).config.get_text_config().num_attention_heads
    if heads != "mean" and (
        isinstance(heads, bool) or not isinstance(heads, int) or not 0 <= heads < n_heads
    ):
        raise InvalidValueError(f"heads must be 'mean' or a head index in [0, {n_heads}), got {heads!r}")
    lams = measured_mix(model, ids).tolist() if mix == "measured" else [mix] * total

    product = torch.eye(ids.shape[1], dtype=torch.float64, device=ids.device)
    selected = {}

    def on_layer(layer: int, pattern: torch.Tensor) -> None:
        attention = (pattern.mean(0) if heads == "mean" else pattern[heads]).to(torch.float64)
        multiply_in_place(product, residual_mix(attention, lams[layer]), block_size)
        if layer in layers:
            selected[layer] = product.float()

    attention_matrices(model, ids, layers=range(max(layers) + 1), block_size=block_size, on_layer=on_layer)
    return torch.stack([selected[layer] for layer in layers])


# --- theory: content-free attention graphs -----------------------------------------------------------


def cesaro(n: int) -> torch.Tensor:
    """Uniform causal attention, the Cesàro matrix ``M_ij = 1/i`` for ``j ≤ i``: Tensor[n, n] (float64)."""
    return torch.ones(n, n, dtype=torch.float64).tril() / torch.arange(1, n + 1, dtype=torch.float64)[:, None]


def decay_attention(n: int, m: float) -> torch.Tensor:
    """Content-free decay-mask attention ``A_ij ∝ e^{−(i−j) m}``, ``j ≤ i`` (Wu et al. §4.2): Tensor[n, n]."""
    distance = torch.arange(n, dtype=torch.float64)[:, None] - torch.arange(n, dtype=torch.float64)
    scores = (-m * distance).masked_fill(distance < 0, float("-inf"))
    return scores.softmax(-1)


def rope_attention(n: int, theta: float, r2: float) -> torch.Tensor:
    """Content-free RoPE attention, d = 2 (Lemma 4.6): ``A_ij ∝ exp(r² cos((i − j) θ))``, j ≤ i: Tensor[n, n].

    A query and key of squared norm product ``r²`` at angle 0 score ``r² cos((i − j) θ)`` after rotation.
    """
    distance = torch.arange(n, dtype=torch.float64)[:, None] - torch.arange(n, dtype=torch.float64)
    scores = (r2 * torch.cos(distance * theta)).masked_fill(distance < 0, float("-inf"))
    return scores.softmax(-1)


def selector_rows(
    attention: torch.Tensor, n_layers: int, mix: float | Sequence[float] | torch.Tensor | None = None
) -> torch.Tensor:
    """Query row (the last token) of ``R^(t) … R^(0)`` for ``t < n_layers``, identical attention per layer.

    Eq. 4's context selector ``P^(t)`` for content-free attention ``A`` [n, n] in every layer:
    ``R = (1 − λ_t) I + λ_t A`` (``mix`` a float or one λ per layer; None = raw ``A``). Computed as
    ``e_nᵀ R … R`` from the left, O(n_layers · n²): Tensor[n_layers, n], row ``t`` after ``t + 1`` layers.
    """
    lams = [1.0] * n_layers if mix is None else mix if not isinstance(mix, int | float) else [mix] * n_layers
    lams = torch.as_tensor(lams, dtype=torch.float64).tolist()
    if len(lams) != n_layers:
        raise InvalidValueError(f"mix has {len(lams)} values for {n_layers} layers")
    row = torch.zeros(attention.shape[0], dtype=torch.float64)
    row[-1] = 1.0
    rows = []
    for lam in lams:
        row = (1 - lam) * row + lam * (row @ attention.to(torch.float64))
        rows.append(row)
    # the factors are polynomials in the same A, so they commute and left-to-right order is immaterial
    return torch.stack(rows)


def cesaro_exact_row(n: int, n_layers: int) -> list[Fraction]:
    """Exact query row of ``M^L`` (Cesàro matrix, L = ``n_layers``), as fractions over ``j = 1 … n``.

    Thm 4.1's causal-mask selector for uniform attention. ``M`` is the Hausdorff mean with moments
    ``μ_k = 1/(k+1)`` (Hardy, *Divergent Series*, §11), so ``M^L`` is the Hausdorff mean with ``μ_k^L``:
    ``(M^L)_{ij} = C(i, j) Σ_{s=0}^{i−j} (−1)^s C(i−j, s) (j + s + 1)^{−L}`` (0-based ``i, j``).
    """
    i = n - 1
    return [
        comb(i, j)
        * sum(Fraction((-1) ** s * comb(i - j, s), (j + s + 1) ** n_layers) for s in range(i - j + 1))
        for j in range(n)
    ]


def decay_closed_form(n: int, n_layers: int, m: float) -> torch.Tensor:
    """Negative-binomial query row ``(1 − q)^L C(L − 1 + x, x) q^x`` (``q = e^{−m}``, ``x = n − j``): [n].

    ``L = n_layers``. Every path from token ``i`` to ``j`` collects ``e^{−m(i−j)}`` whatever its steps,
    and there are ``C(L − 1 + x, x)`` monotone paths of ``L`` steps; exact for ``j`` away from the
    sequence start, where row normalisers equal the infinite sum ``1 / (1 − q)`` (Wu et al. Thm 4.5
    gives Θ(·)).
    """
    x = torch.arange(n - 1, -1, -1, dtype=torch.float64)
    q = torch.tensor(-m, dtype=torch.float64).exp()
    log_binomial = (
        torch.lgamma(n_layers + x) - torch.lgamma(x + 1) - torch.lgamma(torch.tensor(float(n_layers)))
    )
    return (n_layers * torch.log1p(-q) + log_binomial + x * torch.log(q)).exp()


def rope_closed_form(n: int, n_layers: int, theta: float, r2: float) -> torch.Tensor:
    """Query row as the ``L``-fold (``L = n_layers``) convolution of the one-layer RoPE kernel: Tensor[n].

    Thm 4.7. The kernel ``k(s) ∝ exp(r² cos(sθ))`` (Lemma 4.6) over distances ``s = 0 … n − 1`` is
    normalised on that range; exact where row normalisers have converged (the kernel must decay within
    the sequence, i.e. ``r² θ²`` large enough), as for the decay mask.
    """
    s = torch.arange(n, dtype=torch.float64)
    kernel = (r2 * torch.cos(s * theta)).softmax(0)
    row = torch.zeros(n, dtype=torch.float64)
    row[0] = 1.0
    for _ in range(n_layers):
        row = torch.from_numpy(np.convolve(row.numpy(), kernel.numpy())[:n])
    return row.flip(0)  # distance x → token j = n − x


# --- attention sinks -----------------------------------------------------------------------------------


def sink_rate(attention: torch.Tensor, mask: torch.Tensor, tau: float = 0.2) -> torch.Tensor:
    """Wu et al. App. K.4: ``Sink_j = (1/T) Σ_t (1 / Σ_i M_ij) Σ_i 1{A^(t)_ij > τ}``: Tensor[seq] in [0, 1].

    ``attention`` [..., layers, seq, seq] (leading dims, e.g. samples, are averaged); ``mask`` [seq, seq]
    bool, the graph ``G`` (True where query i may attend to key j).
    """
    if attention.shape[-2:] != mask.shape:
        raise InvalidValueError(f"mask {tuple(mask.shape)} does not match attention {tuple(attention.shape)}")
    above = ((attention > tau) & mask).float().sum(-2)  # [..., layers, seq]
    return (above / mask.sum(0).clamp(min=1)).flatten(0, -2).mean(0)


def gu_sink(attention: torch.Tensor, epsilon: float = 0.3) -> torch.Tensor:
    """Gu et al. (ICLR 2025): share of (sample, layer, head) whose key ``k`` gets α_k > ε: Tensor[seq].

    ``α_k = Σ_t A_tk / (T − k + 1)``, the mean attention key ``k`` receives from the queries that see
    it under a causal mask. ``attention`` [..., seq, seq] with any leading dims (samples, layers, heads).
    """
    seq = attention.shape[-1]
    received = attention.sum(-2) / torch.arange(seq, 0, -1, dtype=attention.dtype, device=attention.device)
    return (received > epsilon).float().flatten(0, -2).mean(0)


def causal_mask(seq: int, window: int | None = None, prefix: int = 0) -> torch.Tensor:
    """The graph ``G`` as bool [seq, seq]: causal, optionally a sliding window of ``window`` keys
    (the query included) and/or ``prefix`` leading tokens that every token sees and that see each other."""
    query, key = torch.arange(seq)[:, None], torch.arange(seq)[None]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    if prefix:
        allowed |= key < prefix
        allowed[:prefix, :prefix] = True
    return allowed
