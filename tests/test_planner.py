"""The memory planner: terms and totals, monotonicity, the guard, and predicted vs. measured bytes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_architectures import build

import probe
from probe import memory
from probe.attention.capture import trace
from probe.attention.modifiers import KeyBias, KeyMask, bias_keys
from probe.attention.shared_state import frozen_parameters
from probe.memory import passes, planner
from probe.memory.planner import Plan, Shapes, auto_checkpoint, guard, plan

GRAD = ("information_flow", "answer_attribution", "embedding_grads")
ALL = (*GRAD, "embedding_grad_norms", "attention_rows", "forward")


@pytest.fixture
def deep():
    """A tiny Llama with 6 layers (checkpointing pays from a few layers on)."""
    return probe.tiny_model("llama", num_hidden_layers=6)


@pytest.mark.parametrize("name", ALL)
def test_terms_add_up_to_the_total(tiny, name):
    for checkpoint in (False, True):
        result = plan(tiny, 200, name, rows=4, checkpoint=checkpoint)
        assert result.total == sum(result.terms.values()) > 0
        assert result.terms == result.phases[result.phase]
        assert result.total == max(sum(terms.values()) for terms in result.phases.values())
        assert set(result.terms) == set(passes.TERMS)
        frame = result.to_frame()
        assert frame["bytes"].sum() == result.total
        assert frame["share"].sum() == pytest.approx(1)
        assert name in str(result) and "GiB" in str(result) or "MiB" in str(result)


@pytest.mark.parametrize("name", ALL)
def test_more_tokens_rows_or_no_checkpoint_need_more(deep, name):
    for checkpoint in (False, True):
        sizes = [plan(deep, n, name, rows=4, checkpoint=checkpoint).total for n in (64, 128, 256, 512)]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
        by_rows = [plan(deep, 256, name, rows=r, checkpoint=checkpoint).total for r in (1, 4, 16, 64)]
        assert by_rows == sorted(by_rows)
    if name in GRAD:
        assert plan(deep, 512, name).total > plan(deep, 512, name, checkpoint=True).total


def test_more_layers_and_batches_need_more(deep):
    assert plan(deep, 256, layers=[4, 5]).total < plan(deep, 256, layers=[2, 5]).total < plan(deep, 256).total
    assert plan(deep, 256, batch=2).total > 2 * plan(deep, 256).total * 0.99


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", GRAD)
def test_checkpointing_reduces_activations(arch, name):
    extra = {"layer_types": ["sliding_attention", "full_attention"] * 3} if arch == "gemma3" else {}
    model = probe.tiny_model(arch, num_hidden_layers=6, **extra)
    plain = plan(model, 400, name)
    checkpointed = plan(model, 400, name, checkpoint=True)
    assert checkpointed.terms["activations"] < plain.terms["activations"] / 2
    assert checkpointed.checkpoint and not plain.checkpoint
    assert plain.checkpointed_total == checkpointed.total


def test_sliding_window_masks_only_beyond_the_window():
    gemma = probe.tiny_model("gemma3")  # window 6
    short, long = plan(gemma, 6), plan(gemma, 300)
    assert short.terms["masks"] == short.terms["attention_workspace"] == 0
    assert long.terms["masks"] == 300 * 300  # one boolean [seq, seq] mask (the sliding kind)
    # plain pass: the float copy sdpa makes is saved in each sliding layer it differentiates: both
    # for embedding_grads (the model's own sdpa), none for information_flow beyond two windows (its
    # sliding layers run in bands), layer 2 only between one and two windows (nothing upstream of
    # layer 0 needs grad)
    assert (
        long.terms["attention_workspace"]
        == plan(gemma, 300, checkpoint=True).terms["attention_workspace"]
        == 0
    )
    assert plan(gemma, 10).terms["attention_workspace"] == 4 * 10 * 10
    assert plan(gemma, 300, "embedding_grads").terms["attention_workspace"] == 2 * 4 * 300 * 300
    banded = plan(gemma, 300).terms["activations"] - plan(gemma, 10).terms["activations"] * 30
    assert banded == 300 * 4 * (2 * 6 + 2 * 8)  # layer 2's band masks and band outputs
    llama = probe.tiny_model("llama")
    assert plan(llama, 300).terms["masks"] == 0
    key_mask = KeyMask(torch.zeros(1, 300, dtype=torch.bool))
    assert plan(llama, 300, modifiers=[key_mask]).terms["masks"] == 300 * 300


def test_check_raises_with_the_numbers_and_the_advice(deep):
    result = plan(deep, 500)
    assert result.check(available_bytes=result.total) is result
    with pytest.raises(planner.InsufficientMemoryError) as error:
        result.check(available_bytes=result.total // 10)
    message = str(error.value)
    assert error.value.plan is result and error.value.available == result.total // 10
    assert isinstance(error.value, MemoryError)
    assert message.startswith("information_flow on 500 tokens needs ≈ ")
    assert "free: pass checkpoint=True (≈ " in message
    assert "fewer layers, or a shorter input" in message and "activations" in message
    with pytest.raises(planner.InsufficientMemoryError, match="fewer layers or target rows"):
        plan(deep, 500, checkpoint=True).check(available_bytes=1)
    assert plan(deep, 500).check() is not None  # the real free memory: a tiny model fits


def test_auto_checkpoint_and_guard(deep):
    plain, checkpointed = plan(deep, 500), plan(deep, 500, checkpoint=True)
    between = (plain.total + checkpointed.total) // 2
    assert auto_checkpoint(deep, 500, available_bytes=between)
    assert not auto_checkpoint(deep, 500, available_bytes=plain.total)
    assert not auto_checkpoint(deep, 500, available_bytes=checkpointed.total - 1)
    assert not auto_checkpoint(deep, 500, "attention_rows", available_bytes=1)
    assert guard(deep, 500, checkpoint="auto", available_bytes=between) is True
    assert guard(deep, 500, checkpoint="auto", available_bytes=plain.total) is False
    assert guard(deep, 500, checkpoint=False, available_bytes=plain.total) is False
    with pytest.raises(planner.InsufficientMemoryError, match="checkpoint=True"):
        guard(deep, 500, checkpoint=False, available_bytes=between)
    # neither fits: "auto" reports the checkpointed need
    with pytest.raises(planner.InsufficientMemoryError, match="fewer layers or target rows"):
        guard(deep, 500, checkpoint="auto", available_bytes=checkpointed.total - 1)
    with pytest.raises(ValueError, match="'auto'"):
        guard(deep, 500, checkpoint="yes")
    assert guard(deep, 500, checkpoint="auto") is False  # plenty free for a tiny model


def test_allocator_slack_only_on_cpu_with_glibc_defaults(deep, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert plan(deep, 256).terms["allocator"] > 0
    assert plan(deep, 256, "attention_rows").terms["allocator"] == 0
    cuda = dataclasses.replace(Shapes.of(deep), device="cuda")
    assert plan(cuda, 256).terms["allocator"] == 0
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert plan(deep, 256).terms["allocator"] == 0
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setattr(memory, "_compact_heap", True)  # what compact_heap() sets
    assert plan(deep, 256).terms["allocator"] == 0


def test_a_config_plans_like_its_model(tiny):
    assert Shapes.of(tiny.config) == Shapes.of(tiny)
    assert plan(tiny.config, 300).terms == plan(tiny, 300).terms


def test_shapes_of_the_tiny_models():
    llama, gemma = Shapes.of(probe.tiny_model("llama")), Shapes.of(probe.tiny_model("gemma3"))
    assert (llama.hidden_norms, llama.qk_norms, llama.windows) == (2, False, (None,) * 3)
    assert (gemma.hidden_norms, gemma.qk_norms, gemma.windows) == (4, True, (6, None, 6, None))
    assert (gemma.rope_kinds, llama.rope_kinds, llama.act_bytes) == (2, 1, 4)
    half = probe.tiny_model("llama").to(torch.bfloat16)
    assert Shapes.of(half).act_bytes == 2
    assert plan(half, 256).terms["activations"] < plan(probe.tiny_model("llama"), 256).terms["activations"]


def test_bad_arguments(tiny):
    with pytest.raises(ValueError, match="unknown probe"):
        plan(tiny, 100, "attention_matrices")
    with pytest.raises(IndexError, match="out of range"):
        plan(tiny, 100, layers=[7])
    with pytest.raises(ValueError, match="at least 1"):
        plan(tiny, 0)


def test_available_memory_is_read():
    free = planner.available_memory("cpu")
    assert free is None or free > 0
    assert isinstance(plan(probe.tiny_model(), 10), Plan)


def _saved_bytes(model, run, modules=None) -> int:
    """Bytes autograd saves inside ``modules`` (default: the decoder layers) while ``run()`` runs:
    distinct storages, parameters and captured attention rows (counted by the planner as
    ``captured_rows``) left out."""
    params = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    inside, seen = [False], {}
    for module in model.model.layers if modules is None else modules:
        module.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        module.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cache = run()
    rows = {t.untyped_storage().data_ptr() for t in cache.values()} if cache is not None else set()
    return sum(size for ptr, size in seen.items() if ptr not in rows)


def _probe_run(model, name: str, n: int, rows: int, layers=None):
    """A call of probe ``name`` on random ids: ``information_flow`` as a trace of the target loss."""
    ids = torch.randint(0, 128, (1, n))
    targets = torch.arange(n - rows, n)

    def run():
        if name == "embedding_grads":
            probe.embedding_grads(model, ids, targets)
            return None
        with (
            probe.attention.shared_state.frozen_parameters(model),
            torch.enable_grad(),
            trace(model, rows=targets - 1, layers=layers, grad=True) as cache,
        ):
            probe.target_loss(model, ids, targets).backward()
        return cache

    return run


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "name,layers", [("information_flow", None), ("information_flow", [1, 2]), ("embedding_grads", None)]
)
def test_predicted_activations_equal_the_bytes_autograd_saves(arch, name, layers):
    """The measured-vs-predicted check that does not depend on the allocator: what the layers save
    for backward (saved-tensor hooks) against ``activations`` + the saved float masks."""
    model = probe.tiny_model(arch, num_hidden_layers=4, max_position_embeddings=512)
    n, rows = 300, 4
    measured = _saved_bytes(model, _probe_run(model, name, n, rows, layers))
    predicted = plan(model, n, name, rows=rows, layers=layers)
    expected = predicted.terms["activations"] + predicted.terms["attention_workspace"]
    # what the planner leaves to other terms: rotary tables, row-sized tensors (< 4 % on tiny shapes)
    assert measured == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_key_bias_on_the_flash_kernel_saves_what_the_planner_counts(arch):
    """``key_removal_gradient``'s pass (a key bias with a gradient, units at ½ presence): the flash
    kernel keeps no ``[n, n]`` tensor a layer, so the layers save what a plain pass saves."""
    model = probe.tiny_model(arch, num_hidden_layers=4, max_position_embeddings=512)
    n, rows = 300, 4
    ids, targets = torch.randint(0, 128, (1, n)), torch.arange(n - rows, n)
    units = torch.arange(n)
    units[10:50] = n
    bias = torch.where(units >= n, -0.69, 0.0)[None].requires_grad_()

    def run():
        with bias_keys(model, bias, units), frozen_parameters(model), torch.enable_grad():
            probe.target_loss(model, ids, targets).backward()

    measured = _saved_bytes(model, run)
    predicted = plan(model, n, "embedding_grads", rows=rows, modifiers=[KeyBias(bias, units)]).terms
    assert measured == pytest.approx(predicted["activations"] + predicted["attention_workspace"], rel=0.05)


@pytest.mark.parametrize(
    "arch,name",
    [
        ("Gemma 2 (logit soft-capping)", "information_flow"),  # longprobe's exact softmax
        ("Gemma 2 (logit soft-capping)", "embedding_grads"),  # eager, soft-capped
        ("Llama", "embedding_grads"),  # eager
    ],
)
def test_eager_and_exact_softmax_attention_save_what_the_planner_counts(arch, name):
    """The model's own eager attention (a plain pass) and longprobe's exact softmax for soft-capped
    logits (a trace) each keep every row's probabilities, ``[heads, n, n]`` a layer: the planner counts
    them (Gemma 2 runs eager by default; the Llama is switched to eager)."""
    model = build(arch)
    model.set_attn_implementation("eager")
    n, rows = 300, 4
    measured = _saved_bytes(model, _probe_run(model, name, n, rows))
    predicted = plan(model, n, name, rows=rows)
    expected = predicted.terms["activations"] + predicted.terms["attention_workspace"]
    assert Shapes.of(model).eager
    assert measured == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("name", ["information_flow", "embedding_grads"])
def test_attention_with_sink_logits_saves_what_the_planner_counts(name):
    """gpt-oss's sink logits, eager (a plain pass) and longprobe's exact softmax (a trace): the bytes
    its attention modules save against :meth:`Shapes.attention_saved` of the differentiated layers (its
    mixture-of-experts MLP is not modelled by the planner, so whole layers are not compared)."""
    model = build("gpt-oss (sink logits)")
    n, rows = 300, 4
    attention = [layer.self_attn for layer in model.model.layers]
    measured = _saved_bytes(model, _probe_run(model, name, n, rows), attention)
    shapes = Shapes.of(model)
    own = name == "information_flow"  # a trace runs longprobe's attention function
    differentiated = range(1 if own else 0, shapes.layers)  # a trace's first layer saves no attention
    path = shapes.attention_path(own)
    expected = n * sum(shapes.attention_saved(n, True, path) for _ in differentiated)
    assert shapes.sinks and path == ("exact" if own else "eager")
    assert measured == pytest.approx(expected, rel=0.05)


@pytest.mark.real
def test_predicted_peak_matches_measured_rss_on_smollm2():
    """Peak RSS of a child process with a fixed mmap threshold (freed tensors go back to the system,
    so RSS follows the live tensors) against the plan, plain and checkpointed, at 512 tokens."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "bench.planner_validation", "--model", "smollm2-135m", "--threads", "1"]
    command += ["--child"]
    for method in ("plain", "checkpointed"):
        done = subprocess.run(
            [*command, method, "512"],
            capture_output=True,
            text=True,
            env=env,
            cwd=root,
            check=True,
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        assert row["allocator_mib"] == 0
        assert row["peak_mib"] == pytest.approx(row["predicted_mib"], rel=0.15), row
