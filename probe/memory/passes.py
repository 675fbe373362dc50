"""What one probe call keeps in memory: each probe declares its pass (:class:`ProbePass`) and the pass
its memory terms (:meth:`ProbePass.memory`), as each modifier declares its own
(:meth:`probe.attention.Modifier.memory`); :func:`probe.memory.planner.plan` sums the declarations.

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
``n > 2·window`` runs in bands of one window of queries (:func:`probe.attention.kernels.runs_in_bands`): no
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
For :func:`~probe.probes.attribution.information_flow` nothing before the first captured layer needs a
gradient; that layer saves only ``(N−1)·4(d+1) + a·g·m`` (the part after its attention output)
and the layers before it nothing.

**Terms** (bytes; the peak is the largest of a few phases, each a sum of terms):

- ``activations``: plain: ``n·Σ S_l`` over the layers that need a gradient. Checkpointed
  (:func:`probe.memory.checkpointing.checkpointed`): the layer inputs ``L_g·n·d·a`` plus one layer's
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
"""

from __future__ import annotations

from dataclasses import dataclass

from probe.attention.kernels import EXACT_BLOCK, runs_in_bands
from probe.memory import CHECKPOINT_HEAP_HOLES, MMAP_THRESHOLD_MAX, PLAIN_HEAP_SLACK, _heap_slack
from probe.shapes import Shapes

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


@dataclass(frozen=True)
class ProbePass:
    """What a probe's pass is, as far as memory goes: the declaration the planner reads.

    ``backward``: it differentiates the loss of its target rows. ``traced``: it captures attention rows
    of chosen layers (through longprobe's attention function) and, with a backward, their gradients.
    ``embeddings``: the gradient reaches the input embeddings (a leaf that requires grad), so every
    layer is differentiated; without it the layers before the first captured one need none, and that
    layer only what follows its attention. ``logits_rows``: a forward projects every target row to the
    vocabulary (else one row).
    """

    backward: bool
    traced: bool
    embeddings: bool = False
    logits_rows: bool = False

    def memory(
        self,
        s: Shapes,
        n: int,
        rows: int,
        batch: int,
        checkpoint: bool,
        captured: list[int],
        masked: bool,
        modified: bool,
    ) -> dict[str, dict[str, int]]:
        """Every phase's terms (bytes) for one call of a probe with this pass, as the planner sums them
        with the active modifiers' own (:meth:`probe.attention.Modifier.memory`); see the module docstring
        for each formula."""
        a, d, m = s.act_bytes, s.hidden, s.intermediate
        own = modified or self.traced
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
        if not self.backward:  # no backward: one layer's working set, captured rows, the result
            logits = batch * (rows if self.logits_rows else 1) * s.vocab * (a + 4)
            run = _terms(
                layer_workspace=forward_ws,
                captured_rows=pattern if self.traced else 0,
                masks=masks,
                attention_workspace=float_mask if any(sdpa_mask) else 0,
                logits=logits,
                other=rope + batch * n * d * a,  # rotary tables and the final hidden states
            )
            found = {"forward": run}
            if self.traced:  # the cache and its stacked copy
                found["result"] = _terms(captured_rows=2 * pattern)
            return found

        first_grad = 0 if self.embeddings else captured[0]
        grad_layers = list(range(first_grad, s.layers))
        partial = not self.embeddings  # its first grad layer saves only what follows attention
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
        embeddings = 2 * batch * n * d * a if self.embeddings else 0
        heap = _heap_slack(s.device)
        captured_forward = pattern + row_extras if self.traced else 0
        first_gradient = pattern // len(captured) if self.traced else 0
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
        found = {
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
            found["forward"] = _terms(
                activations=inputs,
                layer_workspace=forward_ws,
                captured_rows=captured_forward,
                attention_workspace=attention_ws,
                **common,
            )
        if self.traced:  # after the backward: rows and gradients, their stacks, A⊙∂A
            found["result"] = _terms(captured_rows=5 * pattern, embeddings=embeddings)
        return found


#: every probe the planner knows, by the name its functions pass to :func:`probe.memory.planner.guarded`
PROBE_PASSES = {
    "information_flow": ProbePass(backward=True, traced=True),
    "answer_attribution": ProbePass(backward=True, traced=True, embeddings=True),
    "embedding_grads": ProbePass(backward=True, traced=False, embeddings=True),
    "attention_rows": ProbePass(backward=False, traced=True),
    "forward": ProbePass(backward=False, traced=False, logits_rows=True),
}
PROBE_PASSES["embedding_grad_norms"] = PROBE_PASSES["embedding_grads"]


def _terms(**values: int) -> dict[str, int]:
    """All term names in a fixed order, 0 where not given."""
    return {name: int(values.get(name, 0)) for name in TERMS}
