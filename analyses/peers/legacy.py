"""Loading longprobe's converted model folders (written by transformers 5) with transformers 4.52, for the
peers that cannot run on transformers 5 (``lxt`` 2.1, ``at2`` 0.0.1 on Gemma 3; their NOTES.md say why).
Runs inside such a peer's environment."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def config(folder: Path) -> PretrainedConfig:
    """The exported config.json for transformers 4.52: ``rope_parameters`` become ``rope_theta`` (Gemma 3:
    the global layers' theta, and the sliding layers' as ``rope_local_base_freq``); any other rope type is
    refused rather than silently dropped (4.52 would use its default theta: 10 000 instead of SmolLM2's
    100 000 or Qwen's 1 000 000)."""
    raw = json.loads((Path(folder) / "config.json").read_text())
    rope = raw.pop("rope_parameters", None) or {}
    raw.pop("dtype", None)
    if "full_attention" in rope:
        raw["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        raw["sliding_window_pattern"] = raw.get("_sliding_window_pattern", 6)
        rope = rope["full_attention"]
    if rope:
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"rope {rope} has no transformers 4.52 translation here")
        raw["rope_theta"] = rope["rope_theta"]
    return AutoConfig.for_model(**raw)


def tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The folder's fast tokenizer (4.52's ``AutoTokenizer`` does not know transformers 5's
    ``TokenizersBackend`` class), with the special tokens its tokenizer_config.json names."""
    named = json.loads((Path(folder) / "tokenizer_config.json").read_text())
    special = {name: named[name] for name in SPECIAL_TOKENS if isinstance(named.get(name), str)}
    return PreTrainedTokenizerFast(tokenizer_file=str(Path(folder) / "tokenizer.json"), **special)


def model(folder: Path, config: PretrainedConfig) -> torch.nn.Module:
    """The model in float32, in eval mode, built from ``config`` (:func:`config`, possibly patched)."""
    return AutoModelForCausalLM.from_pretrained(folder, config=config, torch_dtype=torch.float32).eval()
