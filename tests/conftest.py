"""Shared fixtures: tiny random models for exactness tests, cached real models for the few real checks."""

import ctypes
import ctypes.util
import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # the suite never downloads: set before transformers is imported
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import probe  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 2)))  # 1 beside a running benchmark
RELEASE_FREED_HEAP = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)  # glibc only


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="the second device of tests/test_device.py (e.g. cuda); default: a virtual one on the CPU",
    )


def pytest_runtest_teardown(item):
    """Give freed heap back to the OS after each test. glibc keeps it otherwise (2–2.4 GB after each
    real-model test here), and pytest held ≈ 4 GB between tests on top of what the next one needs."""
    if RELEASE_FREED_HEAP is not None:
        RELEASE_FREED_HEAP(0)


def pytest_configure(config):
    """``--device cuda``: tests/test_device.py runs the public API with the model on the GPU and
    compares it with the CPU; the rest of the suite runs on the CPU either way. The default device
    stays the CPU (a default device of ``cuda`` would hide the very mistakes those tests look for).
    Without ``--device`` the second device is a virtual one (``tests/virtual_device.py``)."""
    device = config.getoption("--device")
    if device == "cpu":
        import virtual_device

        virtual_device.register()
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device}: no CUDA device is available here")


@pytest.fixture(params=["llama", "gemma3"])
def tiny(request):
    """A tiny random model: Llama-style with GQA, or Gemma-3-style with sliding-window layers."""
    return probe.tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (converted once to the user cache)."""
    return probe.load_model("smollm2-135m")


# the faithfulness tests' tokenizer, story and tiny models (tests/test_faithfulness.py, test_compaction.py)
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def story(tokenizer):
    """A real 2-hop sample (SmolLM2 tokenizer) and a tiny random model over the same vocabulary (the
    detector tests, tests/test_detectors.py and test_detector_dispatch.py)."""
    model = probe.tiny_model("llama", vocab_size=len(tokenizer))
    return model, probe.tasks.make("multihop-2", tokenizer, 256, seed=3)


@pytest.fixture(scope="module")
def sample(tokenizer):
    return probe.tasks.make("multihop-2", tokenizer, 300, seed=1)


@pytest.fixture(params=["llama", "gemma3"])
def model(request, tokenizer):
    return probe.tiny_model(request.param, vocab_size=len(tokenizer), max_position_embeddings=1024)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory):
    """A tiny random Llama saved with the real SmolLM2 tokenizer: loads by path like a real model, fast."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(probe.models.converted_folder("smollm2-135m"))
    folder = tmp_path_factory.mktemp("tiny-llama")
    probe.tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_argv(folder: Path) -> list[str]:
    """The ``compare_run`` fixture's settings."""
    return ["--model", str(folder), "--length", "192", "--samples", "1", "--masks", "8"]


@pytest.fixture(scope="module")
def compare_run(tiny_model_folder, tmp_path_factory):
    """The analysis at tiny settings: 2 tasks × 1 sample of 192 tokens, 8 random masks."""
    out = tmp_path_factory.mktemp("detector_compare")
    from analyses import detector_compare

    table = detector_compare.main([*run_argv(tiny_model_folder), "--out", str(out)])
    return table, out, f"{tiny_model_folder.name}-192"


class PassCounter:
    """Every masked pass of :func:`probe.faithfulness.answer_scores` counted in ``calls``; with
    :meth:`kill_after` the pass after that many is killed (``KeyboardInterrupt``), as a killed run is."""

    def __init__(self, monkeypatch):
        from probe import faithfulness

        self.calls, self.limit = 0, None
        for name in ("compacted_pass", "masked_pass"):
            monkeypatch.setattr(faithfulness, name, self._counted(getattr(faithfulness, name)))

    def _counted(self, function):
        def counted(*args, **kwargs):
            if self.calls == self.limit:
                raise KeyboardInterrupt("killed")
            self.calls += 1
            return function(*args, **kwargs)

        return counted

    def kill_after(self, limit: int | None) -> None:
        """Count from 0 again; kill the run at the pass after ``limit`` of them (None: never)."""
        self.calls, self.limit = 0, limit


@pytest.fixture
def sandbox():
    """The detector registry as it was, back after the test (:func:`probe.detectors.sandbox`): a test
    may register detectors or replace one (:func:`probe.detectors.replace`)."""
    with probe.detectors.sandbox():
        yield


@pytest.fixture
def passes(monkeypatch) -> PassCounter:
    """A :class:`PassCounter` of this test's masked passes."""
    return PassCounter(monkeypatch)


def closed(parts: Path) -> bool:
    """Whether ``parts`` is the folder a finished sweep leaves (:func:`analyses.sweep.finish`): its settings
    and one file of every job's tables, nothing else (no job part, no journal)."""
    return sorted(path.name for path in parts.iterdir()) == ["finished.pkl", "settings.json"]
