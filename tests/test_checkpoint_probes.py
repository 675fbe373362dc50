"""``checkpoint=False | True | "auto"`` on every gradient probe: the same numbers either way, and the
memory guard that refuses a call before it allocates."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

import probe
from probe import checks, detectors, tasks
from probe.memory import checkpointing, planner
from probe.models import converted_folder
from probe.probes import noise_restraint
from probe.training.objectives import cdt_loss


def _flow(model, tokenizer, sample, checkpoint):
    return probe.information_flow(model, sample.input_ids, sample.target_positions, checkpoint=checkpoint)


def _grads(model, tokenizer, sample, checkpoint):
    return probe.embedding_grads(model, sample.input_ids, sample.target_positions, checkpoint=checkpoint)


def _grad_norms(model, tokenizer, sample, checkpoint):
    return probe.embedding_grad_norms(model, sample.input_ids, sample.target_positions, checkpoint=checkpoint)


def _attribution(model, tokenizer, sample, checkpoint):
    found = probe.answer_attribution(model, sample.input_ids, sample.target_positions, checkpoint=checkpoint)
    return [found.pattern, found.pattern_grad, found.embedding_grad]


def _detector(name, **options):
    def run(model, tokenizer, sample, checkpoint):
        return detectors.detect(name, model, tokenizer, sample, checkpoint=checkpoint, **options).scores

    return run


def _shared_pass(model, tokenizer, sample, checkpoint):
    names = ["attention", "information_flow", "embedding_grad"]
    found = detectors.detect_many(names, model, tokenizer, sample, checkpoint=checkpoint)
    return [detection.scores for detection in found.values()]


def _noise_restraint(model, tokenizer, sample, checkpoint):
    table = noise_restraint.noise_restraint(model, sample, [0.5, 2.0], checkpoint=checkpoint)
    return torch.tensor(table[["after", "loss_after", "shift"]].to_numpy(dtype=float))


def _cdt_loss(model, tokenizer, sample, checkpoint):
    """The loss, and the parameters' gradients of its backward (taken outside the probe)."""
    model.zero_grad()
    result = cdt_loss(model, sample.input_ids, sample.target_positions, lr=0.5, context=sample.prompt_length,
                      checkpoint=checkpoint)  # fmt: skip
    result.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return [result.loss.detach(), result.shift, *grads]


PROBES = {
    "information_flow": _flow,
    "embedding_grads": _grads,
    "embedding_grad_norms": _grad_norms,
    "answer_attribution": _attribution,
    "detector information_flow": _detector("information_flow"),
    "detector embedding_grad": _detector("embedding_grad"),
    "detector integrated_gradients": _detector("integrated_gradients", n_steps=4),
    "detect_many (shared pass)": _shared_pass,
    "noise_restraint": _noise_restraint,
    "cdt_loss": _cdt_loss,
}


def _run_counting(monkeypatch, run, *args) -> tuple[list[torch.Tensor], int]:
    """``run(*args)`` as a list of tensors, and how many times a decoder layer was checkpointed."""
    calls = []
    real = checkpointing.checkpoint
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = run(*args)
    monkeypatch.setattr(checkpointing, "checkpoint", real)
    return (list(out) if isinstance(out, list) else [out]), len(calls)


def assert_checkpointing_changes_nothing(monkeypatch, run, model, tokenizer, sample, tolerance=1e-6):
    plain, plain_calls = _run_counting(monkeypatch, run, model, tokenizer, sample, False)
    checkpointed, calls = _run_counting(monkeypatch, run, model, tokenizer, sample, True)
    assert plain_calls == 0 and calls >= checks.n_layers(model)
    for a, b in zip(plain, checkpointed, strict=True):
        assert (a - b).abs().max() <= tolerance * max(1.0, float(a.abs().max())), (a - b).abs().max()
    assert not any("forward" in vars(m) for m in model.modules())  # the layers are restored


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(converted_folder("smollm2-135m"))


@pytest.fixture(scope="module")
def sample(tokenizer):
    return tasks.make("multihop-1", tokenizer, 160, seed=2)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name", PROBES)
def test_checkpointed_probes_equal_the_plain_pass(monkeypatch, tokenizer, sample, arch, name):
    model = probe.tiny_model(arch, vocab_size=len(tokenizer))
    assert_checkpointing_changes_nothing(monkeypatch, PROBES[name], model, tokenizer, sample)


@pytest.mark.real
def test_checkpointed_probes_equal_the_plain_pass_on_smollm2(monkeypatch, smollm2, tokenizer):
    """Every probe above on the real SmolLM2-135M at 512 tokens (fp32)."""
    model, _ = smollm2
    long_sample = tasks.make("multihop-1", tokenizer, 512, seed=0)
    for name, run in PROBES.items():
        if name != "cdt_loss":  # a training step: the tiny models check its gradients
            assert_checkpointing_changes_nothing(monkeypatch, run, model, tokenizer, long_sample)


def test_auto_checkpoints_when_only_the_checkpointed_pass_fits(monkeypatch, tokenizer, sample):
    model = probe.tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=6)
    n, rows = len(sample.input_ids), len(sample.target_positions)
    plain = planner.plan(model, n, "information_flow", rows=rows)
    between = (plain.total + plain.checkpointed_total) // 2
    monkeypatch.setattr(planner, "available_memory", lambda device: between)
    (auto,), calls = _run_counting(monkeypatch, _flow, model, tokenizer, sample, "auto")
    assert calls == 6
    monkeypatch.setattr(planner, "available_memory", lambda device: plain.total)
    (reference,), calls = _run_counting(monkeypatch, _flow, model, tokenizer, sample, "auto")
    assert calls == 0 and (auto - reference).abs().max() <= 1e-6


@pytest.mark.parametrize("name", [n for n in PROBES if n != "noise_restraint"])
def test_a_call_that_cannot_fit_is_refused_before_any_forward(monkeypatch, tokenizer, sample, name):
    model = probe.tiny_model("llama", vocab_size=len(tokenizer))
    forwards = []
    model.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    monkeypatch.setattr(planner, "available_memory", lambda device: 1000)
    with pytest.raises(planner.InsufficientMemoryError, match=r"needs ≈ .* free: "):
        PROBES[name](model, tokenizer, sample, "auto")
    assert forwards == [] and not any("forward" in vars(m) for m in model.modules())


def test_attention_rows_are_guarded_too(monkeypatch, tiny):
    monkeypatch.setattr(planner, "available_memory", lambda device: 1000)
    with pytest.raises(planner.InsufficientMemoryError, match="attention_rows on 50 tokens needs ≈"):
        probe.attention_rows(tiny, torch.arange(50), [10, 49])


def test_nested_checkpointing_restores_only_its_own_layers(tiny):
    ids, targets = torch.randint(0, 128, (1, 40)), torch.arange(30, 40)
    with checkpointing.checkpointed(tiny):
        wrapped = [vars(m)["forward"] for m in tiny.modules() if "forward" in vars(m)]
        probe.information_flow(tiny, ids, targets, checkpoint=True)
        assert [vars(m)["forward"] for m in tiny.modules() if "forward" in vars(m)] == wrapped
    assert not any("forward" in vars(m) for m in tiny.modules())
