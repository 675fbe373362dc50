"""What the memory planner (:mod:`probe.memory.planner`) needs to know about a model: :class:`Shapes`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from probe.checks import hf_model, input_device


@dataclass(frozen=True)
class Shapes:
    """What the planner needs to know about a model: its config shapes and its layer structure."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    act_bytes: int  # bytes per activation element (the model's dtype)
    windows: tuple[int | None, ...]  # sliding window of each layer (None = full attention)
    hidden_norms: int = 2  # RMSNorms over the hidden size per decoder layer
    qk_norms: bool = False  # per-head q_norm / k_norm (Gemma 3, Qwen 3)
    gated: bool = True  # gated MLP (act(gate(x)) * up(x))
    rope_kinds: int = 1  # distinct rotary tables (Gemma 3: local and global)
    softcap: bool = False  # soft-capped attention logits (Gemma 2)
    sinks: bool = False  # one sink logit per head in the softmax denominator (gpt-oss)
    eager: bool = False  # the model's own attention is transformers' eager one
    device: str = "cpu"

    @classmethod
    def of(cls, model) -> Shapes:
        """Shapes of a loaded Hugging Face model, or of a config (norms then inferred from its type)."""
        if isinstance(model, PretrainedConfig):
            config, inner = model.get_text_config(), None
            dtype = getattr(config, "dtype", None) or torch.float32
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            device = "cpu"
            sinks = config.model_type.startswith("gpt_oss")
        else:
            inner = hf_model(model)
            config = inner.config.get_text_config()
            dtype = next(inner.parameters()).dtype
            device = input_device(inner).type  # offloaded weights live on "meta"; compute does not
            sinks = any(torch.is_tensor(getattr(module, "sinks", None)) for module in inner.modules())
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if getattr(config, "layer_types", None) is None and window is not None:
            windows = (window,) * config.num_hidden_layers  # one window for every layer (Mistral)
        else:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        norms, qk_norms, gated = _layer_structure(inner, config, head_dim)
        # GPT-2 names it n_inner, None meaning 4 × hidden
        intermediate = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=intermediate or 4 * config.hidden_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=config.vocab_size,
            act_bytes=torch.empty((), dtype=dtype).element_size(),
            windows=windows,
            hidden_norms=norms,
            qk_norms=qk_norms,
            gated=gated,
            rope_kinds=max(1, len({w is None for w in windows})),
            softcap=getattr(config, "attn_logit_softcapping", None) is not None,
            sinks=sinks,
            eager=getattr(config, "_attn_implementation", None) == "eager",
            device=device,
        )

    def attention_path(self, own: bool) -> str:
        """How the attention of a layer runs: ``"exact"`` (longprobe's exact softmax in row blocks, for
        soft-capped or sink logits), ``"eager"`` (transformers' eager attention, the model's own) or
        ``"sdpa"``. ``own``: under longprobe's attention function (a trace or a modifier is active)."""
        if own:
            return "sdpa" if self.plain_logits else "exact"
        return "eager" if self.eager else "sdpa"

    @property
    def plain_logits(self) -> bool:
        """Whether the attention is plain softmax attention (no soft-capping, no sink logits)."""
        return not (self.softcap or self.sinks)

    def masked(self, layer: int, seq: int, everywhere: bool) -> bool:
        """Whether ``layer``'s sdpa gets a materialized mask for a ``seq``-token input."""
        window = self.windows[layer]
        return everywhere or (window is not None and seq > window)

    def saved(self, layer: int, seq: int, masked: bool, first: bool, path: str = "sdpa") -> int:
        """Bytes ``layer`` saves for backward per token, float mask excluded (formula S in
        probe.memory.planner).

        ``first``: nothing upstream needs a gradient, so only the part after the attention output
        is saved (the first captured layer of ``information_flow``). ``path``: how its attention runs
        (:meth:`attention_path`).
        """
        a, d, h = self.act_bytes, self.hidden, self.head_dim
        norm = 4 * (d + 1)
        mlp = a * self.intermediate * (3 if self.gated else 1)
        if first:
            return (self.hidden_norms - 1) * norm + mlp
        qk = 0
        if self.qk_norms:
            qk = 4 * (self.heads * h + self.heads) + 4 * (self.kv_heads * h + self.kv_heads)
        return self.hidden_norms * norm + qk + self.attention_saved(seq, masked, path) + mlp

    def attention_saved(self, seq: int, masked: bool, path: str) -> int:
        """Bytes the attention itself saves for backward per token (``n`` = ``seq`` keys):

        - ``sdpa``: q, k, v, its output and the log-sum-exp, ``a(2Hh + 2K'h) + 4H``;
        - ``exact``: q (gathered per row block), k and v in fp32, the fp32 probabilities of every row
          (``n`` keys, + 1 sink column) and, when soft-capped, the tanh output: ``4(Hh + 2Kh) +
          4H(n(1 + softcap) + sinks)``;
        - ``eager``: q and the ``repeat_kv`` copies of k and v (``K' = H`` when ``K < H``), the fp32
          probabilities and their copy in the model's dtype (none in fp32), the tanh output when
          soft-capped: ``a(Hh + 2K'h) + 4Hn [+ aHn] [+ aHn]``; with sinks the probabilities are in the
          model's dtype with the sink column, plus the row maxima's indices: ``aH(n + 1) + 8H``.
        """
        a, h, heads, kv_heads = self.act_bytes, self.head_dim, self.heads, self.kv_heads
        if path == "exact":
            rows = 4 * heads * (seq * (1 + self.softcap) + self.sinks)
            return 4 * (heads * h + 2 * kv_heads * h) + rows
        if path == "eager":
            kv = heads if kv_heads < heads else kv_heads
            if self.sinks:
                probabilities = a * heads * (seq + 1) + 8 * heads
            else:
                probabilities = 4 * heads * seq + (a * heads * seq if a != 4 else 0)
            return a * (heads * h + 2 * kv * h) + probabilities + self.softcap * a * heads * seq
        kv = heads if masked and 1 < kv_heads < heads else kv_heads
        return a * (2 * heads * h + 2 * kv * h) + 4 * heads


def _layer_structure(inner, config, head_dim: int) -> tuple[int, bool, bool]:
    """(hidden-size norms per layer, per-head q/k norms, gated MLP), read off decoder layer 0."""
    layer = None
    if inner is not None:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layer = next((mod for mod in inner.modules() if isinstance(mod, GradientCheckpointingLayer)), None)
    if layer is None:  # a bare config: infer from the architecture
        qk = config.model_type.startswith(("gemma3", "qwen3", "olmo2"))
        return (4 if config.model_type.startswith(("gemma2", "gemma3")) else 2), qk, True
    sizes = [
        mod.weight.numel()
        for name, mod in layer.named_modules()
        if "norm" in type(mod).__name__.lower() and getattr(mod, "weight", None) is not None
    ]
    norms = sum(size == config.hidden_size for size in sizes)
    qk = any(size == head_dim for size in sizes) and head_dim != config.hidden_size
    gated = any(name.endswith("gate_proj") for name, _ in layer.named_modules())
    return max(norms, 1), qk, gated
