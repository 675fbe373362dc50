"""Training objectives (probe.training.objectives) against hand-computed values and step-by-step
references."""

import math

import pytest
import torch
import torch.nn.functional as F

import probe
from probe.probes.attribution import critical_tokens
from probe.probes.noise_restraint import denoised_embeddings, noise_tokens
from probe.training.objectives import cdt_loss, logo_loss, longce_target_loss, sequence_logprob


def random_ids(model, seq: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (1, seq), generator=generator)


def full_logprobs(model, ids: torch.Tensor, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """log P(x_t | x_<t) for t = 1 … seq−1 from the full [seq, vocab] logits: Tensor[seq − 1]."""
    inputs = {"input_ids": ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
    logits = model(**inputs).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


# --------------------------------------------------------------------------- CDT eqs. 1–2


def test_critical_tokens_of_a_small_vector():
    norms = torch.tensor([1.0, 3.0, 2.0, 0.0, 10.0])
    # all five: mean 3.2 → only 10 reaches it
    assert critical_tokens(norms).tolist() == [False, False, False, False, True]
    # first four: mean 1.5 → 3 and 2; the token after the context is never critical
    assert critical_tokens(norms, context=4).tolist() == [False, True, True, False, False]
    assert critical_tokens(torch.tensor([2.0, 2.0])).tolist() == [True, True]  # ≥ the mean, not >
    for bad in (0, 6):
        with pytest.raises(ValueError, match="context"):
            critical_tokens(norms, context=bad)


def test_noise_tokens_are_the_non_critical_context_tokens():
    norms = torch.tensor([1.0, 3.0, 2.0, 0.0, 10.0])
    assert noise_tokens(norms).tolist() == [True, True, True, True, False]
    # the token after the context is neither critical nor moved
    assert noise_tokens(norms, context=4).tolist() == [True, False, False, True, False]


def test_denoised_embeddings_moves_only_the_masked_rows_by_lr_beta_grad():
    generator = torch.Generator().manual_seed(0)
    embeds, grads = torch.randn(5, 3, generator=generator), torch.randn(5, 3, generator=generator)
    move = torch.tensor([True, False, True, False, False])
    out = denoised_embeddings(embeds, grads, move, lr=0.1, beta=5.0)
    assert torch.equal(out[~move], embeds[~move])
    torch.testing.assert_close(out[move], embeds[move] - 0.5 * grads[move], rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"\[seq, hidden\]"):
        denoised_embeddings(embeds, grads, move[:4], lr=0.1)


# --------------------------------------------------------------------------- CDT eq. 3, online


def reference_cdt(model, ids, targets, lr, beta, context):
    """CDT written out step by step with a leaf embedding tensor: (loss, critical, shift)."""
    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    leaf = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=leaf).logits[0]
    F.cross_entropy(logits[targets - 1], ids[0, targets]).backward()
    norms = leaf.grad[0].norm(dim=-1)
    context = ids.shape[1] if context is None else context
    critical = torch.zeros(ids.shape[1], dtype=torch.bool)
    critical[:context] = norms[:context] >= norms[:context].mean()
    noise = ~critical
    noise[context:] = False
    shift = -lr * beta * leaf.grad[0] * noise[:, None]
    for param, flag in zip(model.parameters(), flags, strict=True):
        param.requires_grad_(flag)
    denoised = model.get_input_embeddings()(ids) + shift
    logits = model(inputs_embeds=denoised).logits[0]
    return F.cross_entropy(logits[targets - 1], ids[0, targets]), critical, shift


@pytest.mark.parametrize("context", [None, 14])
def test_cdt_loss_matches_the_step_by_step_reference(tiny, context):
    ids, targets = random_ids(tiny, 20), torch.tensor([15, 17, 18])
    lr, beta = 0.5, 5.0  # a large step, so that denoising visibly changes the loss
    expected_loss, expected_critical, expected_shift = reference_cdt(tiny, ids, targets, lr, beta, context)
    expected_loss.backward()
    expected_grads = [p.grad.clone() for p in tiny.parameters()]
    tiny.zero_grad()

    result = cdt_loss(tiny, ids, targets, lr, beta, context=context)
    result.loss.backward()

    assert torch.equal(result.critical, expected_critical)
    assert 0 < result.critical.sum() < (context or 20)
    torch.testing.assert_close(result.shift, expected_shift, rtol=0, atol=1e-6)
    torch.testing.assert_close(result.loss, expected_loss, rtol=0, atol=1e-5)
    for param, expected in zip(tiny.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        plain = probe.target_loss(tiny, ids, targets)
    assert abs(result.loss.item() - plain.item()) > 1e-4  # the denoised input is not the plain input
    if context is not None:
        assert not result.shift[context:].any() and not result.critical[context:].any()


@pytest.mark.parametrize("training", [True, False])
def test_cdt_loss_leaves_flags_and_mode_as_they_were(training):
    model = probe.tiny_model("llama")
    model.train(training)
    model.model.layers[0].requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    ids = random_ids(model, 12)
    cdt_loss(model, ids, [10, 11], lr=0.1, context=10).loss.backward()
    assert [p.requires_grad for p in model.parameters()] == flags
    assert model.training is training
    assert all(p.grad is None for p in model.model.layers[0].parameters())
    assert all(p.grad is not None for p in model.model.layers[1].parameters())


# --------------------------------------------------------------------------- LongCE on targets


def test_longce_target_loss_matches_the_per_token_reference(tiny):
    ids, K, gamma = random_ids(tiny, 24, seed=1), 6, 5.0
    targets = torch.tensor([4, 9, 16, 23])  # t = 4 ≤ K has no short context: weight 1
    long = full_logprobs(tiny, ids)[targets - 1]
    with torch.no_grad():
        short = torch.tensor(
            [full_logprobs(tiny, ids[:, t - K : t + 1])[-1] for t in targets.tolist()[1:]]
        )  # exactly the K previous tokens
    weights = torch.cat([torch.ones(1), torch.clamp((long[1:].detach() - short).exp(), max=gamma)])
    expected = -(weights * long).mean()
    expected.backward()
    expected_grads = [p.grad.clone() for p in tiny.parameters()]
    tiny.zero_grad()

    loss = longce_target_loss(tiny, ids, targets, K=K, gamma=gamma)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    for param, grad in zip(tiny.parameters(), expected_grads, strict=True):  # weights carry no gradient
        torch.testing.assert_close(param.grad, grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(weights, torch.ones(4))


def test_longce_target_loss_is_plain_cross_entropy_when_no_target_has_a_short_context(tiny):
    ids = random_ids(tiny, 24, seed=2)
    loss = longce_target_loss(tiny, ids, [5, 8], K=10)
    torch.testing.assert_close(loss, probe.target_loss(tiny, ids, torch.tensor([5, 8])), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- LOGO


def test_sequence_logprob_sums_the_response_tokens(tiny):
    ids = random_ids(tiny, 15, seed=3)
    logp, length = sequence_logprob(tiny, ids[0, :11], ids[0, 11:])
    assert length == 4
    torch.testing.assert_close(logp, full_logprobs(tiny, ids)[10:].sum(), rtol=0, atol=1e-5)
    logp.backward()
    assert tiny.lm_head.weight.grad is not None and tiny.lm_head.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprob(tiny, ids[0, :11], [])


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_logo_loss_by_hand():
    # two prompts, M = 2 dispreferred responses each
    chosen, chosen_len = [-2.0, -6.0], [2, 3]
    rejected, rejected_len = [[-9.0, -4.0], [-3.0, -12.0]], [[3, 2], [1, 4]]
    beta, gamma, lam = 2.5, 0.25, 0.1
    expected = 0.0
    for i in range(2):
        reward_w = beta * chosen[i] / chosen_len[i]
        reward_l = sum(beta * rejected[i][j] / rejected_len[i][j] for j in range(2)) / 2
        expected += -math.log(sigmoid(reward_w - reward_l - gamma)) + lam * (-chosen[i] / chosen_len[i])
    expected /= 2  # = (−log σ(2.5·(−1) − 2.5·(−3.5) − 0.25) + 0.1) / 2 + (… ) / 2
    loss = logo_loss(
        torch.tensor(chosen), chosen_len, torch.tensor(rejected), rejected_len, beta, gamma, sft_weight=lam
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_logo_with_one_dispreferred_response_is_simpo():
    chosen, chosen_len, rejected, rejected_len, beta, gamma = -3.0, 4, -8.0, 5, 10.0, 3.0
    simpo = -math.log(sigmoid(beta / chosen_len * chosen - beta / rejected_len * rejected - gamma))  # eq. 1
    args = (torch.tensor([chosen]), [chosen_len], torch.tensor([[rejected]]), [[rejected_len]], beta, gamma)
    assert logo_loss(*args, sft_weight=0.0).item() == pytest.approx(simpo, rel=1e-6)
    # the SFT term adds λ × the per-token negative log-likelihood of the preferred response (eq. 3)
    assert logo_loss(*args, sft_weight=0.1).item() == pytest.approx(simpo + 0.1 * 3.0 / 4, rel=1e-6)


def test_logo_sft_term_raises_the_preferred_likelihood():
    """Eq. 3 as printed (+λ log π) would lower log π(y_w|x) once the preference term saturates."""
    chosen = torch.tensor([-1.0], requires_grad=True)
    loss = logo_loss(chosen, [1], torch.tensor([[-50.0, -60.0]]), [[1, 1]], beta=10.0, gamma=3.0)
    loss.backward()
    assert chosen.grad.item() == pytest.approx(-0.1, abs=1e-6)  # σ-term gradient ≈ 0, SFT term −λ


def test_logo_loss_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[batch, M\]"):
        logo_loss(torch.zeros(2), [1, 1], torch.zeros(2), [1, 1], beta=1.0, gamma=0.0)
    with pytest.raises(ValueError, match=r"\[batch, M\]"):
        logo_loss(torch.zeros(2), [1, 1], torch.zeros(3, 2), torch.ones(3, 2), beta=1.0, gamma=0.0)
