"""Context-noise restraint against a slow eager reference; which tokens move; the model is left alone."""

import numpy as np
import pytest
import torch

import probe
from probe.probes import noise_restraint
from probe.probes.attribution import critical_tokens
from probe.tasks import Sample

ATOL = 1e-5
SPANS = {
    "noise": [(2, 10), (13, 18), (22, 30)],
    "supporting": [(10, 13)],
    "low_frequency": [(18, 19)],
    "interference": [(19, 22)],
    "question": [(30, 34)],
    "answer": [(36, 39)],
}  # tokens 0-1 and 34-35 stay uncategorised ("other": chat template)
MOVED = {
    "noise": [*range(2, 10), *range(13, 19), *range(22, 30)],
    "non_supporting": [*range(2, 10), *range(13, 30)],
}


def hand_sample(seq: int = 39) -> Sample:
    """Random ids with hand-made spans: context 0-35, teacher-forced answer 36-38."""
    ids = torch.randint(10, 128, (seq,), generator=torch.Generator().manual_seed(1))
    return Sample(
        task="hand", length=seq, seed=0, depth=None, options={}, text="", input_ids=ids, answer="",
        answer_pattern="", prompt_length=36, spans=SPANS, char_spans={},
        offsets=np.zeros((seq, 2), dtype=np.int64),
    )  # fmt: skip


def eager_reference(model, sample, lrs, beta, move):
    """Per step: (masses {category: [layers]} before, after, loss before, after), the slow way.

    ∂L/∂E from a leaf ``inputs_embeds`` with trainable parameters, E' = E − lr·β·∇E written out, and
    eager attention with ``output_attentions`` on E and E'.
    """
    ids = sample.input_ids[None]
    targets = torch.arange(36, 39)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, use_cache=False).logits[0, targets - 1]
    torch.nn.functional.cross_entropy(logits, ids[0, targets]).backward()
    model.zero_grad(set_to_none=True)
    mask = torch.zeros(ids.shape[1], 1)
    mask[move] = 1.0

    def run(inputs):
        original = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            with torch.no_grad():
                out = model(inputs_embeds=inputs, output_attentions=True, use_cache=False)
        finally:
            model.set_attn_implementation(original)
        per_token = torch.stack(out.attentions)[:, 0][:, :, targets - 1].mean(dim=(1, 2))  # [L, S]
        masses = {"other": per_token[:, [0, 1, 34, 35]].sum(-1)}
        for category, spans in SPANS.items():
            masses[category] = sum(per_token[:, a:b].sum(-1) for a, b in spans)
        loss = torch.nn.functional.cross_entropy(out.logits[0, targets - 1], ids[0, targets])
        return masses, float(loss)

    before, loss_before = run(embeds.detach())
    results = []
    for lr in lrs:
        after, loss_after = run(embeds.detach() - lr * beta * embeds.grad * mask)
        results.append((before, after, loss_before, loss_after))
    return results


@pytest.mark.parametrize("move", ["noise", "non_supporting"])
def test_matches_eager_reference(tiny, move):
    lrs = [0.0, 0.3, 2.0]
    table = noise_restraint.noise_restraint(tiny, hand_sample(), lrs, beta=5.0, move=move)
    assert len(table) == len(lrs) * tiny.config.num_hidden_layers * (len(SPANS) + 1)
    for lr, (before, after, loss_before, loss_after) in zip(
        lrs, eager_reference(tiny, hand_sample(), lrs, 5.0, MOVED[move]), strict=True
    ):
        got = table[table.lr == lr]
        assert (got.step == lr * 5.0).all() and (got.move == move).all()
        for category in before:
            rows = got[got.category == category].sort_values("layer")
            assert list(rows.layer) == list(range(tiny.config.num_hidden_layers))
            np.testing.assert_allclose(rows.before, before[category], atol=ATOL, rtol=0)
            np.testing.assert_allclose(rows.after, after[category], atol=ATOL, rtol=0)
        assert got.loss_before.iloc[0] == pytest.approx(loss_before, rel=1e-5)
        assert got.loss_after.iloc[0] == pytest.approx(loss_after, rel=1e-5)
    assert table[table.lr == 2.0].loss_after.iloc[0] != pytest.approx(table.loss_before.iloc[0], rel=1e-3)


