"""gim-explain 0.1.4 (GIM, Edin et al. 2025, arXiv 2505.17630), a peer of longprobe, in .venv-peers/gim.

    .venv-peers/gim/bin/python bench/peers/gim/run.py EXPORTED.jsonl SCORES.jsonl [--method full|shipped]

Its entry point ``gim.explain`` with its defaults (frozen norms, softmax backward at temperature 2, q/k
gradients × 0.25, v gradients × 0.5, the space token as baseline, attribution = (embedding − baseline
embedding) · gradient summed over the hidden dimension), once per teacher-forced answer token t
(``target_position`` t − 1, ``target_token_id`` x_t); a token's attribution is the sum over the answer
tokens, i.e. that of Σ_t logit(x_t). A source scores the sum of its tokens' attribution.

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
import math
import sys
from collections.abc import Iterator
from pathlib import Path

import gim
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import peer_io  # noqa: E402

METHODS = ["full", "shipped"]


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
    """``gim.explain`` with its defaults for each answer token t (row t − 1, token x_t), summed."""
    setting = written_out_attention() if method == "full" else contextlib.nullcontext()
    with setting:
        return sum(
            gim.explain(
                model, ids, target_token_id=int(ids[0, t]), target_position=t - 1, tokenizer=tokenizer
            )
            for t in answer
        ).float()


def main() -> None:
    """Score every exported sample (one model folder per file)."""
    args = peer_io.arguments(METHODS)
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

    peer_io.run(args.exported, args.out, score)


if __name__ == "__main__":
    main()
