"""probe.probes.logprobs against slow, obvious references: truncated forward passes and full logits."""

import pytest
import torch

import probe
from probe.probes import logprobs

SEQ = 48


def full_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Textbook log-softmax over the model's full logits: Tensor[seq, vocab] for the rows of ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(ids[None]).logits[0].float(), dim=-1)


def truncated_logprob(model, ids: torch.Tensor, start: int, t: int) -> float:
    """log P(x_t | x[start:t]) from a separate forward pass over the truncated context."""
    return full_logprobs(model, ids[start:t])[-1, ids[t]].item()


def random_ids() -> torch.Tensor:
    """LongTensor[SEQ] of random ids from the tiny models' vocabulary of 128, always the same."""
    return torch.randint(0, 128, (SEQ,), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def ids():
    return random_ids()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_head_matches_model_logits(arch, ids, monkeypatch):
    model = probe.tiny_model(arch, **({"final_logit_softcapping": 2.0} if arch == "gemma3" else {}))
    monkeypatch.setattr(logprobs, "HEAD_CHUNK_ELEMENTS", 128 * 9)  # 9 rows per chunk: several chunks
    reference = full_logprobs(model, ids)[:-1]
    scores = logprobs.long_logprobs(model, ids)
    torch.testing.assert_close(scores.target[1:], reference.gather(1, ids[1:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.top[1:], reference.max(-1).values, atol=1e-5, rtol=0)
    assert scores.target[0].isnan()
    some = logprobs.long_logprobs(model, ids, target_positions=[5, 40])
    assert some.target.isnan().sum() == SEQ - 2
    torch.testing.assert_close(some.target[[5, 40]], scores.target[[5, 40]], atol=1e-6, rtol=0)


@pytest.mark.parametrize(("K", "d", "official"), [(10, 7, False), (10, 7, True), (5, 64, True)])
def test_sliding_window_equals_truncated_forwards(tiny, ids, K, d, official):
    # batch_tokens forces several batches and a shorter last window in its own pass
    scores = logprobs.short_logprobs(tiny, ids, K, d, official=official, batch_tokens=2 * (K + d))
    first = K if official else K + 1
    assert scores.target[:first].isnan().all() and not scores.target[first:].isnan().any()
    for t in range(first, SEQ):
        start = (t - first) // d * d + (first - K)  # eq. 8: the block's shared window start
        assert t - start >= K and t - start < K + d
        assert scores.target[t].item() == pytest.approx(truncated_logprob(tiny, ids, start, t), abs=1e-5)


def test_exact_mode_equals_per_token_truncation(tiny, ids):
    K = 12
    scores = logprobs.short_logprobs(tiny, ids, K, d=1, batch_tokens=64)
    for t in range(K + 1, SEQ):
        assert scores.target[t].item() == pytest.approx(truncated_logprob(tiny, ids, t - K, t), abs=1e-5)


def test_target_positions_without_a_short_context_score_nan(tiny, ids):
    scores = logprobs.short_logprobs(tiny, ids, K=12, d=4, target_positions=[3, 12])  # both t <= K
    assert scores.target.isnan().all() and scores.top.isnan().all()
    some = logprobs.short_logprobs(tiny, ids, K=12, d=4, target_positions=[3, 20])
    assert some.target.isfinite().sum() >= 1 and some.target[3].isnan()
