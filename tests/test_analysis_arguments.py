"""Every analysis takes ``--device`` / ``--dtype``, refuses a device this machine lacks and an ``--out``
that is not a folder before any model loads, and loads its models through :func:`analyses.arguments.load`."""

import argparse
import importlib

import pytest
import torch

import probe
from analyses import arguments
from analyses.sweep import process_device

ANALYSES = [
    "attribute",
    "detector_compare",
    "learn_head_weights",
    "longppl",
    "noise_restraint",
    "objectives",
    "position_bias",
    "retrieval_heads",
    "task_accuracy",
]
MODULES = [importlib.import_module(f"analyses.{name}") for name in ANALYSES]
MODEL = "never-loaded/model"


class Loaded(Exception):
    """What the stand-in loader raises: a model load was reached."""


@pytest.fixture
def loads(monkeypatch) -> list[dict]:
    """``probe.load_model`` replaced by a recorder that raises :class:`Loaded`: the calls it got."""
    calls = []

    def load_model(spec, **options):
        calls.append({"spec": spec, **options})
        raise Loaded(spec)

    monkeypatch.setattr(probe, "load_model", load_model)
    return calls


def cli(module, tmp_path, *extra: str) -> list[str]:
    """The arguments that get ``module`` to its model load: a model, an output folder in
    ``tmp_path``, whatever the analysis requires (attribute: a document and a query), and ``extra``."""
    argv = ["--out", str(tmp_path / "out"), *extra]
    name = module.__name__.removeprefix("analyses.")
    if name == "attribute":
        (tmp_path / "doc.txt").write_text("One sentence. Another one.")
        argv += ["--model", MODEL, "--context", str(tmp_path / "doc.txt"), "--query", "Which?"]
    elif name == "position_bias":
        argv += ["--parts", "real", "--models", MODEL, "--threads", str(torch.get_num_threads())]
    elif name == "longppl":
        argv += ["--evaluator", MODEL]
    elif name in ("detector_compare", "learn_head_weights", "objectives"):
        argv += ["--model", MODEL]
    else:
        argv += ["--models", MODEL]
    return argv


def namespace(module, argv: list[str]) -> argparse.Namespace:
    parsed = module.parse_args(argv)
    return parsed[1] if isinstance(parsed, tuple) else parsed  # position_bias: (preset, args)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_analysis_takes_device_and_dtype(module, tmp_path):
    args = namespace(module, cli(module, tmp_path, "--device", "cpu", "--dtype", "float32"))
    assert (args.device, args.dtype) == ("cpu", "float32")
    args = namespace(module, cli(module, tmp_path))
    assert (args.device, args.dtype) == (None, None)  # the process's device, the model's own dtype


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--device", "nosuchdevice"], "--device nosuchdevice is not available"),
        (["--dtype", "float64"], "--dtype: invalid choice"),
    ],
)
def test_a_bad_device_or_dtype_is_refused_before_a_model_loads(
    module, tmp_path, capsys, loads, extra, message
):
    with pytest.raises(SystemExit):
        module.main(cli(module, tmp_path, *extra))
    assert message in capsys.readouterr().err and not loads


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_an_out_that_is_a_file_is_refused_before_a_model_loads(module, tmp_path, capsys, loads):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(SystemExit):
        module.main(cli(module, tmp_path))
    assert "is not a folder" in capsys.readouterr().err and not loads


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_analysis_loads_on_the_chosen_device_in_the_chosen_dtype(module, tmp_path, loads):
    with pytest.raises(Loaded):
        module.main(cli(module, tmp_path, "--device", "cpu", "--dtype", "bfloat16"))
    assert loads == [{"spec": MODEL, "dtype": torch.bfloat16, "device": "cpu"}]


def test_load_defaults_to_the_process_gpu_and_the_model_dtype(loads):
    args = argparse.Namespace(model=MODEL, device=None, dtype=None)
    with pytest.raises(Loaded):
        arguments.load(args)
    with pytest.raises(Loaded):
        arguments.load(argparse.Namespace(model=MODEL, device="cpu", dtype="float16"), "other")
    own = process_device() if torch.cuda.is_available() else None  # without GPUs: the loader's CPU
    assert loads == [
        {"spec": MODEL, "dtype": None, "device": own},
        {"spec": "other", "dtype": torch.float16, "device": "cpu"},
    ]


@pytest.mark.parametrize(
    ("name", "argv", "message"),
    [
        ("task_accuracy", ["--samples", "-2"], "--samples must be >= 0"),
        ("retrieval_heads", ["--ks", "-1"], "--ks must be numbers of heads >= 0"),
        ("retrieval_heads", ["--depths", "1.5"], "--depths are fractions"),
        ("position_bias", ["--steps", "0"], "the layer counts must be at least 1"),
        ("detector_compare", ["--lsd-k", "0"], "--lsd-k must be between 1"),
        ("detector_compare", ["--top-k", "0"], "--top-k must be at least 1"),
    ],
)
def test_bad_counts_are_refused_before_any_model_loads(name, argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(probe, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    module = importlib.import_module(f"analyses.{name}")
    with pytest.raises(SystemExit):
        module.main([*argv, "--out", str(tmp_path)])
    assert message in capsys.readouterr().err