def test_masses_count_tokens_and_sum_to_one(tiny):
    table = noise_restraint.noise_restraint(tiny, hand_sample(), 0.5, move="noise")
    first_layer = table[table.layer == 0].set_index("category")
    assert first_layer.tokens.to_dict() == {
        "supporting": 3, "interference": 3, "noise": 21, "low_frequency": 1, "question": 4, "answer": 3,
        "other": 4,
    }  # fmt: skip
    assert first_layer.moved.to_dict() == {
        "supporting": 0, "interference": 0, "noise": 21, "low_frequency": 1, "question": 0, "answer": 0,
        "other": 0,
    }  # fmt: skip
    for column in ("before", "after"):
        np.testing.assert_allclose(table.groupby("layer")[column].sum(), 1.0, atol=ATOL)


def test_zero_step_leaves_attention_and_loss_unchanged(tiny):
    table = noise_restraint.noise_restraint(tiny, hand_sample(), 0.0)
    assert (table.after == table.before).all() and (table.loss_after == table.loss_before).all()
    seen = table.before > 0  # sliding-window layers may not see a category at all
    assert (table.ratio[seen] == 1.0).all() and table.ratio[~seen].isna().all()
    assert (table["shift"] == 0).all()


def test_small_step_against_the_gradient_lowers_the_loss(tiny):
    table = noise_restraint.noise_restraint(tiny, hand_sample(), [1e-3, -1e-3], move="non_supporting")
    down, up = table.groupby("lr").loss_after.first().loc[[1e-3, -1e-3]]
    assert down < table.loss_before.iloc[0] < up


@pytest.mark.parametrize("move", ["noise", "non_supporting", "detected", "mask"])
def test_only_the_chosen_tokens_move(tiny, move, monkeypatch):
    sample = hand_sample()
    grads = probe.embedding_grads(tiny, sample.input_ids, torch.arange(36, 39))
    if move == "detected":
        expected = ~critical_tokens(grads.norm(dim=-1), context=36)
        expected[36:] = False
    else:
        expected = torch.zeros(len(sample.input_ids), dtype=torch.bool)
        expected[[3, 11, 20, 37] if move == "mask" else MOVED[move]] = True
    assert 0 < expected.sum() < 36
    seen = []
    original = noise_restraint.answer_attention
    monkeypatch.setattr(noise_restraint, "answer_attention", lambda *a: seen.append(a[-1]) or original(*a))
    moved = expected.clone() if move == "mask" else move
    table = noise_restraint.noise_restraint(tiny, sample, 1.0, move=moved)
    before, after = seen
    assert torch.equal((after != before).any(dim=-1), expected)
    assert torch.equal(before, tiny.get_input_embeddings()(sample.input_ids))
    torch.testing.assert_close(after[expected], (before - 5.0 * grads)[expected], atol=ATOL, rtol=0)
    assert table.moved.iloc[: len(SPANS) + 1].sum() == expected.sum()


@pytest.mark.parametrize(
    "move, error",
    [
        ("everything", "move must be one of"),
        (torch.ones(39), "BoolTensor\\[39\\]"),
        (torch.ones(5, dtype=torch.bool), "39"),
    ],
)
def test_bad_moves_are_refused(tiny, move, error):
    with pytest.raises(ValueError, match=error):
        noise_restraint.noise_restraint(tiny, hand_sample(), 1.0, move=move)


def model_state(model):
    return (
        {name: p.detach().clone() for name, p in model.named_parameters()},
        {name: p.requires_grad for name, p in model.named_parameters()},
        [m.training for m in model.modules()],
        model.config._attn_implementation,
    )


def assert_same_state(model, state):
    params, flags, modes, attention = model_state(model)
    assert all(torch.equal(params[name], state[0][name]) for name in params)
    assert flags == state[1] and modes == state[2] and attention == state[3]
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("fail_on_forward", [None, 1, 2, 3])
def test_model_is_left_unmodified(tiny, fail_on_forward):
    """Also when a forward pass (gradient, before, after) raises midway."""
    tiny.train()
    tiny.get_input_embeddings().requires_grad_(False)
    state = model_state(tiny)
    calls = []

    def hook(module, args):
        calls.append(1)
        if len(calls) == fail_on_forward:
            raise RuntimeError("injected failure")

    handle = tiny.model.layers[-1].register_forward_pre_hook(hook)
    try:
        if fail_on_forward is None:
            noise_restraint.noise_restraint(tiny, hand_sample(), [0.5, 1.0])
            assert len(calls) == 4  # gradient, before, two steps
        else:
            with pytest.raises(RuntimeError, match="injected"):
                noise_restraint.noise_restraint(tiny, hand_sample(), [0.5, 1.0])
    finally:
        handle.remove()
    assert_same_state(tiny, state)
