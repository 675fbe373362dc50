"""The converted-model cache: concurrent first loads, damaged folders, group access."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

import probe
from probe import models

# A process's first load of "smollm2-135m" into an empty cache, with the GGUF de-quantization
# replaced by a tiny model (slowed down, so that the other processes arrive while it converts).
FIRST_LOAD = """
import os, sys, time
import probe
from probe import models
from transformers import AutoTokenizer

def dequantize(spec):
    with open(sys.argv[2], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(2)
    return probe.tiny_model("llama", vocab_size=49152), AutoTokenizer.from_pretrained(sys.argv[1])

models._dequantize = dequantize
model, tokenizer = probe.load_model("smollm2-135m")
assert model.config.num_hidden_layers == 3 and len(tokenizer) == 49152
"""


@pytest.fixture(scope="module")
def tokenizer_folder():
    return models.converted_folder("smollm2-135m")


@pytest.fixture
def cache(tmp_path, monkeypatch, tokenizer_folder):
    """An empty cache whose conversions save a tiny model; the list of the conversions made."""
    monkeypatch.setenv("LONGPROBE_CACHE", str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    conversions = []

    def dequantize(spec):
        conversions.append(spec.name)
        return probe.tiny_model("llama", vocab_size=len(tokenizer)), tokenizer

    monkeypatch.setattr(models, "_dequantize", dequantize)
    return conversions


def test_concurrent_first_loads_all_succeed_and_convert_once(tmp_path, tokenizer_folder):
    log = tmp_path / "conversions.log"
    env = {**os.environ, "LONGPROBE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", FIRST_LOAD, str(tokenizer_folder), str(log)]
    processes = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errors = [process.communicate()[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0], errors
    assert len(log.read_text().split()) == 1  # one process converted, the others waited and read it
    assert not [
        p.name for p in (tmp_path / "cache" / "models").iterdir() if p.name.startswith(".smollm2-135m-")
    ]  # no temp folder left


def test_a_truncated_conversion_is_rebuilt_with_a_warning(cache):
    folder = models.converted_folder("smollm2-135m")
    assert cache == ["smollm2-135m"] and models._damage(folder) is None
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert models._damage(folder) == "model.safetensors is truncated"
    with pytest.warns(UserWarning, match=r"is damaged \(model.safetensors is truncated\); converting"):
        assert models.converted_folder("smollm2-135m") == folder
    assert cache == ["smollm2-135m"] * 2 and models._damage(folder) is None
    probe.load_model("smollm2-135m")  # loads again


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda f: (f / "config.json").unlink(), "no config.json or no safetensors weights"),
        (lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"),
         "model.safetensors has a broken header"),
    ],
)  # fmt: skip
def test_other_damage_is_named(cache, damage, reason):
    folder = models.converted_folder("smollm2-135m")
    damage(folder)
    assert models._damage(folder) == reason


def test_the_cache_is_readable_by_the_group(cache):
    folder = models.converted_folder("smollm2-135m")
    assert stat.S_IMODE(folder.stat().st_mode) & 0o050 == 0o050
    assert all(stat.S_IMODE(path.stat().st_mode) & 0o040 for path in folder.iterdir())
