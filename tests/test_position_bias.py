"""Attention-only networks of the controlled study: masks, encodings, eq. (4), training, the bias metric."""

import math

import pytest
import torch

from probe.probes import position_bias
from probe.tasks.classification import Config, InContextClassification
from probe.training.attention_only import (
    AttentionOnly,
    SANConfig,
    accuracy_gaps,
    log_mask,
    rotate,
    train,
    train_together,
)


def content_free(config: SANConfig) -> AttentionOnly:
    """A network whose queries are zero, so every layer's attention is the mask's content-free pattern."""
    torch.manual_seed(0)
    model = AttentionOnly(config)
    with torch.no_grad():
        for qkv in model.qkv:
            qkv.weight[: config.dim] = 0
    return model


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SANConfig(mask="causal"), position_bias.cesaro(17)),
        (SANConfig(mask="decay", gamma=0.8), position_bias.decay_attention(17, -math.log(0.8))),
        (SANConfig(mask="full"), torch.full((17, 17), 1 / 17, dtype=torch.float64)),
    ],
)
def test_content_free_attention_is_the_theory_matrix(config, expected):
    _, attention = content_free(config)(torch.randn(3, 17, 64))
    torch.testing.assert_close(attention[:, 0].double(), expected.expand(3, 17, 17), atol=1e-6, rtol=0)


def test_window_and_prefix_graphs():
    for config, mask in [
        (SANConfig(mask="window", window=5), position_bias.causal_mask(17, window=5)),
        (SANConfig(mask="prefix", prefix=4), position_bias.causal_mask(17, prefix=4)),
    ]:
        assert log_mask(config, 17).isfinite().equal(mask)
        _, attention = AttentionOnly(config)(torch.randn(2, 17, 64))
        assert (attention[..., ~mask] == 0).all() and (attention[..., mask] > 0).all()


def test_rope_is_relative():
    """RoPE scores depend only on i − j: shifting both vectors leaves q·k unchanged."""
    q, k = torch.randn(64), torch.randn(64)
    x = torch.zeros(1, 10, 64)
    x[0, 3], x[0, 1] = q, k
    y = torch.zeros(1, 10, 64)
    y[0, 8], y[0, 6] = q, k
    torch.testing.assert_close(rotate(x)[0, 3] @ rotate(x)[0, 1], rotate(y)[0, 8] @ rotate(y)[0, 6])


def test_output_is_context_selector_times_values():
    """Without residuals, X^(L) = A^(L−1)…A^(0) X^(0) W_V^(0)…W_V^(L−1) (Wu et al. eq. 4), exactly."""
    torch.manual_seed(1)
    model = AttentionOnly(SANConfig(n_layers=3, pe="rope"))
    x = torch.randn(2, 17, 64, dtype=torch.float64)
    model.double()
    hidden = []
    model.readout.register_forward_pre_hook(lambda _, args: hidden.append(args[0]))
    _, attention = model(x)
    product = attention[:, 2] @ attention[:, 1] @ attention[:, 0]
    values = [qkv.weight[2 * 64 :].T for qkv in model.qkv]
    torch.testing.assert_close(hidden[0], (product @ x @ values[0] @ values[1] @ values[2])[:, -1])


def test_bad_config():
    with pytest.raises(ValueError, match="mask must be"):
        SANConfig(mask="alibi")
    with pytest.raises(ValueError, match="pe must be"):
        SANConfig(pe="decay")  # the reference README's --pe decay silently ran NoPE
    with pytest.raises(ValueError, match="n_layers must be"):
        SANConfig(n_layers=0)


def test_n_layers_sets_the_number_of_attention_layers():
    assert len(AttentionOnly(SANConfig(n_layers=4, mask="decay")).qkv) == 4


@pytest.fixture
def one_thread():
    """Tiny tensors: thread hand-offs cost far more than the arithmetic on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_training_lowers_the_loss(one_thread):
    torch.manual_seed(0)
    task = InContextClassification(Config(classes=64), seed=0)
    model = AttentionOnly(SANConfig(n_layers=2, residual=True))
    losses = train(model, task, steps=60, batch_size=64, lr=3e-3, data=task.batch(64 * 20))
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 0.2
    assert not model.training


@pytest.mark.parametrize(
    "config, pooled",
    [(SANConfig(n_layers=2, pe="rope", residual=True), True), (SANConfig(n_layers=3, mask="decay"), False)],
)
def test_networks_trained_together_follow_their_lone_trajectories(one_thread, config, pooled):
    """Stacked + vmapped training (one AdamW over [networks, ...]) equals training each network alone."""
    seeds = [0, 1, 2]

    def networks():
        models = []
        for seed in seeds:
            torch.manual_seed(seed)
            models.append(AttentionOnly(config))
        return models, [InContextClassification(Config(classes=64), seed=seed) for seed in seeds]

    alone, tasks = networks()
    pools = [task.batch(16 * 3) for task in tasks] if pooled else [None] * 3
    lone_losses = [
        train(model, task, steps=8, batch_size=16, data=pool)
        for model, task, pool in zip(alone, tasks, pools, strict=True)
    ]
    together, tasks = networks()
    pools = [task.batch(16 * 3) for task in tasks] if pooled else None
    losses = train_together(together, tasks, steps=8, batch_size=16, data=pools)
    assert losses.shape == (8, 3)
    torch.testing.assert_close(losses, torch.tensor(lone_losses).T, rtol=1e-5, atol=1e-6)
    for a, b in zip(alone, together, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        assert not b.training
    assert not torch.equal(together[0].qkv[0].weight, together[1].qkv[0].weight)  # really three networks


def test_train_together_refuses_mixed_architectures():
    models = [AttentionOnly(SANConfig(n_layers=2)), AttentionOnly(SANConfig(n_layers=3))]
    with pytest.raises(ValueError, match="one SANConfig"):
        train_together(models, [InContextClassification(seed=0)] * 2, steps=1)


class FirstItemReader(torch.nn.Module):
    """Answers with the label token right after item 0, whatever the query: a purely positional model."""

    def __init__(self, task: InContextClassification):
        super().__init__()
        self.labels = task.label_vectors

    def forward(self, x):
        return x[:, 1] @ self.labels.T, None


def test_accuracy_gap_of_a_positional_model_is_the_ceiling():
    """acc[first, b] = 1; acc[b, first] = P(item 0 shares the query's label) = 3/7 + 4/7 · 1/32."""
    task = InContextClassification(seed=0)
    gaps = accuracy_gaps(FirstItemReader(task), task, size=4000).set_index("pair")
    ceiling = 4 / 7 * 31 / 32
    assert gaps.loc["first vs middle", "acc_ab"] == 1.0
    assert gaps.loc["first vs middle", "gap"] == pytest.approx(ceiling, abs=0.03)
    assert gaps.loc["first vs last", "gap"] == pytest.approx(ceiling, abs=0.03)
    assert gaps.loc["middle vs last", "gap"] == pytest.approx(0, abs=0.04)
