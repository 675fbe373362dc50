"""gim-explain 0.1.4 (GIM, Edin et al. 2025, arXiv 2505.17630), a peer of longprobe, in .venv-peers/gim.

    .venv-peers/gim/bin/python -m analyses.peers.gim.run EXPORTED.jsonl SCORES.jsonl [--method full|shipped]

``gim.explain``'s recipe with its defaults (frozen norms, softmax backward at temperature 2, q/k
gradients × 0.25, v gradients × 0.5, the space token as baseline, attribution = (embedding − baseline
embedding) · gradient summed over the hidden dimension) for the target Σ_t logit_{t−1}(x_t) over the
teacher-forced answer tokens t, in one pass inside gim's context ``gim.GIM`` (equal to the sum of
``gim.explain`` over the answer tokens, one pass each). A source scores the sum of its tokens'
attribution.

``--method shipped`` calls it on the model as transformers loads it. There gim 0.1.4 only reaches the
attention's q/k/v (it wraps ``F.scaled_dot_product_attention``): it freezes only ``nn.LayerNorm`` and
``nn.RMSNorm`` modules, and transformers' ``*RMSNorm`` classes are neither; and the softmax it patches is
never called, since SDPA's softmax is fused (eager attention passes ``dtype=`` to ``F.softmax``, which
gim's replacement does not accept). ``--method full`` (the default) gives gim what it recognises, so that
all three of its modifications act, through its own code: every transformers RMS norm becomes a
``torch.nn.RMSNorm`` with the same forward, and ``F.scaled_dot_product_attention`` becomes its written-out
math (``torch.softmax`` inside) before gim wraps it. Choices and failures: NOTES.md beside this file.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator
from pathlib import Path

import gim
import torch
import torch.nn.functional as F
from gim.explain import _infer_baseline_token_id
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from .. import peer_io

METHODS = ["full", "shipped"]
# gim.explain's defaults (frozen norms, softmax backward at temperature 2, q/k/v gradient scales)
EXPLAIN_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(gim.explain).parameters.items()
    if name in ("freeze_norm", "softmax_temperature", "q_scale", "k_scale", "v_scale")
}


def torch_rms_norms(model: torch.nn.Module) -> int:
    """Replace every transformers ``*RMSNorm`` by a ``torch.nn.RMSNorm`` with the same forward (Gemma's
    ``1 + weight`` folded into the weight), so that gim's norm freezing finds it. Returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if not kind.endswith("RMSNorm") or isinstance(child, torch.nn.RMSNorm):
                continue
            weight = child.weight.detach() + (1.0 if kind.startswith("Gemma") else 0.0)
            eps = getattr(child, "variance_epsilon", getattr(child, "eps", None))
            norm = torch.nn.RMSNorm(weight.shape, eps=eps, dtype=weight.dtype)
            norm.weight.data.copy_(weight)
            norm.weight.requires_grad_(False)
            setattr(parent, name, norm)
            swapped += 1
    return swapped


def math_sdpa(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``F.scaled_dot_product_attention`` written out (PyTorch's documented reference) with ``torch.softmax``
    looked up at call time, so that gim's softmax patch reaches the attention."""
    if dropout_p:
        raise ValueError("dropout in attention")
    if key.shape[-3] != query.shape[-3]:  # grouped-query attention
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    scores = query @ key.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(query.shape[-1]))
    if is_causal:
        rows, cols = scores.shape[-2:]
        causal = torch.ones(rows, cols, dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, -math.inf)
    if attn_mask is not None:
        scores = (
            scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
        )
    return torch.softmax(scores, -1) @ value


@contextlib.contextmanager
def written_out_attention() -> Iterator[None]:
    """Inside the block ``F.scaled_dot_product_attention`` is :func:`math_sdpa` (entered before gim's own
    context, which then wraps it with its q/k/v gradient scales)."""
    fused = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = math_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = fused


def load(folder: Path, method: str) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The model (float32, eval, frozen parameters; ``full``: torch RMS norms) and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    if method == "full" and not torch_rms_norms(model):
        raise RuntimeError("no RMS norm found to hand to gim")
    return model, AutoTokenizer.from_pretrained(folder)


def token_attribution(model, tokenizer, ids: torch.Tensor, answer: list[int], method: str) -> torch.Tensor:
    """GIM's attribution of Σ_t logit_{t−1}(x_t) over the answer tokens t, in one forward and backward:
    ``gim.explain``'s recipe (the embeddings fed with gradients kept, (embedding − baseline embedding) ·
    gradient summed over the hidden dimension, the baseline token gim infers) inside gim's public context
    ``gim.GIM`` with ``explain``'s defaults, the one target being the sum of the answer tokens' logits.
    GIM's backward is linear in the target's gradient, so this equals the sum of ``gim.explain`` over the
    answer tokens (NOTES.md: checked) at the cost of one pass instead of one per answer token."""
    embed = model.get_input_embeddings()
    with torch.no_grad():
        baseline = embed(torch.full_like(ids, _infer_baseline_token_id(tokenizer)))
    clean = embed(ids).detach().requires_grad_(True)
    rows, tokens = torch.tensor(answer) - 1, ids[0, answer]
    setting = written_out_attention() if method == "full" else contextlib.nullcontext()
    with setting, gim.GIM(model, **EXPLAIN_DEFAULTS):
        logits = model(inputs_embeds=clean, use_cache=False).logits[0]
        logits[rows, tokens].sum().backward()
    return (clean.grad * (clean.detach() - baseline)).sum(-1)[0].float()


def main(argv: list[str] | None = None) -> None:
    """Score every exported sample (one model folder per file)."""
    args = peer_io.arguments(METHODS, argv=argv)
    torch.set_num_threads(args.threads)
    samples = list(peer_io.samples(args.exported))
    model, tokenizer = load(Path(samples[0]["model"]), args.method)

    def score(sample: dict) -> list[float]:
        if Path(sample["model"]) != Path(samples[0]["model"]):
            raise ValueError(f"one model per file: {sample['model']} after {samples[0]['model']}")
        ids, offsets, answer = peer_io.tokens(tokenizer, sample)
        ids = torch.tensor([ids])
        attribution = token_attribution(model, tokenizer, ids, answer, args.method)
        return peer_io.sum_by_source(attribution.tolist(), offsets, sample)

    peer_io.run(args, score)


if __name__ == "__main__":
    main()
